"""Checkpoints (chapter 11): sharded, verified, atomic; resharding; bitwise resume.

Everything is compared bit for bit (``torch.equal``, ``==`` on losses): saving and loading copy bytes, and
a resumed run replays exactly the arithmetic of the uninterrupted one.

The multi-rank runs are batched into a few spawns: 4 ranks save (row boxes with uneven sizes, a ZeRO-1
training state, a save that crashes before its commit), then 2 and 3 ranks load them (into ZeRO-2 and
FSDP); the 2-rank spawn also loads a plain checkpoint written by this process and runs the round trip,
the asynchronous save (training goes on meanwhile) and the bitwise resume. Column blocks (strided boxes, as
row-parallel tensor parallelism holds them) are saved by 2 ranks and read back at 1 rank whole and at 3
ranks as row and as column blocks. Damaged checkpoints are copies of the 4-rank folder checked in this
process.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import shutil
import signal
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

import refimpl.checkpoint.checkpointer as ckpt_mod  # write_rank_file is looked up there
from refimpl.checkpoint import (
    MANIFEST,
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    SaveSchedule,
    ShardMeta,
    capture_rng_state,
    expected_shapes,
    find_latest_valid,
    list_checkpoints,
    load_training_state,
    optimizer_shards,
    parameter_shards,
    plan_pieces,
    read_manifest,
    restore_rng_state,
    save_training_state,
    verify_checkpoint,
)
from refimpl.config import ConfigError, ModelConfig, OptimConfig
from refimpl.distributed import seed_everything
from refimpl.distributed.placement import Box, LocalShard
from refimpl.launch import run_ranks
from refimpl.models import GPT, lm_loss
from refimpl.optim import build_optimizer, lr_at, param_groups, set_lr
from tests.support.timeouts import SPAWN_TIMEOUT_S

OPTIM = OptimConfig(lr=1e-2, warmup_steps=2)
# Global tensors saved as boxes of rows at 4 ranks: 10, 7 and 40 rows are not multiples of 4 (nor 10, 7,
# 40 of 3). [start, end) of dim 0 per rank; "a" leaves rank 2 empty, "c" is replicated.
SHAPES = {"a": (10,), "b": (7, 3), "c": (40,)}
SAVE_ROWS = {"a": [(0, 1), (1, 5), (5, 5), (5, 10)], "b": [(0, 2), (2, 4), (4, 6), (6, 7)],
             "c": [(0, 40)] * 4}


def _tiny_gpt(seed: int = 0) -> GPT:
    return GPT(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, max_seq_len=16), seed=seed)


def _reference(name: str, step: int) -> torch.Tensor:
    """The global value of flat-shard tensor ``name`` in the checkpoint of ``step``."""
    shape = SHAPES[name]
    g = torch.Generator().manual_seed(100 * ord(name) + step)  # not hash(): it differs per process
    return torch.randn(math.prod(shape), generator=g, dtype=torch.float64).reshape(shape)


def _row_shards(rank: int, step: int) -> dict[str, LocalShard]:
    out = {}
    for name, spans in SAVE_ROWS.items():
        start, end = spans[rank]
        box = Box.full(SHAPES[name]).narrow(0, start, end - start)
        out[name] = LocalShard(_reference(name, step)[box.slices()].clone(), box)
    return out


def _portable(obj):
    """Tensors as numpy arrays: results cross the process boundary by value (torch would share storage
    through file descriptors that die with the worker)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    return obj


def _by_name(model: torch.nn.Module, optimizer_state: dict) -> dict[str, dict]:
    """A consolidated optimizer state dict keyed by parameter name instead of index."""
    names = [n for g in param_groups(model, OPTIM.weight_decay) for n in _names_of(model, g["params"])]
    return {names[i]: {k: v.clone() for k, v in s.items()} for i, s in optimizer_state["state"].items()}


def _names_of(model: torch.nn.Module, params: list) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


def _zero_optimizer(model: torch.nn.Module, zero_stage: int):
    from refimpl.parallel.zero import ShardedOptimizer

    return ShardedOptimizer(param_groups(model, OPTIM.weight_decay), torch.optim.AdamW, zero_stage=zero_stage,
                            lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps, foreach=False)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed data per (step, rank), rows picked with the global RNGs (so a resume must restore them)."""
    pool = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(1000 + 10 * step + rank))
    rows = (torch.randint(0, 4, (2,)) + int(4 * random.random()) + int(np.random.randint(4))) % 4
    window = pool[rows]
    return window[:, :-1], window[:, 1:]


def _train(model, optimizer, ctx, start: int, stop: int, total: int = 4) -> list[float]:
    """Data-parallel AdamW steps ``[start, stop)`` (gradients averaged by hand); the global losses."""
    losses = []
    for step in range(start, stop):
        set_lr(optimizer, lr_at(step, OPTIM, total))
        x, y = _batch(step, ctx.rank)
        loss = lm_loss(model(x), y)
        loss.backward()
        if ctx.world_size > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(ctx.world_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if ctx.world_size > 1:
            dist.all_reduce(value)
        losses.append(value.item())
    return losses


class _CrashingCheckpointer(Checkpointer):
    """Every rank fails after its file is written, before the manifest and the rename (a crash)."""

    def _commit(self, job, files):
        raise RuntimeError("simulated crash before the commit")


# ------------------------------------------------------------------------------------------ rank workers
def _save_at_4(ctx, folder: str) -> dict:
    flat = os.path.join(folder, "flat")
    ck = Checkpointer(CheckpointConfig(folder=flat, keep_last=3, split_min_numel=2))
    for step in (1, 2):
        ck.save(step, _row_shards(ctx.rank, step), state={"step": step}, rank_state={"rank": ctx.rank})
    crash = _CrashingCheckpointer(CheckpointConfig(folder=flat))
    with pytest.raises(RuntimeError, match="simulated crash"):
        crash.save(3, _row_shards(ctx.rank, 3))
    dist.barrier()
    out: dict = {}
    if ctx.rank == 0:
        out["leftovers"] = sorted(p.name for p in os.scandir(flat) if ".tmp-" in p.name)
        out["leftover_files"] = sorted(os.listdir(os.path.join(flat, out["leftovers"][0])))
        out["latest"] = open(os.path.join(flat, "latest")).read().strip()
        out["c_files"] = sorted({p["file"] for p in read_manifest(os.path.join(flat, "step_00000002"))
                                 ["entries"]["c"]["pieces"]})
    dist.barrier()
    info = ck.find_latest_valid()
    out["found_step"] = info.step
    out["leftovers_after"] = [p.name for p in os.scandir(flat) if ".tmp-" in p.name]

    # ZeRO-1 at 4 ranks: two steps, then the training state as it is held (1/4 of the moments per rank).
    seed_everything(0, rank=ctx.rank)
    model = _tiny_gpt()
    optimizer = _zero_optimizer(model, zero_stage=1)
    _train(model, optimizer, ctx, 0, 2)
    zero_ck = Checkpointer(CheckpointConfig(folder=os.path.join(folder, "zero1")))
    save_training_state(zero_ck, 2, model=model, optimizer=optimizer)
    out["zero_moments_saved_here"] = sum(s.box.numel for n, s in optimizer_shards(model, optimizer).items()
                                         if n.endswith("exp_avg"))
    consolidated = optimizer.state_dict()  # collective
    out["model"] = _portable(model.state_dict())
    out["optimizer"] = _portable(_by_name(model, consolidated))
    return out


def _load(ctx, folder: str, zero_ref: dict, plain_ref: dict | None) -> dict:
    from refimpl.parallel.zero import FullyShardedDataParallel

    w, r = ctx.world_size, ctx.rank
    zero_ref, plain_ref = _portable(zero_ref), _portable(plain_ref)
    ck = Checkpointer(CheckpointConfig(folder=os.path.join(folder, "flat")))
    info = ck.find_latest_valid(expected=SHAPES)
    assert info.step == 2
    for name, shape in SHAPES.items():  # uneven rows at the new world size: ceil chunks, last short
        box = Box.chunk(shape, 0, r, w)
        target = torch.full(box.shape, float("nan"), dtype=torch.float64)
        rank_state = ck.load(info, {name: LocalShard(target, box)})
        assert torch.equal(target, _reference(name, 2)[box.slices()]), name
        full = torch.empty(shape, dtype=torch.float64)
        ck.load(info, {name: full})
        assert torch.equal(full, _reference(name, 2)), name
        assert rank_state == {"rank": r}  # ranks 0..w-1 < 4 all had a file

    # ZeRO-1 at 4 -> FSDP (ZeRO-3) at w, and -> ZeRO-2 at w.
    zero_ck = Checkpointer(CheckpointConfig(folder=os.path.join(folder, "zero1")))
    fsdp = FullyShardedDataParallel(_tiny_gpt(seed=7))
    fsdp_opt = build_optimizer(fsdp, OPTIM)
    zinfo = zero_ck.resume_point(expected=expected_shapes(fsdp))
    state = load_training_state(zero_ck, zinfo, model=fsdp, optimizer=fsdp_opt)
    assert state["step"] == 2
    full = fsdp.full_state_dict()
    for name, value in zero_ref["model"].items():
        if name in full:
            assert torch.equal(full[name], value), name
    checked = 0
    for entry, shard in optimizer_shards(fsdp, fsdp_opt).items():
        _, pname, key = entry.split("/")
        ref = zero_ref["optimizer"][pname][key]
        if ref.dim() == 0:
            assert torch.equal(shard.tensor, ref), entry
        else:
            assert torch.equal(shard.tensor, ref[shard.box.slices()]), entry
            checked += shard.box.numel if key == "exp_avg" else 0
    model = _tiny_gpt(seed=8)
    zero2 = _zero_optimizer(model, zero_stage=2)
    load_training_state(zero_ck, zinfo, model=model, optimizer=zero2)
    consolidated = _by_name(model, zero2.state_dict())
    for pname, ref_state in zero_ref["optimizer"].items():
        for key, ref in ref_state.items():
            assert torch.equal(consolidated[pname][key], ref), (pname, key)
    for name, value in zero_ref["model"].items():
        assert torch.equal(model.state_dict()[name], value), name

    if plain_ref is not None:  # a plain model and AdamW saved by one process, loaded at w ranks
        plain_ck = Checkpointer(CheckpointConfig(folder=os.path.join(folder, "plain1")))
        model = _tiny_gpt(seed=9)
        optimizer = build_optimizer(model, OPTIM)
        load_training_state(plain_ck, plain_ck.find_latest_valid(), model=model, optimizer=optimizer)
        for name, value in plain_ref["model"].items():
            assert torch.equal(model.state_dict()[name], value), name
        for pname, ref_state in plain_ref["optimizer"].items():
            for key, ref in ref_state.items():
                assert torch.equal(_by_name(model, optimizer.state_dict())[pname][key], ref), (pname, key)
    return {"moments_checked": checked}


def _at_2_ranks(ctx, folder: str, zero_ref: dict, plain_ref: dict, resume_folder: str) -> dict:
    return {"load": _load(ctx, folder, zero_ref, plain_ref),
            "resume": _roundtrip_and_resume(ctx, resume_folder)}


def _roundtrip_and_resume(ctx, folder: str) -> list[list[float]]:
    """Uninterrupted 4 steps vs 2 steps + async save (training goes on meanwhile) + fresh load + 2 steps."""
    seed_everything(0, rank=ctx.rank)
    model = _tiny_gpt()
    optimizer = build_optimizer(model, OPTIM)
    uninterrupted = _train(model, optimizer, ctx, 0, 4)

    seed_everything(0, rank=ctx.rank)
    model = _tiny_gpt()
    optimizer = build_optimizer(model, OPTIM)
    _train(model, optimizer, ctx, 0, 2)
    saved_model = copy.deepcopy(model.state_dict())
    saved_optim = copy.deepcopy(optimizer.state_dict())
    ck = Checkpointer(CheckpointConfig(folder=folder, async_save=True))
    save_training_state(ck, 2, model=model, optimizer=optimizer, extra={"data": {"next_step": 2}},
                        config={"optim": {"lr": OPTIM.lr}})
    _train(model, optimizer, ctx, 2, 3)  # goes on while the files are written; moves the RNGs too
    assert ck.wait() is not None

    seed_everything(123, rank=ctx.rank)  # a restarted process: other weights, other RNG streams
    model = _tiny_gpt(seed=5)
    optimizer = build_optimizer(model, OPTIM)
    resume_ck = Checkpointer(CheckpointConfig(folder=folder))
    info = resume_ck.resume_point(expected=expected_shapes(model))
    state = load_training_state(resume_ck, info, model=model, optimizer=optimizer)
    assert state["step"] == 2 and state["data"] == {"next_step": 2}
    assert info.manifest["config"] == {"optim": {"lr": OPTIM.lr}} and info.manifest["world_size"] == 2
    for name, value in saved_model.items():
        assert torch.equal(model.state_dict()[name], value), name
    loaded = optimizer.state_dict()
    assert loaded["param_groups"] == saved_optim["param_groups"]
    for index, entry in saved_optim["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded["state"][index][key], value), (index, key)
    resumed = _train(model, optimizer, ctx, state["step"], 4)
    return [uninterrupted, resumed]


# ------------------------------------------------------------ column blocks (strided boxes): 2 -> 1 and 3
COLUMN_SHAPES = {"w": (6, 10), "odd": (7, 9)}  # 7 x 9: 5 + 4 columns at 2 ranks, 3 + 3 + 1 rows at 3


def _column_reference(name: str) -> torch.Tensor:
    """Distinct values, so that an element read from the wrong place cannot compare equal."""
    shape = COLUMN_SHAPES[name]
    return (torch.arange(math.prod(shape), dtype=torch.float32) + 1000 * len(name)).reshape(shape)


def _save_column_blocks(ctx, folder: str) -> None:
    """Each of 2 ranks holds a column block of every tensor (``Box.chunk(shape, 1, r, 2)``, as row-parallel
    tensor parallelism holds ``[out, in]`` weights), a strided view of a full tensor; saved as it is, and
    (negative control) with the two ranks' boxes of ``w`` swapped."""
    for kind in ("columns", "swapped"):
        shards = {}
        for name, shape in COLUMN_SHAPES.items():
            box = Box.chunk(shape, 1, ctx.rank, 2)
            local = _column_reference(name).clone()[box.slices()]
            assert not local.is_contiguous()  # the full tensor's row stride
            if kind == "swapped" and name == "w":  # 5 + 5 columns: the other rank's box has the same shape
                box = Box.chunk(shape, 1, 1 - ctx.rank, 2)
            shards[name] = LocalShard(local, box)
        Checkpointer(CheckpointConfig(folder=os.path.join(folder, kind))).save(1, shards)


def _read_blocks_at_3(ctx, folder: str) -> dict[str, bool]:
    """Every rank of 3 reads its row block and its column block of each tensor, into strided targets."""
    from refimpl.parallel.data_parallel import DataParallelBucket, DataParallelNaive

    ck = Checkpointer(CheckpointConfig(folder=os.path.join(folder, "columns")))
    info = ck.find_latest_valid(expected=COLUMN_SHAPES)
    out = {}
    for name, shape in COLUMN_SHAPES.items():
        ref = _column_reference(name)
        for dim in (0, 1):
            box = Box.chunk(shape, dim, ctx.rank, 3)
            big = torch.full((shape[0] + 2, shape[1] + 3), float("nan"))  # the target: a view inside it
            target = big[1 : 1 + box.shape[0], 2 : 2 + box.shape[1]]
            ck.load(info, {name: LocalShard(target, box)})
            untouched = int(big.isnan().sum()) == big.numel() - box.numel
            same = torch.equal(target, ref[box.slices()])
            out[f"{name} dim {dim} {box.offsets} {box.shape}"] = same and untouched
    # refimpl's data-parallel wrappers declare their replicas under the wrapped model's names
    plain = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    names = set(parameter_shards(plain))
    for wrapper in (DataParallelNaive(plain), DataParallelBucket(plain)):
        shards = parameter_shards(wrapper)
        out[type(wrapper).__name__] = set(shards) == names and all(s.box.is_full for s in shards.values())
    return out


@pytest.fixture(scope="module")
def column_blocks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("columns")
    run_ranks(_save_column_blocks, 2, str(folder), timeout_s=SPAWN_TIMEOUT_S)
    return folder


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_column_blocks_saved_by_2_ranks_read_bitwise_at_1_rank_and_a_swapped_box_fails(column_blocks):
    for kind in ("columns", "swapped"):
        info = find_latest_valid(column_blocks / kind, expected=COLUMN_SHAPES)
        pieces = [(p["file"], p["offsets"], p["shape"]) for p in info.manifest["entries"]["odd"]["pieces"]]
        assert pieces == [("rank_00000.pt", [0, 0], [7, 5]), ("rank_00001.pt", [0, 5], [7, 4])]
        for name, shape in COLUMN_SHAPES.items():
            whole = torch.full(shape, float("nan"))
            Checkpointer(CheckpointConfig(folder=column_blocks / kind)).load(info, {name: whole})
            # negative control: rank 0's columns saved as rank 1's box (and back) give another tensor
            expected = kind == "columns" or name != "w"
            assert torch.equal(whole, _column_reference(name)) == expected, (kind, name)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 30)
def test_column_blocks_read_bitwise_at_3_ranks_as_rows_and_as_columns(column_blocks):
    results = run_ranks(_read_blocks_at_3, 3, str(column_blocks), timeout_s=SPAWN_TIMEOUT_S)
    for rank, checks in enumerate(results):
        assert len(checks) == 2 * len(COLUMN_SHAPES) + 2 and all(checks.values()), (rank, checks)


class _ColumnBlockLayer(torch.nn.Module):
    """A row-parallel layer's weight at tensor-parallel rank ``tp`` of 2: columns ``Box.chunk((6, 10), 1,
    tp, 2)`` of the global ``w``, declared by ``local_shards`` as tensor parallelism will (chapter 06)."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.box = Box.chunk(COLUMN_SHAPES["w"], 1, tp, 2)
        self.weight = torch.nn.Parameter(_column_reference("w")[self.box.slices()].clone())

    def local_shards(self) -> dict[str, LocalShard]:
        return {"weight": LocalShard(self.weight, self.box)}


def _zero1_over_column_blocks(ctx, folder: str) -> dict:
    """tp 2 x dp 2, tp innermost: ZeRO-1 (the real ShardedOptimizer) over each dp pair shards the rows of
    the rank's column block; one AdamW step, then the training state is saved as the ranks hold it."""
    from refimpl.parallel.zero import ShardedOptimizer

    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both, in one order
    tp, dp = ctx.rank % 2, ctx.rank // 2
    model = _ColumnBlockLayer(tp)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, dp_groups[tp], zero_stage=1, lr=1e-2,
                                 foreach=False)
    model.weight.grad = torch.sin(_column_reference("w"))[model.box.slices()].contiguous()  # one per tp pair
    optimizer.step()
    save_training_state(Checkpointer(CheckpointConfig(folder=folder)), 1, model=model, optimizer=optimizer)
    (_, stepped, _), = optimizer.local_state_shards()
    return {"tp": tp, "dp": dp, "weight": _portable(model.weight),
            "exp_avg": _portable(optimizer.inner_optimizer.state[stepped]["exp_avg"])}


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_zero1_over_column_blocks_saves_composed_boxes_read_back_whole(tmp_path):
    """ZeRO-1's row shard of a tensor-parallel column block is the box ``tp_box.within(zero_box)``: 4
    ranks save it, one process reads the whole moment and weight and finds every rank's values in place."""
    results = run_ranks(_zero1_over_column_blocks, 4, str(tmp_path), timeout_s=SPAWN_TIMEOUT_S)
    info = find_latest_valid(tmp_path)
    shape = COLUMN_SHAPES["w"]
    expected_boxes = {}
    weight, exp_avg = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    for rank, r in enumerate(results):
        columns = Box.chunk(shape, 1, r["tp"], 2)
        box = columns.within(Box.chunk(columns.shape, 0, r["dp"], 2))  # rows [0, 3) or [3, 6) of the block
        expected_boxes[rank] = (list(box.offsets), list(box.shape))
        weight[columns.slices()] = _portable(r["weight"])  # both dp ranks hold the whole block
        exp_avg[box.slices()] = _portable(r["exp_avg"])  # each holds its rows
    saved = {int(p["file"][5:10]): (p["offsets"], p["shape"])
             for p in info.manifest["entries"]["optimizer/weight/exp_avg"]["pieces"]}
    assert saved == expected_boxes, saved
    assert not exp_avg.isnan().any() and not torch.equal(weight, _column_reference("w"))  # it stepped
    whole = {"model/weight": torch.empty(shape), "optimizer/weight/exp_avg": torch.empty(shape)}
    Checkpointer(CheckpointConfig(folder=tmp_path)).load(info, whole)
    assert torch.equal(whole["model/weight"], weight)
    assert torch.equal(whole["optimizer/weight/exp_avg"], exp_avg)


# ------------------------------------------------------------------------------------------------ spawns
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("ckpt")
    out = run_ranks(_save_at_4, 4, str(folder), timeout_s=SPAWN_TIMEOUT_S)
    return {"folder": folder, "rank0": out[0]}


@pytest.fixture(scope="module")
def plain_ref(saved) -> dict:
    """A plain model + AdamW after one step, saved by this (single) process."""
    torch.manual_seed(0)
    model = _tiny_gpt(seed=3)
    optimizer = build_optimizer(model, OPTIM)
    x = torch.randint(0, 256, (2, 8))
    lm_loss(model(x), x).backward()
    optimizer.step()
    save_training_state(Checkpointer(CheckpointConfig(folder=saved["folder"] / "plain1")), 1, model=model,
                        optimizer=optimizer)
    return _portable({"model": model.state_dict(), "optimizer": _by_name(model, optimizer.state_dict())})


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_save_at_4_ranks_parallel_dedup_and_crash_before_commit(saved):
    r0 = saved["rank0"]
    assert r0["c_files"] == [f"rank_{r:05d}.pt" for r in range(4)]  # replicated: written in 4 parallel slices
    assert r0["latest"] == "step_00000002"  # the crashed save of step 3 did not move "latest"
    assert len(r0["leftovers"]) == 1 and r0["leftovers"][0].startswith("step_00000003.tmp-")
    assert r0["leftover_files"] == [f"rank_{r:05d}.pt" for r in range(4)]  # all written, no manifest
    assert r0["found_step"] == 2 and r0["leftovers_after"] == []
    total_moments = sum(p.numel() for p in _tiny_gpt().parameters())
    assert r0["zero_moments_saved_here"] < total_moments // 2  # ZeRO-1: each rank saved its own quarter


@pytest.fixture(scope="module")
def at_2_ranks(saved, plain_ref, tmp_path_factory) -> list[dict]:
    return run_ranks(_at_2_ranks, 2, str(saved["folder"]), saved["rank0"], plain_ref,
                     str(tmp_path_factory.mktemp("resume")), timeout_s=SPAWN_TIMEOUT_S)


def _check_moments(results: list[dict]) -> None:
    total = sum(p.numel() for p in _tiny_gpt().parameters())
    assert sum(r["moments_checked"] for r in results) == total  # the FSDP shards tile every moment


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 60)
def test_reshard_4_to_2_ranks_row_boxes_zero_stages_and_1_to_2(at_2_ranks):
    _check_moments([r["load"] for r in at_2_ranks])


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 60)
def test_reshard_4_to_3_ranks_row_boxes_and_zero_stages(saved):
    _check_moments(run_ranks(_load, 3, str(saved["folder"]), saved["rank0"], None, timeout_s=SPAWN_TIMEOUT_S))


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 60)
def test_roundtrip_async_save_and_bitwise_resume_at_2_ranks(at_2_ranks):
    uninterrupted, resumed = at_2_ranks[0]["resume"]
    assert resumed == uninterrupted[2:]  # exactly, not approximately
    assert len(set(uninterrupted)) == 4


class _OneRank:
    rank, world_size = 0, 1


@pytest.mark.timeout(60)
def test_bitwise_resume_in_one_process_needs_the_rng_states(tmp_path):
    seed_everything(0)
    model = _tiny_gpt()
    uninterrupted = _train(model, build_optimizer(model, OPTIM), _OneRank, 0, 4)
    seed_everything(0)
    model = _tiny_gpt()
    optimizer = build_optimizer(model, OPTIM)
    _train(model, optimizer, _OneRank, 0, 2)
    ck = Checkpointer(CheckpointConfig(folder=tmp_path))
    save_training_state(ck, 2, model=model, optimizer=optimizer)
    for restore_rng in (True, False):  # negative control: without the RNG states the batches differ
        seed_everything(7)
        model = _tiny_gpt(seed=5)
        optimizer = build_optimizer(model, OPTIM)
        state = load_training_state(ck, ck.resume_point(), model=model, optimizer=optimizer,
                                    restore_rng=restore_rng)
        resumed = _train(model, optimizer, _OneRank, state["step"], 4)
        assert (resumed == uninterrupted[2:]) == restore_rng


# ------------------------------------------------------------------------------ damage, in this process
def _damaged_copy(saved, tmp_path, damage) -> tuple:
    folder = tmp_path / "flat"
    shutil.copytree(saved["folder"] / "flat", folder)
    newest = folder / "step_00000002"
    damage(newest)
    return folder, newest


def _flip_bit(path, position=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if position is None else position
    data[i] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _set_version(step_dir):
    text = (step_dir / MANIFEST).read_text().replace('"format_version": 2', '"format_version": 99')
    (step_dir / MANIFEST).write_text(text)


DAMAGES = {
    "missing rank file": (lambda d: (d / "rank_00002.pt").unlink(), "rank_00002.pt is missing"),
    "truncated file": (lambda d: _truncate(d / "rank_00001.pt"), "truncated"),
    "flipped bit": (lambda d: _flip_bit(d / "rank_00003.pt"), "sha256 mismatch"),
    "manifest missing": (lambda d: (d / MANIFEST).unlink(), "manifest.json is missing"),
    "wrong format version": (_set_version, "format version 99 is not supported"),
    "edited manifest": (lambda d: _flip_bit(d / MANIFEST, position=40), "manifest"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(DAMAGES))
def test_damaged_checkpoint_is_rejected_and_load_falls_back(saved, tmp_path, kind):
    damage, message = DAMAGES[kind]
    folder, newest = _damaged_copy(saved, tmp_path, damage)
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(newest)
    info = find_latest_valid(folder)
    assert info.step == 1 and len(info.skipped) == 1 and message in info.skipped[0]
    target = torch.empty(SHAPES["b"], dtype=torch.float64)
    Checkpointer(CheckpointConfig(folder=folder)).load(info, {"b": target})
    assert torch.equal(target, _reference("b", 1))


@pytest.mark.timeout(60)
def test_wrong_shape_rejected_and_nothing_valid_is_a_clear_error(saved, tmp_path):
    folder, _ = _damaged_copy(saved, tmp_path, lambda d: None)
    info = find_latest_valid(folder, expected={"a": (10,), "b": (7, 3)})
    assert info.step == 2
    with pytest.raises(CheckpointError, match=r"'b' has shape \(7, 3\) but \(3, 7\) is expected") as err:
        find_latest_valid(folder, expected={"b": (3, 7)})
    assert "step_00000002 rejected" in str(err.value) and "step_00000001 rejected" in str(err.value)
    assert issubclass(CheckpointError, Exception)  # unlike DCP's CheckpointException (a BaseException)
    assert find_latest_valid(tmp_path / "nothing here") is None


@pytest.mark.timeout(60)
def test_flipped_bit_in_tensor_data_loads_silently_without_the_checksum(saved, tmp_path):
    """Negative control: torch.load does not notice a flipped bit in tensor bytes; our sha256 does."""
    folder, newest = _damaged_copy(saved, tmp_path, lambda d: None)
    path = newest / "rank_00001.pt"
    piece = torch.load(path, weights_only=True)["pieces"]["a@1"]  # rank 1 holds the box [1, 5) of "a"
    position = path.read_bytes().find(piece.numpy().tobytes())
    assert position > 0
    _flip_bit(path, position + 3)
    damaged = torch.load(path, weights_only=True)["pieces"]["a@1"]  # no error...
    assert not torch.equal(damaged, piece)  # ...but different numbers
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        verify_checkpoint(newest)


def _rewrite_manifest(step_dir, **fields) -> None:
    """Set ``fields`` in a manifest and recompute its own checksum (sha256 of its canonical JSON)."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest.update(fields)
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    manifest["manifest_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                                                 .encode()).hexdigest()
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.timeout(60)
def test_a_checkpoint_of_format_version_1_is_refused_in_one_line(saved, tmp_path):
    folder, newest = _damaged_copy(saved, tmp_path, lambda d: None)
    _rewrite_manifest(newest, format_version=2)  # control: the rewrite itself keeps it valid
    assert verify_checkpoint(newest)["format_version"] == 2
    for step_dir in list_checkpoints(folder):
        _rewrite_manifest(step_dir, format_version=1)  # checksum valid: only the version is wrong
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(newest)
    message = str(err.value)
    assert "\n" not in message and "format version 1 is not supported" in message, message
    assert "this refimpl reads version 2 only" in message, message
    with pytest.raises(CheckpointError, match="no valid checkpoint") as err:
        find_latest_valid(folder)
    assert str(err.value).count("format version 1 is not supported") == 2


@pytest.mark.timeout(60)
def test_a_manifest_whose_boxes_overlap_or_leave_a_hole_is_refused(saved, tmp_path):
    folder, newest = _damaged_copy(saved, tmp_path, lambda d: None)
    entries = json.loads((newest / MANIFEST).read_text())["entries"]
    pieces = entries["b"]["pieces"]  # rows 0-1, 2-3, 4-5, 6 of a [7, 3] tensor
    assert [p["offsets"] for p in pieces] == [[0, 0], [2, 0], [4, 0], [6, 0]]
    overlapping = [*pieces[:1], {**pieces[1], "offsets": [1, 0]}, *pieces[2:]]
    for damaged, message in ((overlapping, "two pieces of 'b' overlap"), (pieces[:-1], "cover 18 of 21")):
        _rewrite_manifest(newest, entries={**entries, "b": {**entries["b"], "pieces": damaged}})
        with pytest.raises(CheckpointError, match=message):
            verify_checkpoint(newest)
    assert find_latest_valid(folder).step == 1  # the previous checkpoint is used


class _RowParallelBlock(torch.nn.Module):
    """Holds columns [3, 6) of a global [4, 6] weight and says so, as a row-parallel layer will (ch. 06)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3))
        self.register_buffer("scale", torch.ones(3))
        self.inner = torch.nn.Linear(2, 2)  # claimed with the rest of the subtree: not listed on its own

    def local_shards(self) -> dict[str, LocalShard]:
        return {"weight": LocalShard(self.weight, Box.full((4, 6)).narrow(1, 3, 3)),
                "scale": LocalShard.full(self.scale)}


class _ZeroRowsOf:
    """An optimizer that, like ZeRO-1 at rank 1 of 2, steps rows [2, 4) of each parameter's local tensor."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.views = [p.detach()[2:4] for p in params]
        self.inner_optimizer = torch.optim.AdamW(self.views, lr=1e-2)

    def local_state_shards(self):
        return [(p, v, Box.full(p.shape).narrow(0, 2, 2))
                for p, v in zip(self.params, self.views, strict=True)]


def test_modules_declare_their_boxes_at_any_depth_and_optimizers_compose_them():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sequential(_RowParallelBlock()))
    model[0].register_buffer("scratch", torch.zeros(2), persistent=False)
    shards = parameter_shards(model)
    assert sorted(shards) == ["model/0.bias", "model/0.weight", "model/1.0.scale", "model/1.0.weight"]
    assert shards["model/1.0.weight"].box == Box((4, 6), (0, 3), (4, 3))
    assert all(shards[n].box.is_full for n in ("model/0.bias", "model/0.weight", "model/1.0.scale"))
    # ZeRO-1 over a tensor-parallel shard: rows [2, 4) of the local columns [3, 6) = global [2, 4) x [3, 6)
    block = model[1][0]
    optimizer = _ZeroRowsOf([block.weight])
    optimizer.views[0].grad = torch.ones(2, 3)
    optimizer.inner_optimizer.step()
    state = optimizer_shards(model, optimizer)
    assert state["optimizer/1.0.weight/exp_avg"].box == Box((4, 6), (2, 3), (2, 3))
    assert state["optimizer/1.0.weight/step"].box.is_full
    block.local_shards = lambda: {"weight": block.weight}  # negative control: not a LocalShard
    with pytest.raises(TypeError, match=r"local_shards\(\)\['weight'\] is a Parameter, not a LocalShard"):
        parameter_shards(model)


# ------------------------------------------------------------------------------- protocol, one process
@pytest.mark.timeout(60)
def test_keep_last_k_prunes_and_latest_points_to_newest(tmp_path):
    ck = Checkpointer(CheckpointConfig(folder=tmp_path, keep_last=2))
    for step in range(1, 5):
        ck.save(step, {"x": torch.full((3,), float(step))}, state={"step": step})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"
    ck.save(3, {"x": torch.zeros(3)})  # the same step again (a resumed run) replaces it
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004"]


@pytest.mark.timeout(60)
def test_a_failed_rename_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    """The commit point is the rename of the temp folder: when it fails, nothing may name the new step."""
    ck = Checkpointer(CheckpointConfig(folder=tmp_path))
    ck.save(1, {"x": torch.ones(3)}, state={"step": 1})
    real_replace = os.replace

    def failing_rename(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(src)).startswith("step_00000002.tmp-"):
            raise OSError("simulated failure of the commit's rename")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", failing_rename)
    with pytest.raises(CheckpointError, match="simulated failure of the commit's rename"):
        ck.save(2, {"x": torch.full((3,), 2.0)}, state={"step": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert find_latest_valid(tmp_path).step == 1


@pytest.mark.timeout(60)
def test_async_snapshot_is_unaffected_by_later_in_place_updates(tmp_path, monkeypatch):
    release, writing = threading.Event(), threading.Event()
    real_write = ckpt_mod.write_rank_file

    def slow_write(*args, **kwargs):
        writing.set()
        assert release.wait(30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "write_rank_file", slow_write)
    weights = torch.arange(1000, dtype=torch.float32)
    ck = Checkpointer(CheckpointConfig(folder=tmp_path, async_save=True))
    ck.save(1, {"w": weights})
    assert writing.wait(30)  # save() returned while the file is not written yet
    weights.mul_(-1)  # training updates the parameter in place meanwhile
    release.set()
    assert ck.wait() == tmp_path / "step_00000001"
    loaded = torch.empty(1000)
    ck.load(ck.find_latest_valid(), {"w": loaded})
    assert torch.equal(loaded, torch.arange(1000, dtype=torch.float32))


@pytest.mark.timeout(60)
def test_async_save_error_is_raised_by_wait(tmp_path, monkeypatch):
    def failing_write(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt_mod, "write_rank_file", failing_write)
    ck = Checkpointer(CheckpointConfig(folder=tmp_path, async_save=True))
    ck.save(1, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="No space left on device"):
        ck.wait()
    assert list_checkpoints(tmp_path) == [] and [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.timeout(60)
def test_resume_never_refuses_a_folder_with_checkpoints(tmp_path):
    assert Checkpointer(CheckpointConfig(folder=tmp_path, resume="never")).resume_point() is None
    Checkpointer(CheckpointConfig(folder=tmp_path)).save(5, {"x": torch.ones(1)})
    with pytest.raises(CheckpointError, match="already holds checkpoints.*step_00000005"):
        Checkpointer(CheckpointConfig(folder=tmp_path, resume="never")).resume_point()
    assert Checkpointer(CheckpointConfig(folder=tmp_path)).resume_point().step == 5
    with pytest.raises(ConfigError, match="resume"):
        CheckpointConfig(folder=tmp_path, resume="sometimes")


@pytest.mark.timeout(60)
def test_a_small_view_is_saved_without_its_whole_storage(tmp_path):
    big = torch.zeros(1_000_000)
    Checkpointer(CheckpointConfig(folder=tmp_path)).save(1, {"x": LocalShard(big[:10], Box.full((10,)))})
    assert (tmp_path / "step_00000001" / "rank_00000.pt").stat().st_size < 10_000


@pytest.mark.timeout(60)
def test_unloadable_state_is_refused_at_save_time(tmp_path):
    ck = Checkpointer(CheckpointConfig(folder=tmp_path))
    with pytest.raises(CheckpointError, match="ndarray"):
        ck.save(1, {}, rank_state={"x": np.zeros(2)})
    with pytest.raises(CheckpointError, match="JSON"):
        ck.save(1, {}, state={"x": object()})


@pytest.mark.timeout(60)
def test_rng_capture_restore_gives_the_same_numbers():
    seed_everything(3)
    state = capture_rng_state()
    first = (random.random(), float(np.random.rand()), np.random.randn(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(5)  # move on
    restore_rng_state(state)
    again = (random.random(), float(np.random.rand()), np.random.randn(), torch.rand(3))
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])


def _meta(name: str, shape: tuple[int, ...], *cut: tuple[int, int, int]) -> ShardMeta:
    """The box of ``shape`` narrowed by ``(dim, start, length)`` for each cut."""
    box = Box.full(shape)
    for dim, start, length in cut:
        box = box.narrow(dim, start, length)
    return ShardMeta(name, "float32", box)


def _pieces(plan: dict, name: str) -> list[tuple[int, tuple, tuple]]:
    return [(p["rank"], tuple(p["offsets"]), tuple(p["shape"])) for p in plan[name]["pieces"]]


def test_plan_splits_replicas_evenly_and_refuses_bad_layouts():
    meta = [[_meta("r", (100,))] for _ in range(4)]
    assert _pieces(plan_pieces(meta, split_min_numel=10), "r") == [(0, (0,), (25,)), (1, (25,), (25,)),
                                                                   (2, (50,), (25,)), (3, (75,), (25,))]
    small = plan_pieces(meta, split_min_numel=1000)["r"]["pieces"]
    assert len(small) == 1  # too small to be worth splitting: one writer
    with pytest.raises(CheckpointError, match=r"elements \[4, 6\) of a tensor of shape \(10,\) are held"):
        plan_pieces([[_meta("g", (10,), (0, 0, 4))], [_meta("g", (10,), (0, 6, 4))]])
    with pytest.raises(CheckpointError, match="shape"):
        plan_pieces([[_meta("s", (10,))], [_meta("s", (11,))]])


def test_plan_on_boxes_covers_every_element_once_and_finds_2d_holes():
    # a replicated [6, 10] matrix: split along its longest dim (10 columns) among the 2 holders
    replicated = [[_meta("m", (6, 10))] for _ in range(2)]
    assert _pieces(plan_pieces(replicated, split_min_numel=1), "m") == [(0, (0, 0), (6, 5)),
                                                                        (1, (0, 5), (6, 5))]
    # rank 0 holds the top-left block, rank 1 the bottom rows, rank 2 the right columns (overlapping
    # rank 1's): every cell written once; rank 1's two cells of the bottom rows are merged into one piece
    layout = [[_meta("m", (6, 10), (0, 0, 3), (1, 0, 5))], [_meta("m", (6, 10), (0, 3, 3))],
              [_meta("m", (6, 10), (1, 5, 5))]]
    plan = plan_pieces(layout, split_min_numel=100)
    pieces = _pieces(plan, "m")
    count = torch.zeros(6, 10, dtype=torch.int64)
    for _, offsets, shape in pieces:
        count[Box((6, 10), offsets, shape).slices()] += 1
    assert torch.equal(count, torch.ones_like(count)), count
    # the shared cell [3, 6) x [5, 10) goes to the holder with fewer bytes so far (a tie: the lower rank)
    assert pieces == [(0, (0, 0), (3, 5)), (2, (0, 5), (3, 5)), (1, (3, 0), (3, 10))]
    # negative control: without rank 2 the top-right block [0, 3) x [5, 10) has no holder
    with pytest.raises(CheckpointError, match=r"elements \[0, 3\) x \[5, 10\) of a tensor of shape \(6, 10"):
        plan_pieces(layout[:2])
    # the plan is a pure function of the metadata: every rank computes the same one
    assert plan_pieces(layout, split_min_numel=100) == plan


def test_save_schedule_every_n_steps_without_process_group():
    schedule = SaveSchedule(CheckpointConfig(folder="unused", every_steps=3, save_on_sigterm=False))
    assert [s for s in range(1, 10) if schedule.due(s)] == [3, 6, 9]
    assert not schedule.stop_requested


@pytest.mark.timeout(60)
def test_sigterm_asks_for_a_save_and_a_stop_then_the_old_handler_returns():
    before = signal.getsignal(signal.SIGTERM)
    calls = []
    signal.signal(signal.SIGTERM, lambda *a: calls.append(a))
    try:
        schedule = SaveSchedule(CheckpointConfig(folder="unused", every_steps=100))
        try:
            assert not schedule.due(1)
            os.kill(os.getpid(), signal.SIGTERM)
            assert schedule.due(2) and schedule.stop_requested
        finally:
            schedule.close()  # stands the grace timer down (it would exit this process) and gives back
        # the old handler; before close a second SIGTERM exits at once (tests/trainer/ranks/cli/test_train.py
        # checks that)
        os.kill(os.getpid(), signal.SIGTERM)
        assert len(calls) == 1
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_optimizer_keeps_how_this_machine_runs_its_update(tmp_path):
    """A checkpoint saved by CPU ranks (AdamW ``foreach=False``) resumes with the optimizer built here
    (``foreach=True``, as on a GPU): ``foreach``/``fused``/``capturable`` say how, not what, and are not
    restored; the learning rate and the moments are."""
    model = _tiny_gpt()
    optimizer = build_optimizer(model, OPTIM)
    _train(model, optimizer, _OneRank, 0, 1)
    optimizer.param_groups[0]["lr"] = 0.123
    ck = Checkpointer(CheckpointConfig(folder=tmp_path))
    save_training_state(ck, 1, model=model, optimizer=optimizer)
    assert optimizer.param_groups[0]["foreach"] is False
    fresh = _tiny_gpt(seed=5)
    resumed = build_optimizer(fresh, OPTIM)
    for group in resumed.param_groups:
        group["foreach"] = True  # as build_optimizer makes it on a GPU (optim.adamw_foreach)
    load_training_state(ck, ck.resume_point(), model=fresh, optimizer=resumed, restore_rng=False)
    assert resumed.param_groups[0]["foreach"] is True
    assert resumed.param_groups[0]["lr"] == 0.123 and len(resumed.state) > 0
