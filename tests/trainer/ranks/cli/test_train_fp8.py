"""The trainer with ``--precision fp8`` (chapter 10): bf16 autocast with the linears' three
GEMMs in fp8 (refimpl.precision.fp8.apply_float8_training), composed with dp, ZeRO-2, tp and pp (ZeRO-3:
tests/ranks/test_fp8_zero3.py).

One spawn of 2 ranks runs each layout through ``refimpl.train.train`` and, first, the tensor-parallel
layer check below; the one-device references run in this process (one thread, as each rank).

* **dp 2 (ZeRO 0 and 2) is one device's arithmetic, bit for bit.** fp8's dynamic scales come from the
  tensors a forward sees: each dp rank casts its own 2 sequences with their amax, as one device does with
  ``--micro-batch-size 2`` (gradient accumulation over the same two halves). So the first step's gradients
  of every rank equal that run's bitwise (ZeRO 0: the losses too). Negative controls: one device with the
  whole batch in one forward (other activation scales), and the same micro-batches with one more layer left
  in bf16, are not equal.
* **tp 2 (tensorwise and rowwise, and with sequence parallelism) and pp 2 (1F1B and zbh1) train like one
  device**, within ``FACTOR x`` the spread of one
  device's two orders (tests/support/one_device.py's rule, fp8 as a precision of its own). Why that yardstick
  and not a tighter one: under bf16 autocast a row-parallel layer rounds its partial sum to bf16 before the
  all-reduce (as bf16 TP does, tests/trainer/ranks/test_train_tp.py), and each such rounding flips some fp8
  casts of the next layer: the layout then differs from one device at fp8's own noise, which is what one
  device's two orders measure (there the activation scales differ). Measured on this model: first-step
  gradients of tp 2 6.1e-2, of tp 2 rowwise 2.7e-2, of pp 2 3.9e-2 of each tensor's largest, against an fp8
  order spread of 6.5e-2 (tensorwise) and 4.9e-3 (rowwise; ``|fp8 - fp32|`` is the floor of the rule).
  Control: the same gradients x 2 fail.
* **The tensor-parallel layers cast with one device's scales** (``ShardedScales``), checked tightly on
  one column -> GELU -> row pair in fp32 (no autocast, so no 16-bit partial sums): output, input gradient
  and weight-gradient blocks within ``FACTOR x`` the spread of the same pair in fp32 (TP against one
  device: the partial sums' order), for both recipes. Negative controls, each fails the same check: the
  tensorwise shards cast with their own amax (no all-reduce; the second rank's half of the hidden features
  is 8x larger, so the shards' amaxes differ), the rowwise layers against the tensorwise reference, the row
  layer left unconverted. (Rowwise shards cast with their own amax are no control: its scales are powers of
  two, and a power of two more or less moves no mantissa bit of an e4m3 value, only the few values near the
  subnormals: measured 0.8-1.9 x the tolerance.)
* **Sequence parallelism and zbh1 stay fp8 in all three GEMMs** (the seam's own backward takes them from
  ``Float8Matmul``): each rank runs as many ``_scaled_mm`` calls (counted by a dispatch mode) as the same
  layout without them; the seam's old bf16 backward GEMMs made 60 against 84 at tp 2 with SP.
* **Refusals**: ZeRO-3 with rowwise scaling (ZeRO-3 with fp8 itself, under tp and pp too, its weights
  all-gathered in fp8, is tests/ranks/test_fp8_zero3.py's) and ``--fp8-scaling`` without fp8, one line each
  from refimpl/support.py and exit status 2. **Planner**: fp8's saved activations and bf16
  weight copies to the byte against ``SavedTensorMeter``, its fp8 weights the trainer's;
  ``predict_run`` refuses fp8.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from refimpl.config import ModelConfig, ParallelConfig, TrainConfig
from refimpl.distributed import DistributedContext, ParallelDims
from refimpl.launch import run_ranks
from refimpl.measure import measure_saved_activations
from refimpl.measure.run_measurement import TrainerProbe
from refimpl.models import GPT, lm_loss
from refimpl.nn.linear import Linear
from refimpl.parallel.parallelize import parallelize
from refimpl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    apply_tensor_parallel,
    tp_lm_loss,
)
from refimpl.precision.fp8 import (
    Float8Config,
    apply_float8_training,
    first_and_last_linear,
    float8_layers,
    float8_linear,
)
from refimpl.support import SUPPORT_TABLE
from refimpl.train.hooks import TrainHooks
from tests.support import timeouts
from tests.support.one_device import (
    assert_gradients_like_one_device,
    assert_trains_like_one_device,
    first_step_gradients,
)
from tests.support.trainer_runs import Case, run_case, tiny

# the one spawn timeout x 2: 2 ranks train in fp8 at each recipe and layout; it was 300 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "100",
        "--checkpoint-every", "0", "--no-report", "--steps", str(STEPS)]  # the refusals' command line
CONFIG = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, max_seq_len=16)  # the planner's


def _fp8(*, micro_batch_size: int | None = None, **options) -> Case:
    """fp8 (tensorwise unless ``options`` say otherwise) at ``options``' layout."""
    return Case(parallel=ParallelConfig(**{"precision": "fp8", **options}), micro_batch_size=micro_batch_size)


LAYOUTS = {"dp2": _fp8(), "dp2-zero2": _fp8(zero_stage=2), "dp2-zero3": _fp8(zero_stage=3), "tp2": _fp8(tp=2),
           "tp2-rowwise": _fp8(fp8_scaling="rowwise", tp=2), "pp2": _fp8(pp=2),
           "tp2-sp": _fp8(tp=2, sequence_parallel=True), "pp2-zbh1": _fp8(pp=2, pp_schedule="zbh1"),
           "cp2": _fp8(cp=2)}
PREDICTED = ("dp2", "dp2-zero2", "dp2-zero3", "pp2", "cp2", "pp2-zbh1")  # where predict_run is checked
# one-device runs: label -> layout (the "micro" order: one sequence per micro-batch)
ONE_DEVICE = {("fp8", "batch"): _fp8(), ("fp8", "micro"): _fp8(micro_batch_size=1),
              ("fp8-rowwise", "batch"): _fp8(fp8_scaling="rowwise"),
              ("fp8-rowwise", "micro"): _fp8(fp8_scaling="rowwise", micro_batch_size=1),
              ("fp32", "batch"): Case(parallel=ParallelConfig()), ("fp8", "halves"): _fp8(micro_batch_size=2)}


def _base(files: dict) -> TrainConfig:
    """2 blocks of width 32, 4 sequences a step, STEPS steps (tests/support/trainer_runs.py's tiny)."""
    return tiny(files, steps=STEPS)


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("train_fp8"), **corpus}  # tests/conftest.py's corpus


# -- the tensor-parallel layer pair (tensorwise and rowwise) ------------------------------------------------
def _pair_grads(up: nn.Module, down: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> dict[str, torch.Tensor]:
    """``down(gelu(up(x)))`` forward and backward: output, input gradient, weight gradients (this rank's)."""
    x = x.clone().requires_grad_()
    y = down(F.gelu(up(x)))
    y.backward(gy)
    return {"y": y.detach(), "dx": x.grad, "up": up.weight.grad, "down": down.weight.grad}


def _layer_check(ctx) -> dict[str, float]:
    """Worst ``|TP - one device| / tolerance`` of each variant (module docstring); the tolerance is
    ``FACTOR x`` the same pair's fp32 TP-vs-one-device spread, relative to each tensor's largest."""
    group, t, r = dist.group.WORLD, ctx.world_size, ctx.rank
    gen = torch.Generator().manual_seed(0)
    up, down = Linear(32, 64), Linear(64, 32)
    with torch.no_grad():
        for p in (*up.parameters(), *down.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        up.weight[32:] *= 8  # the second half of the hidden features 8x larger: each shard's amax differs
    x, gy = torch.randn(24, 32, generator=gen), torch.randn(24, 32, generator=gen)
    block = slice(r * 64 // t, (r + 1) * 64 // t)  # this rank's rows of up.weight, columns of down.weight

    def one_device(scaling: str | None) -> dict[str, torch.Tensor]:
        a, b = (Linear(layer.in_features, layer.out_features) for layer in (up, down))
        a.load_state_dict(up.state_dict())
        b.load_state_dict(down.state_dict())
        pair = nn.ModuleDict({"up": a, "down": b})
        if scaling is not None:
            apply_float8_training(pair, scaling=scaling)
        out = _pair_grads(pair["up"], pair["down"], x, gy)
        return out | {"up": out["up"][block], "down": out["down"][:, block]}  # this rank's blocks

    def tensor_parallel(scaling: str | None, *, agreed: bool = True, convert_down: bool = True):
        pair = nn.ModuleDict({"up": ColumnParallelLinear.from_linear(up, tp_group=group),
                              "down": RowParallelLinear.from_linear(down, tp_group=group)})
        if scaling is not None:
            apply_float8_training(pair, scaling=scaling, keep=() if convert_down else ("down",))
            if not agreed:  # negative control: each shard cast with its own amax
                for layer in pair.values():
                    layer.matmul = partial(float8_linear, config=Float8Config.recipe(scaling))
        return _pair_grads(pair["up"], pair["down"], x, gy)

    ref32, tp32 = one_device(None), tensor_parallel(None)
    scale = {k: float(v.abs().max()) for k, v in ref32.items()}
    spread = max(float((tp32[k] - ref32[k]).abs().max()) / scale[k] for k in ref32)
    assert spread > 0, "the fp32 pair gave the same bits under TP: no yardstick"

    def worst(got: dict, want: dict) -> float:
        return max(float((got[k] - want[k]).abs().max()) / (FACTOR * spread * scale[k]) for k in want)

    ref = {s: one_device(s) for s in ("tensorwise", "rowwise")}
    return {"fp32 spread": spread,
            "tensorwise": worst(tensor_parallel("tensorwise"), ref["tensorwise"]),
            "rowwise": worst(tensor_parallel("rowwise"), ref["rowwise"]),
            "control: own amax (tensorwise)": worst(tensor_parallel("tensorwise", agreed=False),
                                                    ref["tensorwise"]),
            "control: rowwise against tensorwise": worst(tensor_parallel("rowwise"), ref["tensorwise"]),
            "control: row layer left unconverted": worst(tensor_parallel("tensorwise", convert_down=False),
                                                         ref["tensorwise"])}


class _CountScaledMM(TorchDispatchMode):
    """Counts ``aten._scaled_mm`` calls (the fp8 GEMMs), forward and backward, on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten._scaled_mm.default
        return func(*args, **(kwargs or {}))


def _saved_per_block(group, *, sequence_parallel: bool) -> list[int]:
    """The saved bytes per block of one bf16-autocast forward of the fp8 tensor-parallel GPT (the trainer's
    conversion: first and last linear kept)."""
    plain = GPT(CONFIG, seed=1)
    keep = first_and_last_linear(plain)
    model = apply_tensor_parallel(plain, tp_group=group, sequence_parallel=sequence_parallel, pad_vocab=True)
    apply_float8_training(model, keep=keep)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return tp_lm_loss(model(ids), ids, tp_group=group, vocab_size=CONFIG.vocab_size)
    return measure_saved_activations(model, forward).per_block()


def _worker(ctx, files: dict) -> dict:
    out = {"layers": _layer_check(ctx)}
    for sp in (False, True):
        out["saved per block", sp] = _saved_per_block(dist.group.WORLD, sequence_parallel=sp)
    for name, case in LAYOUTS.items():
        grads: dict = {}
        if name in PREDICTED:  # predict_run's figures of step 1
            probe = TrainerProbe(step=1)
            probe.gradient_probe = first_step_gradients(grads)
        else:
            probe = TrainHooks(gradient_probe=first_step_gradients(grads))
        with _CountScaledMM() as fp8_gemms:
            records = run_case(ctx, _base(files), case, Path(files["root"]) / name, hooks=probe)
        out[name], out[name, "grads"] = [r["loss"] for r in records], grads
        out[name, "fp8 GEMMs"], out[name, "bytes"] = fp8_gemms.calls, records[1]["bytes_sent"]
        if name in PREDICTED:
            out[name, "measured"] = dataclasses.asdict(probe.measured)
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, 2, files, timeout_s=SPAWN_TIMEOUT_S)


def _one(files: dict, name: str, case: Case) -> tuple[list[float], dict]:
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    grads: dict = {}
    records = run_case(ctx, _base(files), case, Path(files["root"]) / name, probe=first_step_gradients(grads))
    return [r["loss"] for r in records], grads


@pytest.fixture(scope="module")
def one_device(files) -> dict:
    """tests/support/one_device.py's dict (``(label, order)`` losses, ``("grads", label, order)`` gradients)
    of
    ``ONE_DEVICE``, plus ``("grads", "fp8", "halves, one more layer in bf16")``: the negative control."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out: dict = {}
        for (label, order), case in ONE_DEVICE.items():
            out[label, order], out["grads", label, order] = _one(files, f"{label}-{order}", case)
        ends = first_and_last_linear
        with pytest.MonkeyPatch.context() as patch:  # block 1's dense_h_to_4h kept in bf16 too
            patch.setattr("refimpl.precision.fp8.first_and_last_linear",
                          lambda model: (*ends(model), "layers.1.mlp.dense_h_to_4h"))
            _, out["grads", "fp8", "halves, one more layer in bf16"] = _one(
                files, "unconverted", ONE_DEVICE["fp8", "halves"])
        return out
    finally:
        torch.set_num_threads(threads)


def _equal(pieces: dict, whole: dict) -> bool:
    """Every box of ``pieces`` (a rank's gradient probe) equals the same box of one device's, bit for bit."""
    def box(off: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(off, shape, strict=True))
    return all(np.array_equal(got, whole[n][2][box(off, got.shape)]) for n, (off, _, got) in pieces.items())


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_tensor_parallel_fp8_layers_cast_with_one_devices_scales(runs):
    for rank, out in enumerate(runs):
        got = out["layers"]
        print(rank, {k: f"{v:.3g}" for k, v in got.items()})
        assert got["tensorwise"] <= 1 and got["rowwise"] <= 1, (rank, got)
        assert all(v > 1 for k, v in got.items() if k.startswith("control")), (rank, got)


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", ["dp2", "dp2-zero2"])
def test_dp2_is_one_devices_fp8_arithmetic_bit_for_bit(runs, one_device, name):
    halves = one_device["grads", "fp8", "halves"]
    for rank, out in enumerate(runs):
        assert set(out[name, "grads"]) == set(halves)
        assert _equal(out[name, "grads"], halves), (name, rank)
        if name == "dp2":
            assert out[name] == one_device["fp8", "halves"], (rank, out[name], one_device["fp8", "halves"])
        assert out[name][-1] < out[name][0] - 0.5, out[name]  # it trains
    # negative controls: other activation scales (the whole batch at once), one more layer left in bf16
    for control in (("grads", "fp8", "batch"), ("grads", "fp8", "halves, one more layer in bf16")):
        assert not _equal(runs[0][name, "grads"], one_device[control]), control


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", ["tp2", "tp2-rowwise", "pp2", "tp2-sp", "pp2-zbh1", "dp2-zero3", "cp2"])
def test_tp2_pp2_cp2_and_zero3_train_like_one_device(runs, one_device, name):
    label = "fp8-rowwise" if "rowwise" in name else "fp8"
    assert_trains_like_one_device([out[name] for out in runs], one_device, label, factor=FACTOR, name=name)
    worst = assert_gradients_like_one_device([out[name, "grads"] for out in runs], one_device, label,
                                             factor=FACTOR, name=name, control=2.0)
    print(f"{name}: worst gradient difference {worst:.3f} x its tolerance")
    assert all(out[name][-1] < out[name][0] - 0.5 for out in runs), name  # it trains


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize(("name", "plain"), [("tp2-sp", "tp2"), ("pp2-zbh1", "pp2")])
def test_sequence_parallelism_and_zbh1_run_every_gemm_in_fp8(runs, name, plain):
    """Sequence parallelism (the seam gathers the column layers' input and computes their backward GEMMs
    with fp8's ``Float8Matmul``) and zbh1 (the seam defers fp8's ``dW`` to the W actions) run as many
    fp8 GEMMs per rank as the same layout without them, three per converted layer and micro-batch (the
    seam computing those backward GEMMs in bf16, as it did before, makes fewer: 60 against 84 at tp 2 with
    SP); that they train like one device is ``test_tp2_pp2_cp2_and_zero3_train_like_one_device``."""
    for rank, out in enumerate(runs):
        assert out[name, "fp8 GEMMs"] == out[plain, "fp8 GEMMs"] > 0, (rank, out[name, "fp8 GEMMs"],
                                                                      out[plain, "fp8 GEMMs"])
        print(name, rank, out[name, "fp8 GEMMs"])


REFUSED = {"fp8-zero3-rowwise": ["--zero-stage", "3", "--precision", "fp8", "--fp8-scaling", "rowwise"],
           "fp8-scaling-without-fp8": ["--fp8-scaling", "rowwise"]}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusals_say_one_line_and_exit_2(name, capsys):
    from refimpl.train.cli import main

    assert main([*TINY, *REFUSED[name]]) == 2
    (row,) = [r for r in SUPPORT_TABLE if r.name == name]
    assert capsys.readouterr().err == f"error: {row.message()}\n"


def test_the_refusal_is_the_commands_exit_status(tmp_path):
    done = subprocess.run([sys.executable, "-m", "refimpl.train", *TINY, *REFUSED["fp8-zero3-rowwise"],
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, (done.returncode, done.stderr)
    assert done.stderr.startswith("error: --fp8-scaling rowwise with ZeRO-3: ")


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", PREDICTED)
def test_predict_run_equals_the_fp8_run_to_the_byte(runs, files, name):
    """predict_run at fp8 (dp 2, ZeRO 0, 2 and 3) against the trainer's step 1, per rank: the bytes sent
    per group (metrics.jsonl's tracer; ZeRO-3: the fp8 weights gathered as e4m3 bytes, the others in bf16,
    each gather after a MAX all-reduce of the unit's amaxes), the state from the live tensors and the held
    activations (``TrainerProbe``), as tests/planner/ranks/test_planner_3d.py checks fp32 and bf16. Controls:
    bf16's prediction of the same layout holds other activation bytes at ZeRO 0-2 (fp8 saves the LayerNorm-fed
    inputs in fp32), and sends other bytes at ZeRO-3 (its gathers move 2 bytes per weight element). Under
    zbh1 the deferred linears keep their float32 inputs in bf16 too (counting fp8's extra again was the
    planner's first, wrong, prediction: 4,096 bytes too many on rank 0), but an fp8 layer's deferred dW
    keeps its two fp8 operands, one byte per element where bf16 keeps two (16,352 bytes fewer on rank 1,
    whose peak has a W pending)."""
    from refimpl.planner import predict_run

    config, case = _base(files), LAYOUTS[name]

    def predict(precision: str):
        return predict_run(config.model, dataclasses.replace(case.parallel, precision=precision),
                           world_size=2, seq_len=config.data.seq_len,
                           global_batch=config.data.global_batch_size,
                           micro_batch=case.micro_batch_size, grad_clip=config.optim.grad_clip)
    plan, bf16 = predict("fp8"), predict("bf16")
    if name.endswith("zbh1"):  # the fp8 layers' deferred dW operands: one byte per element, not bf16's two
        assert any(out[name, "measured"]["activations"] != bf16.ranks[rank].activation_bytes
                   for rank, out in enumerate(runs))
    for rank, out in enumerate(runs):
        want, got = plan.ranks[rank], out[name, "measured"]
        assert out[name, "bytes"] == want.bytes_sent, (name, rank, out[name, "bytes"], want.bytes_sent)
        state = (want.state.weights, want.state.grads, want.state.optimizer)
        assert tuple(got["state"]) == state, (name, rank, got, state)
        assert got["activations"] == want.activation_bytes, (name, rank, got, want.activations)
        if name.endswith("zero3"):  # the fp8 weights gathered at one byte (and their amaxes agreed)
            assert out[name, "bytes"] != bf16.ranks[rank].bytes_sent
        elif not name.endswith("zbh1"):  # (zbh1: above)
            assert got["activations"] != bf16.ranks[rank].activation_bytes


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_the_planner_counts_fp8s_saved_bytes_under_tensor_and_sequence_parallelism(runs, sequence_parallel):
    """Per block, at tp 2 with and without sequence parallelism: the saved bytes of the fp8 GPT equal
    ``activation_bytes`` (bf16) plus ``fp8_extra_saved_bytes`` (the LayerNorm-fed fp8 layers save
    their input in fp32: whole under tp, the rank's s/t tokens under SP). Control: SP's extra counted on
    the whole sequence is wrong."""
    from refimpl.planner import activation_bytes
    from refimpl.planner.fp8 import fp8_extra_saved_bytes

    kw = {"micro_batch": 2, "tp": 2, "sequence_parallel": sequence_parallel}
    base = activation_bytes(CONFIG, seq_len=16, compute_dtype=torch.bfloat16, **kw)
    extra = fp8_extra_saved_bytes(CONFIG, tokens=16, **kw)
    for rank, out in enumerate(runs):
        got = out["saved per block", sequence_parallel]
        assert got == [a + e for a, e in zip(base, extra, strict=True)], (rank, got, base, extra)
    if sequence_parallel:
        whole = fp8_extra_saved_bytes(CONFIG, tokens=16, micro_batch=2, tp=2)
        assert runs[0]["saved per block", True] != [a + e for a, e in zip(base, whole, strict=True)]


def test_the_planner_counts_fp8_to_the_byte_and_names_the_trainers_fp8_weights():
    from refimpl.measure.activations import SavedTensorMeter
    from refimpl.planner import predict_run, run_memory_per_rank
    from refimpl.planner.fp8 import fp8_weights

    model = parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=1), ParallelConfig(dp=1, precision="fp8")).model
    assert [q.name for q in fp8_weights(CONFIG)] == [f"{n}.weight" for n in float8_layers(model)]
    assert {q.name for q in fp8_weights(CONFIG, tp=2)} == {q.name for q in fp8_weights(CONFIG)}
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(model) as meter, torch.autocast("cpu", dtype=torch.bfloat16):
        lm_loss(model(ids), ids)
    plan = {p: run_memory_per_rank(CONFIG, ParallelDims(dp=1), micro_batch=2, seq_len=16, precision=p)
            for p in ("bf16", "fp8")}
    assert plan["fp8"].activations["block activations"] == sum(meter.report.per_block())
    assert plan["fp8"].activations["block activations"] > plan["bf16"].activations["block activations"]
    copies = sum(d.get("bfloat16", 0) for d in meter.report.weights.values())  # autocast's bf16 copies
    weight_copies = {p: plan[p].state["autocast weight copies"] for p in plan}
    assert weight_copies["fp8"] == copies < weight_copies["bf16"]
    for refused in ({"pp": 2, "pp_schedule": "zbh1", "fp8_scaling": "rowwise"}, {"pp": 2, "zero_stage": 3},
                    {"tp": 2}):
        with pytest.raises(ValueError, match="predict_run models"):
            predict_run(CONFIG, ParallelConfig(dp=1, precision="fp8", **refused), global_batch=2, seq_len=16)


def test_moe_models_get_fp8_dense_linears_and_keep_routers_and_experts():
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=16, num_experts=4,
                         top_k=2, moe_every=2)
    model = parallelize(GPT(config, seed=0), ParallelDims(dp=1), ParallelConfig(dp=1, precision="fp8")).model
    converted = float8_layers(model)
    assert "layers.0.self_attention.dense" in converted and "layers.1.mlp.dense_h_to_4h" in converted
    assert not any("router" in n or "experts" in n or n.startswith("layers.0.mlp") for n in converted)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lm_loss(model(ids), ids).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
