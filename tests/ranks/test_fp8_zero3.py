"""``--precision fp8 --zero-stage 3``: the fp8 linears' weights all-gathered in fp8 (chapters 04 and 10;
refimpl/parallel/zero/fsdp_float8.py).

One spawn of 2 ranks checks the gathered casts and runs the trainer three times (4 steps each): the fp8
all-gather, the same layout gathering those weights in bf16 (``enable_float8_all_gather`` off: the layers
re-quantize the bf16 copy, as they did before), and the negative control that casts each shard with its
own amax (``agree_amaxes`` off). The one-device ZeRO-3 fp8 runs are made in this process (one thread).

* **The gathered cast is the whole tensor's, bit for bit**: after a unit's all-gather every fp8 layer holds
  ``W8`` and the scale that ``cast_to_float8`` gives for the whole fp32 weight (the amax MAX-reduced over
  the shards, then an elementwise cast), and its bf16 full weight is never allocated. Negative control:
  with the shards' own amaxes the bytes differ.
* **Bytes**: per step the all-gathers move ``sum_units gathers_u * N * sum_p chunk_p * itemsize_p`` bytes
  (blocks gathered twice, forward and backward, the root once; ``chunk_p = ceil(rows / N) * row_numel``),
  to the byte for both runs; the fp8 weights' part of the fp8 run is exactly half of the bf16 run's; and the
  trainer's own ``bytes_sent`` on the dp group differs between the runs by the ring model of that saving
  minus the amax all-reduces (one ``4 k``-byte MAX all-reduce per gather of a unit with ``k`` fp8 weights).
* **Training**: the dp 2 run's first-step gradients equal bit for bit those of one device running the same
  ZeRO-3 fp8 arithmetic on the same two halves (``--micro-batch-size 2``): each rank's activations get the
  scales one device's micro-batch gets, and the weights the same fp8 bytes. The local-amax control is not
  equal. The bf16-gather run rounds the weights twice (bf16, then e4m3 with the bf16 copy's amax), so it
  differs; its losses agree with the fp8 run's within ``FACTOR x`` the spread of one device's two orders
  (whole batch vs one sequence per micro-batch), fp8's own noise measured in the same session.
* **Under the pipeline and tensor parallelism** (a second spawn of 4 ranks: pp 2 x dp 2, each stage its own
  ZeRO-3 wrapper; tp 2 x dp 2, the TP blocks sharded again over dp): every fp8 weight of a rank's stage is
  gathered as the whole tensor's cast, and every TP block as its part of the whole layer's cast, bit for
  bit (negative control: the blocks' amax agreed over dp only); the dp group moves fewer bytes per step
  than the same run gathering bf16; zbh1 gives 1F1B's losses and gradients bit for bit; the losses and the
  first step's gradients (before clipping and AdamW) agree with the bf16-gather run within ``FACTOR x``
  one device's fp8 order spread (measured 0.17-0.28 x that tolerance; the gradients x 2 fail it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from refimpl.comm import CommTracer
from refimpl.config import ModelConfig, ParallelConfig
from refimpl.distributed import DistributedContext, ParallelDims
from refimpl.launch import run_ranks
from refimpl.models import GPT
from refimpl.parallel.parallelize import parallelize
from refimpl.parallel.zero.fsdp_communications import finish_all_gather, free_full_params
from refimpl.parallel.zero.fsdp_float8 import float8_unit
from refimpl.precision.fp8 import E4M3, cast_to_float8, float8_layers
from refimpl.train import build_parser, config_from_args, options_from_args, train
from refimpl.train.hooks import TrainHooks
from tests.support.one_device import first_step_gradients
from tests.support.timeouts import SPAWN_TIMEOUT_S

FACTOR = 4.0
STEPS = 4
N = 2
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "100",
        "--checkpoint-every", "0", "--no-report", "--steps", str(STEPS)]
ZERO3_FP8 = ["--precision", "fp8", "--zero-stage", "3"]
CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=16)
# the trainer's runs on 2 ranks: name -> (module attribute switched off, its stand-in)
RUNS = {"fp8": None,
        "bf16-gather": ("enable_float8_all_gather", lambda fsdp: []),
        "local-amax": ("agree_amaxes", lambda amaxes, group: amaxes),
        "fp8-actckpt": None}
EXTRA = {"fp8-actckpt": ["--activation-checkpointing"]}


def _args(files: dict, out: Path, *extra: str):
    return build_parser().parse_args([*TINY, "--data", str(files["corpus"]), "--cache-dir",
                                      str(files["cache"]), "--out", str(out), *ZERO3_FP8, *extra])


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("fp8_zero3"), **corpus}  # tests/conftest.py's corpus


def _gathered_casts(groups, *, tp_agreed: bool = True, **options) -> dict[str, bool]:
    """Per fp8 weight of this rank: are the gathered bytes and scale the whole fp32 tensor's cast, and is
    the bf16 full weight left unallocated? (``options``: the layout's; under pp each of the
    rank's stages is its own ZeRO-3 wrapper; under tp the rank's block of the whole layer's cast is
    compared. ``tp_agreed`` False: the negative control, amaxes agreed over dp only.)"""
    dims = groups.dims
    model = GPT(CONFIG, seed=0)
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    done = parallelize(model, groups, dims.config(precision="fp8", zero_stage=3, **options))
    wrappers = done.fsdp_stages if done.pipeline is not None else [done.forward]
    names = {id(m): n for n, m in model.named_modules()}
    same = {f"{n}.weight": False for n in float8_layers(model)  # every fp8 layer this rank holds is checked
            if done.pipeline is None or any(m is model.get_submodule(n) for f in wrappers
                                            for m in f.module.modules())}
    for fsdp in wrappers:
        if not tp_agreed:
            for unit in fsdp.units:
                for sp in unit.params:
                    if sp.float8 is not None:
                        sp.float8.tp_group = None
        same |= _unit_casts(fsdp, whole, names)
    return same


def _unit_casts(fsdp, whole: dict, names: dict) -> dict[str, bool]:
    same = {}
    for unit in fsdp.units:
        if not float8_unit(unit):
            continue
        finish_all_gather(unit, fsdp.group)
        for sp in unit.params:
            if sp.float8 is not None:
                layer = sp.float8.layers[0]
                name = names[id(layer)] + ".weight"
                want = cast_to_float8(whole[name], E4M3)
                data = want.data
                if hasattr(layer, "tp_rank"):  # a tensor-parallel block: its block of the whole layer's cast
                    dim = 0 if layer.split_features == "out" else 1
                    data = data.chunk(layer.tp_size, dim=dim)[layer.tp_rank]
                got = layer.weight_fp8 if hasattr(layer, "weight_fp8") else layer.matmul.weight_fp8
                same[name] = (torch.equal(got.data.view(torch.uint8), data.view(torch.uint8))
                              and torch.equal(got.scale, want.scale)
                              and sp.unsharded.untyped_storage().nbytes() == 0)
        free_full_params(unit, fsdp.group)
    return same


def _gradients_agree(got: dict, want: dict, one_device: dict) -> float:
    """The worst ``max |got - want| / (FACTOR x spread x max |want|)`` over the boxes of two ranks'
    first-step gradients (the same layout, fp8 against bf16 gathers), where ``spread`` is one device's fp8
    order spread of the first-step gradients (whole batch vs one sequence per micro-batch), relative to
    each tensor's largest, the most over tensors."""
    a, b = one_device["batch", "grads"], one_device["micro", "grads"]
    spread = max(float(np.abs(a[n][2] - b[n][2]).max() / np.abs(a[n][2]).max()) for n in a)
    assert spread > 0 and set(got) == set(want)
    return max(float(np.abs(got[n][2] - want[n][2]).max() / (FACTOR * spread * np.abs(want[n][2]).max()))
               for n in want)


# 4 ranks: pp 2 x dp 2 (each pipeline stage its own ZeRO-3 wrapper) and tp 2 x dp 2 (2-D: the TP blocks
# sharded again over dp), their fp8 weights gathered in fp8
PP, TP = ["--pp", "2", "--microbatches", "2"], ["--tp", "2"]
PP_RUNS = {"pp-fp8": (PP, None), "pp-fp8-zbh1": ([*PP, "--pp-schedule", "zbh1"], None),
           "pp-bf16-gather": (PP, RUNS["bf16-gather"]), "tp-fp8": (TP, None),
           "tp-bf16-gather": (TP, RUNS["bf16-gather"])}


def _pp_worker(ctx, files: dict) -> dict:
    import refimpl.parallel.zero.fsdp_float8 as fsdp_float8

    dims, tp_dims = ParallelDims(dp=2, pp=2), ParallelDims(dp=2, tp=2)
    groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    tp_groups = tp_dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    out: dict = {"casts": _gathered_casts(groups, microbatches=2), "tp casts": _gathered_casts(tp_groups),
                 "tp casts, dp amax only": _gathered_casts(tp_groups, tp_agreed=False)}
    for name, (flags, switch) in PP_RUNS.items():
        args, grads = _args(files, Path(files["root"]) / name, *flags), {}
        with pytest.MonkeyPatch.context() as patch:
            if switch is not None:
                patch.setattr(fsdp_float8, *switch)
            records = train(config_from_args(args), ctx, options_from_args(args),
                            gradient_probe=first_step_gradients(grads))
        out[name], out[name, "grads"] = [r["loss"] for r in records], grads
        out[name, "sent"] = [r["bytes_sent"]["dp x cp"] for r in records]
    return out


@pytest.fixture(scope="module")
def pp_runs(files) -> list[dict]:
    return run_ranks(_pp_worker, 4, files, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_zero3_fp8_under_the_pipeline_gathers_each_stage_in_fp8(pp_runs, one_device):
    """pp 2 x dp 2: every fp8 weight of a rank's stage is gathered as the whole tensor's cast, bit for bit;
    the dp group moves fewer bytes than the same run gathering bf16; zbh1 (dW deferred to the W actions,
    reduce-scattered once after the last) gives 1F1B's losses and gradients bit for bit; and the run
    agrees with the bf16-gather run within ``FACTOR x`` one device's fp8 order spread (as at pp 1)."""
    spread = float(np.abs(np.subtract(one_device["batch"], one_device["micro"])).max())
    for rank, out in enumerate(pp_runs):
        assert out["casts"] and all(out["casts"].values()), (rank, out["casts"])
        assert all(a < b for a, b in zip(out["pp-fp8", "sent"], out["pp-bf16-gather", "sent"], strict=True))
        assert out["pp-fp8-zbh1"] == out["pp-fp8"], (rank, out["pp-fp8-zbh1"], out["pp-fp8"])
        got, want = out["pp-fp8-zbh1", "grads"], out["pp-fp8", "grads"]
        assert set(got) == set(want) and all(np.array_equal(got[n][2], want[n][2]) for n in want), rank
        diff = float(np.abs(np.subtract(out["pp-fp8"], out["pp-bf16-gather"])).max())
        assert 0 < diff <= FACTOR * spread, (rank, diff, spread)
        worst = _gradients_agree(out["pp-fp8", "grads"], out["pp-bf16-gather", "grads"], one_device)
        print(f"pp rank {rank}: first-step gradients, fp8 vs bf16 gather: {worst:.3f} x tolerance")
        assert worst <= 1, (rank, worst)
        assert out["pp-fp8"][-1] < out["pp-fp8"][0] - 0.5, out["pp-fp8"]  # it trains


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_zero3_fp8_with_tensor_parallelism_gathers_each_block_with_its_layers_scale(pp_runs, one_device):
    """tp 2 x dp 2 (2-D): every fp8 TP block is gathered as its block of the whole layer's cast, bit for bit
    (the amax agreed over dp, then over tp); negative control: agreed over dp only, some blocks differ. The
    dp group moves fewer bytes than the same run gathering bf16; the losses agree with it within
    ``FACTOR x`` one device's fp8 order spread."""
    spread = float(np.abs(np.subtract(one_device["batch"], one_device["micro"])).max())
    for rank, out in enumerate(pp_runs):
        assert out["tp casts"] and all(out["tp casts"].values()), (rank, out["tp casts"])
        assert not all(out["tp casts, dp amax only"].values()), (rank, out["tp casts, dp amax only"])
        assert all(a < b for a, b in zip(out["tp-fp8", "sent"], out["tp-bf16-gather", "sent"], strict=True))
        diff = float(np.abs(np.subtract(out["tp-fp8"], out["tp-bf16-gather"])).max())
        assert 0 < diff <= FACTOR * spread, (rank, diff, spread)
        worst = _gradients_agree(out["tp-fp8", "grads"], out["tp-bf16-gather", "grads"], one_device)
        print(f"tp rank {rank}: first-step gradients, fp8 vs bf16 gather: {worst:.3f} x tolerance")
        assert worst <= 1, (rank, worst)
        doubled = {n: (o, sh, 2 * v) for n, (o, sh, v) in out["tp-fp8", "grads"].items()}  # control: x 2
        assert _gradients_agree(doubled, out["tp-bf16-gather", "grads"], one_device) > 1, rank
        assert out["tp-fp8"][-1] < out["tp-fp8"][0] - 0.5, out["tp-fp8"]  # it trains


def _worker(ctx, files: dict) -> dict:
    import refimpl.parallel.zero.fsdp_float8 as fsdp_float8

    dims = ParallelDims(dp=N)
    groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    out: dict = {}
    with pytest.MonkeyPatch.context() as patch:
        out["casts"] = _gathered_casts(groups)
        patch.setattr(fsdp_float8, *RUNS["local-amax"])
        out["casts", "local amax"] = _gathered_casts(groups)
    for name, switch in RUNS.items():
        args, grads, tracers = _args(files, Path(files["root"]) / name, *EXTRA.get(name, [])), {}, []

        def trace(step: int, setup, tracers: list = tracers) -> CommTracer:  # each step's own tracer (the
            tracers.append(CommTracer())  # sample the run writes at its end gathers the weights once more)
            return tracers[-1]

        with pytest.MonkeyPatch.context() as patch:
            if switch is not None:
                patch.setattr(fsdp_float8, *switch)
            records = train(config_from_args(args), ctx, options_from_args(args),
                            hooks=TrainHooks(gradient_probe=first_step_gradients(grads), around_step=trace))
        out[name] = [r["loss"] for r in records]
        out[name, "grads"] = grads
        out[name, "all_gather"] = [(sum(e.nbytes for e in t.select(op="all_gather")),
                                    t.modelled_bytes_sent(op="all_gather")) for t in tracers]
        out[name, "sent"] = [r["bytes_sent"] for r in records]
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, N, files, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def one_device(files) -> dict:
    """One device's ZeRO-3 fp8 runs: ``halves`` (the dp ranks' two halves as micro-batches), ``batch`` and
    ``micro`` (one sequence per micro-batch): losses and first-step gradients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    try:
        out = {}
        for order, mbs in (("halves", ["--micro-batch-size", "2"]), ("batch", []),
                           ("micro", ["--micro-batch-size", "1"])):
            args, grads = _args(files, Path(files["root"]) / f"one-{order}", *mbs), {}
            out[order] = [r["loss"] for r in train(config_from_args(args), ctx, options_from_args(args),
                                                   gradient_probe=first_step_gradients(grads))]
            out[order, "grads"] = grads
        return out
    finally:
        torch.set_num_threads(threads)


def _equal(pieces: dict, whole: dict) -> bool:
    """Every box of ``pieces`` (a rank's gradient probe) equals the same box of one device's, bit for bit."""
    def box(off, shape):
        return tuple(slice(o, o + s) for o, s in zip(off, shape, strict=True))
    return all(np.array_equal(got, whole[n][2][box(off, got.shape)]) for n, (off, _, got) in pieces.items())


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_the_gathered_fp8_weight_is_the_whole_tensors_cast_bit_for_bit(runs):
    for rank, out in enumerate(runs):
        assert out["casts"] and all(out["casts"].values()), (rank, out["casts"])
        assert not any(out["casts", "local amax"].values()), (rank, out["casts", "local amax"])


def _payload(fp8: bool) -> tuple[int, int, int]:
    """``(all-gather bytes of one step, of which the fp8 weights', the amax all-reduces' bytes)`` at ``N``
    ranks: the formulas of the module docstring on the units of a one-rank ZeRO-3 fp8 model (which weights
    are fp8, which unit holds them)."""
    fsdp = parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=1),
                       ParallelConfig(dp=1, precision="fp8", zero_stage=3)).forward
    total = weights = amax = 0
    for u, unit in enumerate(fsdp.units):
        gathers = 1 if u == 0 else 2  # the root stays gathered from its forward to its backward
        k = sum(sp.float8 is not None for sp in unit.params)
        amax += gathers * 4 * k if fp8 else 0  # one fp32 amax per fp8 weight, one all-reduce per gather
        for sp in unit.params:
            in_fp8 = sp.float8 is not None
            nbytes = gathers * N * -(-sp.spec.rows // N) * sp.spec.row_numel * (1 if in_fp8 and fp8 else 2)
            total += nbytes
            weights += nbytes if in_fp8 else 0
    return total, weights, amax


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_fp8_all_gather_moves_exactly_half_of_bf16s_bytes_for_the_fp8_weights(runs):
    (fp8_total, fp8_weights, amax), (bf16_total, bf16_weights, _) = _payload(True), _payload(False)
    assert bf16_weights == 2 * fp8_weights > 0 and fp8_total - fp8_weights == bf16_total - bf16_weights
    for rank, out in enumerate(runs):
        others = fp8_total - fp8_weights  # what both runs gather in bf16
        for (fp8, fp8_sent), (bf16, _) in zip(out["fp8", "all_gather"], out["bf16-gather", "all_gather"],
                                              strict=True):
            assert (fp8, bf16) == (fp8_total, bf16_total), (rank, fp8, bf16)
            assert fp8 - others == (bf16 - others) / 2  # the fp8 weights: exactly half
            assert fp8_sent == (N - 1) / N * fp8_total  # the ring model, per rank
        # the trainer's bytes_sent on the dp group: the ring model of the saving, less the amax all-reduces
        saving = (N - 1) / N * (bf16_total - fp8_total) - 2 * (N - 1) / N * amax
        for fp8_step, bf16_step in zip(out["fp8", "sent"], out["bf16-gather", "sent"], strict=True):
            assert set(fp8_step) == set(bf16_step) == {"dp x cp"}, fp8_step
            assert bf16_step["dp x cp"] - fp8_step["dp x cp"] == saving, (rank, bf16_step, fp8_step, saving)


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_zero3_fp8_trains_as_one_device_bit_for_bit_and_like_the_bf16_gather(runs, one_device):
    halves = one_device["halves", "grads"]
    for rank, out in enumerate(runs):
        assert set(out["fp8", "grads"]) == set(halves)
        assert _equal(out["fp8", "grads"], halves), rank
        assert out["fp8"][0] == one_device["halves"][0], (rank, out["fp8"], one_device["halves"])
        assert out["fp8"][-1] < out["fp8"][0] - 0.5, out["fp8"]  # it trains
        # negative controls: each shard's own amax; the bf16 copy re-quantized (a second rounding)
        assert not _equal(out["local-amax", "grads"], halves), rank
        assert not _equal(out["bf16-gather", "grads"], halves), rank
    for rank, out in enumerate(runs):  # checkpointed blocks recompute on the fp8 weights gathered again
        got, want = out["fp8-actckpt", "grads"], out["fp8", "grads"]
        assert out["fp8-actckpt"] == out["fp8"] and set(got) == set(want), rank
        assert all(got[n][0] == want[n][0] and np.array_equal(got[n][2], want[n][2]) for n in want), rank
    spread = float(np.abs(np.subtract(one_device["batch"], one_device["micro"])).max())
    assert spread > 0, "one device's two orders gave the same bits: no yardstick"
    diff = float(np.abs(np.subtract(runs[0]["fp8"], runs[0]["bf16-gather"])).max())
    print(f"fp8 vs bf16 gather: {diff:.3g}, one device's fp8 order spread {spread:.3g}")
    assert 0 < diff <= FACTOR * spread, (diff, spread)
    assert float(np.abs(np.diff(runs[0]["fp8"])).min()) > FACTOR * spread  # the steps move more than that


def test_the_memory_planner_plans_fp8_under_zero3():
    """Planned since predict_run's fp8 ZeRO-3 figures were measured
    (tests/trainer/ranks/cli/test_train_fp8.py: bytes per group, state and held activations at dp 2): the
    trainer's preflight checks such a run. Its gathered units are the planner's bound at 4 bytes per element,
    above what the fp8 gather holds (e4m3 weights at one byte, the rest in bf16)."""
    from refimpl.planner import run_memory_per_rank
    from refimpl.planner.fp8 import fp8_weights
    from refimpl.planner.param_table import param_table

    config = ModelConfig(vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32, num_attention_heads=4)
    plan = run_memory_per_rank(config, ParallelDims(dp=2), micro_batch=1, seq_len=16, zero_stage=3,
                               precision="fp8")
    fp8 = {q.name for q in fp8_weights(config)}
    table = param_table(config)
    root = sum(2 * q.numel for q in table.embedding + table.final_layernorm + table.output_layer)
    block = max(sum((1 if q.name in fp8 else 2) * q.numel for q in b) for b in table.blocks)
    assert plan.state["ZeRO-3 gathered units"] >= root + block > 0
