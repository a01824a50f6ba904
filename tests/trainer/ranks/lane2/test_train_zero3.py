"""The trainer with ``--zero-stage 3`` composed (chapter 04; issue "ZeRO-3 everywhere"): with activation
checkpointing, with hybrid sharding (``--dp-replicate``) and with tensor parallelism (2-D sharding).

One spawn of 4 ranks trains each layout (tests/support/trainer_runs.py); the one-device references are
tests/conftest.py's (the same config as test_train_tp and test_train_cp: computed once per session).

* **Like one device** (the numerics rule, tests/support/one_device.py): the losses, and the first step's
  gradients before clipping and AdamW, every rank's boxes of them (row shards, 2-D boxes of the TP blocks),
  within
  ``FACTOR x`` the spread of two one-device summation orders; negative control: the same gradients x 4 (a
  sum over the replicas, not the mean) fail.
* **Checkpointing changes nothing but memory**: the recomputed forward of a checkpointed block runs on the
  weights the unit's pre-backward gather brought back (refimpl/parallel/zero/fully_sharded_data_parallel.py),
  the same products in the same order, so ``--activation-checkpointing`` gives the same losses and the
  same gradients, bit for bit, as the same ZeRO-3 run without it (fp32 and bf16). The wrapper-level proofs
  (against FSDP2 + torch checkpoint bitwise, peak gathered bytes during the recomputation, the negative
  control that recomputes on the shards) are tests/ranks/lane2/test_zero.py's.
* **HSDP** (2 replicas of 2-rank shard groups): its replica-group bytes per step equal the planner's
  formula to the byte; its checkpoint resumes at R = 1 and R = 4, continuing the losses.
* **2-D**: the tp 2 x dp 2 ZeRO-3 checkpoint (the dp rows inside each TP block) reassembles bit for bit
  after being loaded and saved again at tp 4 ZeRO-1, dp 4 ZeRO-3, one rank and back at tp 2 x dp 2 ZeRO-3.
  The comparison with PyTorch's ``fully_shard`` over DTensor TP is tests/ranks/test_fsdp_tp.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from refimpl.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointReader,
    load_training_state,
    read_manifest,
    save_training_state,
)
from refimpl.config import ParallelConfig
from refimpl.distributed import DistributedContext
from refimpl.launch import run_ranks
from refimpl.models import GPT
from refimpl.train import RunOptions, build_setup
from refimpl.train.layout import resolve
from tests.support import timeouts
from tests.support.one_device import tolerance
from tests.support.trainer_runs import Case, layout_tests, run_case, run_layouts, tiny

# the one spawn timeout x 2: 4 ranks train the GPT at each ZeRO-3 layout; it was 300 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4  # the checkpoints' step; the runs go 2 steps further
HSDP = "dp4-hsdp2-zero3"  # 2 replicas x 2-rank shard groups; its checkpoint moves across R
TP2 = "tp2-dp2-zero3"  # 2-D sharding: ZeRO-3 rows of the tensor-parallel blocks


def _z3(*, checkpoint_every: int = 0, **fields) -> Case:
    """A ZeRO-3 layout of ``ParallelConfig`` ``fields``."""
    return Case(parallel=ParallelConfig(zero_stage=3, **fields), checkpoint_every=checkpoint_every)


PP2 = {"pp": 2, "microbatches": 2}
# the layouts at world size 4 (each compared with one device at its precision)
LAYOUTS = {
    "dp4-zero3": _z3(),
    "dp4-zero3-actckpt": _z3(activation_checkpointing="all"),
    "dp4-zero3-bf16": _z3(precision="bf16"),
    "dp4-zero3-bf16-actckpt-every2": _z3(precision="bf16", activation_checkpointing="every-2"),
    HSDP: _z3(dp_replicate=2, checkpoint_every=STEPS),
    "dp4-hsdp2-zero3-bf16-actckpt": _z3(dp_replicate=2, precision="bf16", activation_checkpointing="all"),
    TP2: _z3(tp=2, checkpoint_every=STEPS),
    "tp2-dp2-zero3-sp-actckpt": _z3(tp=2, sequence_parallel=True, activation_checkpointing="all"),
    "tp2-dp2-zero3-bf16": _z3(tp=2, precision="bf16"),
    "pp2-dp2-zero3": _z3(**PP2),
    "pp2-dp2-zero3-reshard": _z3(**PP2, zero3_reshard_per_microbatch=True),
    # zbh1: the W actions add the weight gradients to the gathered stage before its one reduce-scatter
    "pp2-dp2-zero3-zbh1": _z3(**PP2, pp_schedule="zbh1"),
    "pp2-dp2-zero3-gpipe-actckpt": _z3(**PP2, pp_schedule="gpipe", activation_checkpointing="all"),
}
# the tp 2 x dp 2 ZeRO-3 checkpoint of step STEPS, loaded and saved again at: name -> (world size, layout)
MOVED_TO = {"tp4-zero1": (4, ParallelConfig(tp=4, zero_stage=1)),
            "dp4-zero3": (4, ParallelConfig(zero_stage=3)),
            "back at tp2-dp2-zero3": (4, ParallelConfig(tp=2, zero_stage=3)),
            "one rank": (1, ParallelConfig())}
RESUMED_AT = {"R1 (plain ZeRO-3)": ParallelConfig(zero_stage=3),  # HSDP's checkpoint of step STEPS resumed
              "R4 (shard groups of one)": ParallelConfig(zero_stage=3, dp_replicate=4)}
SAME_AS = {"dp4-zero3-actckpt": "dp4-zero3", "dp4-zero3-bf16-actckpt-every2": "dp4-zero3-bf16"}


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("train_zero3"), **corpus}  # tests/conftest.py's corpus


def _worker(ctx, files: dict) -> dict:
    root, base = Path(files["root"]), tiny(files, steps=STEPS + 2)
    out = run_layouts(ctx, base, LAYOUTS, root)
    for name, parallel in RESUMED_AT.items():  # the HSDP checkpoint of step STEPS, resumed at another R
        folder = root / f"resumed {name}" / "checkpoints"
        if ctx.rank == 0:
            shutil.copytree(root / HSDP / "checkpoints" / f"step_{STEPS:08d}", folder / f"step_{STEPS:08d}")
        dist.barrier()
        resumed = run_case(ctx, base, Case(parallel=parallel), folder.parent)  # its folder's checkpoints
        out["resumed", name] = [r["loss"] for r in resumed]
    if ctx.rank == 0:  # TP2's checkpoint of step STEPS alone (the run also saved its last step)
        step = f"step_{STEPS:08d}"
        shutil.copytree(root / TP2 / "checkpoints" / step, root / "tp2-saved" / step)
    dist.barrier()
    _move(ctx, files, 4)
    return out


def _move(ctx, files: dict, world: int) -> None:
    """Load TP2's checkpoint of step STEPS at each MOVED_TO layout of ``world`` ranks and save it again."""
    root = Path(files["root"])
    source = Checkpointer(CheckpointConfig(folder=str(root / "tp2-saved")))
    for name, (size, parallel) in MOVED_TO.items():
        if size != world:
            continue
        config = tiny(files, steps=STEPS)
        setup = build_setup(config, ctx, resolve(config, RunOptions(parallel=parallel), ctx.world_size))
        load_training_state(source, source.find_latest_valid(), model=setup.state_module,
                            optimizer=setup.optimizer, restore_rng=False)
        with Checkpointer(CheckpointConfig(folder=str(root / f"moved {name}"))) as target:
            save_training_state(target, STEPS, model=setup.state_module, optimizer=setup.optimizer)


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    out = run_ranks(_worker, 4, files, timeout_s=SPAWN_TIMEOUT_S)
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        _move(ctx, files, 1)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def one_device(corpus, one_device_references) -> dict:
    return one_device_references(tiny(corpus), steps=STEPS + 2)  # shared with test_train_tp and _cp


# the losses and the first step's gradients (before clipping and AdamW, every rank's boxes) against one
# device's (tests/support/one_device.py); negative control: the gradients x 4 (a sum over the replicas)
(test_zero3_layouts_train_like_one_device,
 test_zero3_layouts_hand_the_optimizer_one_devices_gradients) = layout_tests(
    LAYOUTS, factor=FACTOR, timeout_s=2 * SPAWN_TIMEOUT_S, control=lambda case: 4.0)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(SAME_AS))
def test_checkpointing_under_zero3_changes_no_bit(runs, name):
    """Losses and first-step gradient shards equal to the run without checkpointing, bit for bit."""
    plain = SAME_AS[name]
    for rank, out in enumerate(runs):
        assert out[name] == out[plain], (rank, out[name], out[plain])
        assert out[name, "grads"].keys() == out[plain, "grads"].keys()
        for param, (offsets, shape, got) in out[name, "grads"].items():
            want = out[plain, "grads"][param]
            assert (offsets, shape) == want[:2] and np.array_equal(got, want[2]), (rank, param)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(RESUMED_AT))
def test_the_hsdp_checkpoint_resumes_at_another_replica_count(runs, one_device, name):
    """Saved by 2 replicas of 2-rank shard groups (each box written once, the replicas split the writing),
    read at R = 1 (ZeRO-3 over all 4) and R = 4 (every rank whole): the resumed steps continue the HSDP
    run's losses within the tolerance (another summation order of the same gradients)."""
    tol = tolerance(one_device, "fp32", factor=FACTOR)
    for rank, out in enumerate(runs):
        got, want = np.array(out["resumed", name]), np.array(out[HSDP][STEPS:])
        assert len(got) == 2 and float(np.abs(got - want).max()) <= tol, (rank, name, got, want, tol)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_hsdp_bytes_per_group_equal_the_formula(runs):
    """What each rank sent per step over the replica group (metrics.jsonl's "dp_replicate") is the ring
    all-reduce of every unit's padded gradient shard: ``zero_collectives(..., replicas=2)`` over the shard
    group of 2, to the byte; the shard group ("dp_shard x cp") carries the all-gathers and reduce-scatters
    (ZeRO-3's, never the replicas' reduction)."""
    from refimpl.comm.tracer import wire_bytes
    from refimpl.models import GPT
    from refimpl.planner import zero_collectives

    config = tiny({"corpus": Path("x"), "cache": Path("x")}).model  # the model alone: no data read
    units: list[list] = [[] for _ in range(1 + config.num_layers)]
    for name, p in GPT(config, seed=0).named_parameters():  # the wrapper's units: each block, the root
        units[1 + int(name.split(".")[1]) if name.startswith("layers.") else 0].append(tuple(p.shape))
    ops = zero_collectives(units, 2, 3, replicas=2)
    replicas = wire_bytes("all_reduce", ops["all_reduce"][1], 2)
    shard_group = wire_bytes("all_gather", ops["all_gather"][1], 2) + wire_bytes(
        "reduce_scatter", ops["reduce_scatter"][1], 2)
    for rank, out in enumerate(runs):
        for step in (r["bytes_sent"] for r in out[HSDP, "records"]):
            assert step["dp_replicate"] == replicas, (rank, step, replicas)
            assert step["dp_shard x cp"] >= shard_group, (rank, step, shard_group)  # + the norm's scalar
            assert step["dp_shard x cp"] - shard_group < 64, (rank, step, shard_group)


def _read_all(step: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint folder ``step``, whole (reassembled from the saved boxes)."""
    manifest = read_manifest(step)
    reader = CheckpointReader(step, manifest)
    try:
        return {name: reader.read(name) for name in manifest["entries"]}
    finally:
        reader.close()


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(MOVED_TO))
def test_the_2d_checkpoint_reassembles_bitwise_at_another_layout(runs, files, name):
    """The tp 2 x dp 2 ZeRO-3 checkpoint declares 2-D boxes (the dp rows inside each TP block); loaded at
    tp 4 ZeRO-1, at dp 4 ZeRO-3, at one rank and back at tp 2 x dp 2 ZeRO-3 and saved again, every tensor
    (weights and AdamW state) reassembles to the same bits. Negative control: the untrained run's state
    (step 0) differs."""
    root = Path(files["root"])
    original = _read_all(root / TP2 / "checkpoints" / f"step_{STEPS:08d}")
    moved = _read_all(next((root / f"moved {name}").glob("step_*")))
    assert moved.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(moved[key], tensor), (name, key)
    untrained = GPT(tiny(files).model).state_dict()
    fresh = {f"model/{k}": v for k, v in untrained.items()}
    compared = [k for k in fresh if k in original]
    assert compared and any(not torch.equal(original[k], fresh[k]) for k in compared), sorted(original)[:4]


def _stage_units(pp_rank: int) -> list[list[tuple[int, ...]]]:
    """The parameter shapes of pipeline rank ``pp_rank``'s stage per ZeRO-3 unit: its root (embedding, or
    final LayerNorm and head), then each block."""
    from refimpl.models.gpt_stages import build_stages

    model = GPT(tiny({"corpus": Path("x"), "cache": Path("x")}).model, seed=0)  # the model alone
    (stage,) = build_stages(model, pp_rank=pp_rank, pp_size=2).values()
    blocks = [[tuple(p.shape) for p in block.parameters()] for block in stage.layers]
    block_ids = {id(p) for block in stage.layers for p in block.parameters()}
    return [[tuple(p.shape) for p in stage.parameters() if id(p) not in block_ids], *blocks]


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_zero3_under_pp_gathers_once_per_step_or_per_microbatch(runs):
    """What each rank sent per step over "dp x cp" (metrics.jsonl), against the ZeRO-3 collectives of its
    stage's units over the 2 dp ranks (``refimpl.planner.zero_collectives``, the ring model): by default
    every unit is all-gathered once and reduce-scattered once per step, kept through the m = 2
    micro-batches; with ``--zero3-reshard-per-microbatch`` each micro-batch gathers (forward, and backward
    but the root unit) and reduces: m times the collectives. The rest is the step's float32 scalars (the
    loss and the norm: a few bytes)."""
    from refimpl.comm.tracer import wire_bytes
    from refimpl.planner import zero_collectives

    m = 2
    for rank, out in enumerate(runs):
        ops = zero_collectives(_stage_units(rank // 2), 2, 3)  # pp outermost: pp rank = rank // 2
        once = wire_bytes("all_gather", _unit_bytes(rank // 2), 2) + wire_bytes("reduce_scatter",
                                                                                 ops["reduce_scatter"][1], 2)
        per_micro = m * (wire_bytes("all_gather", ops["all_gather"][1], 2)
                         + wire_bytes("reduce_scatter", ops["reduce_scatter"][1], 2))
        for name, want in (("pp2-dp2-zero3", once), ("pp2-dp2-zero3-reshard", per_micro)):
            for step in (r["bytes_sent"] for r in out[name, "records"]):
                assert 0 <= step["dp x cp"] - want < 64, (rank, name, step["dp x cp"], want)


def _unit_bytes(pp_rank: int) -> int:
    """float32 bytes of every unit of the stage gathered once: its padded size over 2 ranks."""
    from refimpl.planner import padded_numel

    return 4 * sum(padded_numel(shapes, 2) for shapes in _stage_units(pp_rank))
