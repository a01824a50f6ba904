"""The trainer with ``--pp`` (chapter 08): every schedule trains the same model as one device, composes
with ``--dp`` (ZeRO-0 and ZeRO-1), ``--tp`` (with sequence parallelism; zbh1 with tp as 1f1b), ``--cp``,
``--precision`` (fp16 with its loss scaler) and activation checkpointing, and a ``pp 2 x dp 2`` ZeRO-1
checkpoint (written under the plain GPT's names) resumes at ``dp 4`` with ZeRO-0.

One spawn of 4 ranks trains each layout (tests/support/trainer_runs.py); the one-device references run in
this process. Tolerance (the numerics rule, as tests/trainer/ranks/test_train_tp.py): ``FACTOR x spread``,
``spread`` the largest difference between two one-device runs in two summation orders (the whole batch at once
vs one sequence per micro-batch), in 16 bits at least ``|16-bit - fp32|`` on one device. picotron's DP x PP
bug (a rank that never averages its gradients over dp) gets its own check: after a step the dp replicas of
each stage hold the same bits, and without the average (the negative control) they do not.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from refimpl.config import ParallelConfig
from refimpl.launch import run_ranks
from refimpl.models import GPT
from refimpl.train import RunOptions, build_setup
from refimpl.train.gradients import gradient_shards
from refimpl.train.layout import resolve
from refimpl.train.step import train_step
from tests.support import timeouts
from tests.support.one_device import _gradient_tolerances, first_step_gradients, one_device_losses, tolerance
from tests.support.trainer_runs import Case, layout_tests, run_case, run_layouts, tiny

# the one spawn timeout x 2: 4 ranks train the GPT under each schedule; it was 420 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4
LAYERS = 4  # the model's blocks: 4 stages at pp 4, 2 chunks per rank interleaved at pp 2


def _pp(**fields) -> Case:
    """A pipeline layout of ``ParallelConfig`` ``fields``, 2 micro-batches unless said."""
    return Case(parallel=ParallelConfig(**{"microbatches": 2, **fields}))


# the layouts at world size 4 (each compared with one device at its precision)
LAYOUTS = {
    "pp2-dp2-1f1b-zero1": Case(parallel=ParallelConfig(pp=2, microbatches=2, zero_stage=1), steps=STEPS + 2,
                               checkpoint_every=STEPS),  # resumed at dp 4
    "pp4-gpipe": Case(parallel=ParallelConfig(pp=4, pp_schedule="gpipe", microbatches=4),
                      report=True),  # its sample
    "pp2-dp2-interleaved": _pp(pp=2, pp_schedule="interleaved", virtual_stages=2, pp_balance="parameters"),
    "pp4-zbh1-bf16": _pp(pp=4, pp_schedule="zbh1", microbatches=4, precision="bf16"),
    "pp2-dp2-fp16-actckpt": _pp(pp=2, precision="fp16", activation_checkpointing="all"),
    # tensor parallelism inside the stages: the tied embedding's copy is a vocab-parallel shard
    "pp2-tp2-sp": _pp(pp=2, tp=2, sequence_parallel=True),
    # zbh1 with tp: the TP layers (and SP's gather-then-linear) defer their block's dW to the W actions
    "pp2-tp2-sp-zbh1": _pp(pp=2, tp=2, sequence_parallel=True, pp_schedule="zbh1"),
    "pp2-tp2-zbh1-bf16": _pp(pp=2, tp=2, pp_schedule="zbh1", precision="bf16"),  # f in front, autocast inside
    "pp2-tp2-interleaved-bf16": _pp(pp=2, tp=2, pp_schedule="interleaved", virtual_stages=2, microbatches=4,
                                    precision="bf16"),
    # context parallelism inside the stages: the boundaries carry each rank's s/cp tokens
    "pp2-cp2-ring": _pp(pp=2, cp=2),
    # ZeRO-2: each micro-batch's gradients reduce-scattered and freed in backward, the tied embedding's
    # exchange made of the two ends' shards
    "pp2-dp2-zero2": _pp(pp=2, zero_stage=2),
    # ZeRO-2 under zbh1: a weight's gradient is reduce-scattered after its W action (WeightGradStore's
    # after_flush), the rest in backward as above
    "pp2-dp2-zero2-zbh1": _pp(pp=2, zero_stage=2, pp_schedule="zbh1"),
    # zbh1 with activation checkpointing: the recomputed forward's saved weight comes back through the
    # checkpoint's saved-tensor hooks as another tensor object; each deferred dW must reach the Parameter
    "pp2-dp2-zbh1-actckpt": _pp(pp=2, pp_schedule="zbh1", activation_checkpointing="all"),
    # ZB-V with ZeRO-1: the tied embedding's two ends are one tensor on pp rank 0 (stages 0 and 3), handed
    # to the optimizer once; stages 1 and 2 on pp rank 1 hand the turn over in place
    "pp2-dp2-zbv-zero1": _pp(pp=2, pp_schedule="zbv", virtual_stages=2, zero_stage=1),
}
# the layouts whose gradient norm is computed directly: ZeRO-1 (the norm summed over the dp shards), tensor
# parallelism (a vocab-parallel tied embedding, replicas counted on tp rank 0)
NORM_LAYOUTS = {"pp2-dp2-zero1": ParallelConfig(pp=2, microbatches=2, zero_stage=1),
                "pp2-tp2": ParallelConfig(pp=2, tp=2, microbatches=2)}


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus: dict) -> dict:
    """The shared corpus and its token cache (tests/conftest.py), and this module's folder for its runs."""
    return {"root": tmp_path_factory.mktemp("train_pp"), **corpus}


def _setup(ctx, files: dict, parallel: ParallelConfig, groups=None):
    """The trainer's setup of ``parallel`` on this rank (``refimpl.train.build_setup``), and the config."""
    config = tiny(files, num_layers=LAYERS, steps=STEPS)
    options = RunOptions(parallel=parallel, report=False)
    return build_setup(config, ctx, resolve(config, options, ctx.world_size), groups), config


def _replicas_agree(ctx, files: dict, *, average: bool) -> bool:
    """One pp 2 x dp 2 step; whether the dp replicas of this rank's stages hold the same bits after it."""
    parallel = ParallelConfig(pp=2, microbatches=2)
    dims = RunOptions(parallel=parallel).parallel_dims(ctx.world_size)
    groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    setup, config = _setup(ctx, files, parallel, groups)
    if not average:
        setup.optim = replace(setup.optim, finish=None)  # the bug: this rank never averages over dp
    g = torch.Generator().manual_seed(1 + dims.coordinates(ctx.rank).dp)  # each dp rank its own batch
    tokens = torch.randint(0, 256, (2, 17), generator=g)
    train_step(setup, tokens[:, :-1], tokens[:, 1:], accumulation=2, micro=1,
               grad_clip=config.optim.grad_clip)
    flat = torch.cat([p.detach().flatten() for p in setup.pipeline.parameters()])
    other = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(other, flat, group=groups.group("dp"))
    return torch.equal(*other)


def _gradient_norm(ctx, files: dict, parallel: ParallelConfig) -> tuple[float, dict]:
    """One step's forwards and backwards at the layout ``parallel`` as ``train_step`` runs them, then the
    norm the trainer clips by (its ``clip_fn``: summed over pp, tp and dp, the tied embedding once) and the
    gradients it was computed from (``tests.support.one_device.Pieces``)."""
    setup, _ = _setup(ctx, files, parallel)
    m = parallel.microbatches
    assert m is not None
    dims = RunOptions(parallel=parallel).parallel_dims(ctx.world_size)
    g = torch.Generator().manual_seed(1 + dims.coordinates(ctx.rank).dp)  # each dp rank its own batch
    tokens = torch.randint(0, 256, (2 * m, 17), generator=g)
    setup.pipeline.step(tokens[:, :-1], tokens[:, 1:], num_microbatches=m,
                        loss_fn=lambda logits, y: setup.parallel.loss(logits, y) / m)
    setup.optim.finish_gradients()
    grads: dict = {}
    first_step_gradients(grads)(0, gradient_shards(setup))
    return float(setup.optim.clip_fn(setup.optim.grad_params)), grads


def _worker(ctx, files: dict) -> dict:
    root, base = Path(files["root"]), tiny(files, num_layers=LAYERS, steps=STEPS)
    out = run_layouts(ctx, base, LAYOUTS, root)
    if ctx.rank == 0:  # the pp 2 x dp 2 checkpoint of step STEPS alone, resumed at dp 4 below
        shutil.copytree(root / "pp2-dp2-1f1b-zero1" / "checkpoints", root / "resumed-checkpoints")
        shutil.rmtree(root / "resumed-checkpoints" / f"step_{STEPS + 2:08d}")
    dist.barrier()
    dp4 = Case(parallel=ParallelConfig(), steps=STEPS + 2, checkpoint_every=STEPS)
    records = run_case(ctx, base, dp4, root / "resumed", checkpoint_dir=root / "resumed-checkpoints")
    out["resumed at dp4"] = [r["loss"] for r in records]
    out["sample"] = (root / "pp4-gpipe" / "sample.txt").read_text() if ctx.rank == 0 else None
    out["replicas agree"] = _replicas_agree(ctx, files, average=True)
    out["replicas agree without the average"] = _replicas_agree(ctx, files, average=False)
    for name, parallel in NORM_LAYOUTS.items():
        out[name, "norm"] = _gradient_norm(ctx, files, parallel)
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, 4, files, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def one_device(files, tmp_path_factory) -> dict:
    """One-device runs in this process: per precision the plain run and one in another summation order."""
    return one_device_losses(tiny(files, num_layers=LAYERS), tmp_path_factory.mktemp("one_device"),
                             steps=STEPS + 2)


def _tolerance(one_device: dict, precision: str) -> float:
    return tolerance(one_device, precision, factor=FACTOR)


# the losses and the first step's gradients (before clipping and AdamW, every rank's boxes) against one
# device's (tests/support/one_device.py); negative control: the gradients x m, what a pipeline whose loss is
# not divided by its m micro-batches computes
(test_pipeline_layouts_train_like_one_device,
 test_pipeline_layouts_hand_the_optimizer_one_devices_gradients) = layout_tests(
    LAYOUTS, factor=FACTOR, timeout_s=2 * SPAWN_TIMEOUT_S,
    control=lambda case: float(case.parallel.microbatches))


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_zbh1_with_tp_trains_like_1f1b_at_the_same_layout(runs, one_device):
    """pp 2 x tp 2 with sequence parallelism: zbh1 (each TP layer's dW deferred to its W action) against
    1f1b (dW in backward), rank by rank: the losses within the one-device tolerance, and every box of the
    first step's gradients within its parameter's one-device tolerance (tests/support/one_device.py)."""
    zb, plain = "pp2-tp2-sp-zbh1", "pp2-tp2-sp"
    tol = _tolerance(one_device, "fp32")
    per_param = _gradient_tolerances(one_device, "fp32", factor=FACTOR)
    bitwise = True
    for rank, out in enumerate(runs):
        assert float(np.abs(np.array(out[zb]) - np.array(out[plain])).max()) <= tol, (rank, out[zb])
        assert sorted(out[zb, "grads"]) == sorted(out[plain, "grads"])
        for name, (offsets, shape, values) in out[zb, "grads"].items():
            other = out[plain, "grads"][name]
            assert (offsets, shape) == other[:2], (rank, name)
            assert float(np.abs(values - other[2]).max()) <= per_param[name], (rank, name)
            bitwise = bitwise and np.array_equal(values, other[2])
        bitwise = bitwise and out[zb] == out[plain]
    print(f"zbh1 vs 1f1b at pp 2 x tp 2 (SP): {'bitwise equal' if bitwise else 'within tolerance'}")


def _whole(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The plain GPT's gradients from the ranks' boxes (replicas write the same values)."""
    out: dict[str, torch.Tensor] = {}
    for pieces in per_rank:
        for name, (offsets, shape, values) in pieces.items():
            whole = out.setdefault(name, torch.zeros(shape))
            whole[tuple(slice(o, o + n) for o, n in zip(offsets, values.shape, strict=True))] = (
                torch.from_numpy(values))
    return out


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(NORM_LAYOUTS))
def test_the_pipeline_gradient_norm_is_clip_grad_norm_of_the_same_gradients_on_one_device(runs, files, name):
    """The norm the pipeline trainer clips by (summed over its stages, tp and dp ranks, the tied embedding
    counted once) equals ``torch.nn.utils.clip_grad_norm_`` over the same gradients in a plain GPT (whose
    tied embedding is one parameter). Tolerance: ``FACTOR x`` the spread of one device's norm over two
    summation orders (the parameters forwards and backwards) and float64. Negative control: the tied copy
    counted twice (the last stage's copy not left out) differs by more."""
    norms = [out[name, "norm"][0] for out in runs]
    assert len(set(norms)) == 1, norms  # every rank clips by the same norm
    grads = _whole([out[name, "norm"][1] for out in runs])
    model = GPT(tiny(files, num_layers=LAYERS).model, seed=0)
    params = dict(model.named_parameters())
    assert sorted(grads) == sorted(params)  # tied: one parameter, one gradient
    for n, p in params.items():
        p.grad = grads[n].clone()
    forwards = float(torch.nn.utils.clip_grad_norm_(list(params.values()), float("inf")))
    backwards = float(torch.nn.utils.clip_grad_norm_(list(params.values())[::-1], float("inf")))
    exact = float(torch.cat([g.double().ravel() for g in grads.values()]).norm())
    tol = FACTOR * max(abs(forwards - backwards), abs(forwards - exact))
    assert tol > 0
    assert abs(norms[0] - forwards) <= tol, (norms[0], forwards, tol)
    twice = (norms[0] ** 2 + float(grads["embedding.word_embeddings.weight"].square().sum())) ** 0.5
    assert abs(twice - forwards) > tol, (twice, forwards, tol)
    print(f"{name}: norm {norms[0]:.9g}, one device {forwards:.9g} (tolerance {tol:.2e}), tied twice "
          f"{twice:.9g}")


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_a_pp2_checkpoint_resumes_at_dp4_and_continues_the_losses(runs, one_device):
    resumed, pp2 = runs[0]["resumed at dp4"], runs[0]["pp2-dp2-1f1b-zero1"]
    assert len(resumed) == 2  # a fresh --out: the two steps after the resume
    tol = _tolerance(one_device, "fp32")
    assert float(np.abs(np.array(resumed) - np.array(pp2[STEPS:])).max()) <= tol
    assert float(np.abs(np.array(resumed) - np.array(one_device["fp32", "batch"][STEPS:])).max()) <= tol


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_metrics_record_the_pipeline_bytes_and_the_measured_idle_share(runs):
    """pp 4 x GPipe, 4 micro-batches of one 16-token sequence, width 32, float32: a boundary tensor is 2,048
    bytes. Per step an interior rank sends 4 activations and 4 gradients, the first rank 4 activations and
    the last 4 gradients, those two also the tied embedding's gradient (256 x 32 x 4 bytes) to each other;
    every rank books the ring model's bytes of two one-scalar all-reduces over pp (the loss, the norm)."""
    from refimpl.planner import wire_bytes

    boundary, tied, scalars = 16 * 32 * 4, 256 * 32 * 4, 2 * wire_bytes("all_reduce", 4, 4)
    want = [4 * boundary + tied, 8 * boundary, 8 * boundary, 4 * boundary + tied]
    for rank, out in enumerate(runs):
        steps = out["pp4-gpipe", "records"]
        assert all(s["bytes_sent"]["pp"] == want[rank] + scalars for s in steps), (rank, steps[0])
        assert all(0 <= s["pipeline_idle"] < 1 for s in steps), steps  # measured: timing, no value asserted


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_dp_replicas_of_a_stage_stay_equal_and_the_skipped_average_is_caught(runs):
    for rank, out in enumerate(runs):
        assert out["replicas agree"], rank
        assert not out["replicas agree without the average"], rank  # picotron's DP x PP bug, caught


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_rank_zero_samples_from_the_gathered_stages(runs):
    sample = runs[0]["sample"]
    assert sample.startswith("def ") and len(sample) > len("def ")
