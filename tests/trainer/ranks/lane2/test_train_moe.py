"""The trainer with MoE blocks and ``--ep`` (chapter 09): expert parallelism carved out of the data-parallel
ranks (``--ep 2 --dp 4``: two expert-data-parallel replicas of each expert; ``--ep 2 --tp 2`` (dp 2): the
experts whole on both tp ranks), at ZeRO 0-2, with gradient accumulation, activation checkpointing and
DeepSeek-V3's bias balancing, trains the model one device trains, and its checkpoints resume at another
``--ep``.

One ``run_ranks`` of 4 ranks runs every layout through ``refimpl.train.train``; the one-device runs
(fp32, the whole batch at once and one sequence per micro-batch) run in this process. The balance loss is
a mean over sequences (``refimpl.models.moe``), so both one-device orders and every layout minimise the same
objective, and the numerics rule of tests/support/one_device.py applies unchanged (routing is dropless here:
capacity is per rank's forward, ``refimpl.models.moe``):

* the losses within ``FACTOR x`` the one-device order spread, and the **first step's gradients before
  clipping and AdamW**, every rank's boxes of every parameter (experts: rows of the ``[E, ...]`` tensors)
  against one device's, each within ``FACTOR x`` its order spread; a planted factor 2 fails;
* under context parallelism (``--cp 2 --dp 2 --ep 4``: an expert-parallel group spans the cp ranks) the
  balance loss sums each sequence's counts over cp; **negative control**: per cp rank's half fails;
* under sequence parallelism (``--tp 2 --sequence-parallel --dp 2 --ep 2``, ZeRO-1) each tp rank routes
  its ``s/t`` tokens: the counts summed over tp, the routers' and experts' gradients too; **negative
  control**: each tp rank's balance loss from its own tokens, whole, fails;
* under ZeRO-3 (``--dp 4 --ep 2``, and per stage under ``--pp 2``) each MoE block's experts are a unit of
  their own, sharded over the expert-data-parallel group, their gradients summed there and divided by
  ``dp x cp``; **negative control**: a mean over edp instead fails;
* under pipeline parallelism (``--pp 2 --dp 2 --ep 2``, 1F1B and zbh1 with ZeRO-2) each stage's balance
  loss is backpropagated in that stage; **negative control**: stage 0's left out of its backward fails;
* the DeepSeek-V3 form (``--arch deepseek``: multi-head latent attention, sigmoid routing with the expert
  bias, a shared expert, the first block dense) at DeepSeek-V3's own ``--pp 2 --ep 2`` (dp 2), against its
  own one-device runs;
* **negative control**: the same ``--ep 2 --dp 4`` run with the experts' placement saying ``dp x cp`` instead
  of ``edp`` (their gradients averaged over the dp x cp ranks, which hold other experts) fails the same
  comparison on the expert tensors, by far;
* metrics.jsonl's MoE figures: the balance loss equals one device's, tokens per expert mean is ``k T / E``
  of the global batch's ``T`` tokens, max at least that, nothing dropped; the all-to-alls show as bytes on
  the ``ep`` group, the expert gradients' sum on ``edp``;
* the gradient norm the trainer clips by counts every element once (experts on their ep rank, dense
  replicas once), at ZeRO-0 and ZeRO-1 and with tp;
* checkpoints: the ``--dp 4 --ep 2 --zero-stage 3`` checkpoint loads bitwise into the plain GPT and into a
  ``--pp 2 --dp 2 --ep 2 --zero-stage 3`` run's boxes; the ``--ep 2`` checkpoint (experts' rows as boxes
  of ``[E, ...]``) loads bitwise into the plain GPT (``--ep 1``) and into an ``--ep 4`` run's boxes, and
  the runs resumed at ``--ep 4`` and at
  ``--ep 1`` (plain data parallelism of the whole MoE model) continue the ``--ep 2`` losses (and one
  device's).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from refimpl.checkpoint import CheckpointConfig, Checkpointer, load_training_state
from refimpl.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from refimpl.distributed.placement import module_shards
from refimpl.launch import run_ranks
from refimpl.model_config import DEEPSEEK_V3
from refimpl.models import GPT
from refimpl.train import RunOptions, build_setup
from refimpl.train.hooks import TrainHooks
from refimpl.train.layout import resolve
from tests.support import timeouts
from tests.support.one_device import (
    assert_gradients_like_one_device,
    assert_trains_like_one_device,
    first_step_gradients,
    gradient_ratios,
    one_device_losses,
    tolerance,
)
from tests.support.trainer_runs import Case, run_case, tiny

# the one spawn timeout x 2: 4 ranks train the MoE GPT at each layout; it was 300 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4
AUX = {"num_experts": 4, "top_k": 2, "aux_loss_coeff": 0.1, "moe_activation": "gelu"}
FORMS = {"aux": AUX, "bias": {**AUX, "moe_load_balance": "bias"},
         # the DeepSeek-V3 form, tiny: MLA latents of 16, rope 4 + nope 8 query/key dims, values 8; three
         # blocks, the first dense, two MoE blocks with a shared expert (its balancing: the expert bias, the
         # form's default)
         "deepseek": {**DEEPSEEK_V3, **{k: v for k, v in AUX.items() if k != "moe_activation"},
                      "num_layers": 3, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4,
                      "qk_nope_head_dim": 8, "v_head_dim": 8, "moe_shared_experts": 1, "moe_first_dense": 1}}
SAVED = "dp4-ep2"  # saves at STEPS, runs STEPS + 2: resumed at ep 4 and ep 1
# name -> (the model's form, which is also the one-device reference, and the layout at world size 4)
LAYOUTS = {
    SAVED: ("aux", Case(parallel=ParallelConfig(ep=2), steps=STEPS + 2, checkpoint_every=STEPS)),
    # the expert state sharded over edp 2; the recomputed forward runs the all-to-alls again in backward
    "dp4-ep2-zero2-bias-actckpt": ("bias", Case(parallel=ParallelConfig(ep=2, zero_stage=2,
                                                                        activation_checkpointing="all"))),
    "tp2-dp2-ep2-zero1-accum": ("aux", Case(parallel=ParallelConfig(tp=2, ep=2, zero_stage=1),
                                            micro_batch_size=1)),
    # one MoE block per stage: stage 0's balance loss is backpropagated beside the received gradient
    "pp2-dp2-ep2": ("aux", Case(parallel=ParallelConfig(pp=2, ep=2), micro_batch_size=1)),
    # zbh1's W actions add the experts' and routers' weight gradients; ZeRO-2 shards the experts over edp
    "pp2-dp2-ep2-zbh1-zero2-bias": ("bias", Case(parallel=ParallelConfig(pp=2, ep=2, pp_schedule="zbh1",
                                                                         zero_stage=2))),
    # each sequence split over 2 cp ranks: the balance loss's counts summed over cp; ep 4 spans dp x cp
    "cp2-dp2-ep4": ("aux", Case(parallel=ParallelConfig(cp=2, ep=4))),
    # each tp rank routes its s/t tokens: counts summed over tp, router and expert gradients too
    "tp2-sp-dp2-ep2-zero1": ("aux", Case(parallel=ParallelConfig(tp=2, sequence_parallel=True, ep=2,
                                                                 zero_stage=1))),
    # ZeRO-3: the dense weights sharded over dp 4, each MoE block's experts a unit of their own, sharded over
    # edp 2 (their gradients summed there and divided by dp x cp), with accumulation; saved: loaded at pp 2
    "dp4-ep2-zero3-accum": ("aux", Case(parallel=ParallelConfig(ep=2, zero_stage=3), micro_batch_size=1,
                                        checkpoint_every=STEPS)),
    # ... and each pipeline stage sharded so, gathered once per step
    "pp2-dp2-ep2-zero3-bias": ("bias", Case(parallel=ParallelConfig(pp=2, ep=2, zero_stage=3))),
    # the DeepSeek-V3 form at DeepSeek-V3's own pp x ep: stage 0 the dense block and an MoE block, stage 1
    # the other; the shared experts are dense weights (averaged over dp), the experts split over ep
    "pp2-dp2-ep2-deepseek": ("deepseek", Case(parallel=ParallelConfig(pp=2, ep=2))),
}
PIPELINED = [name for name in LAYOUTS if name.startswith("pp")]
EXPERT = ".mlp.moe.experts."


def _model(form: str = "aux") -> ModelConfig:
    """2 blocks (the DeepSeek form 3) of width 32, 4 heads, 16 tokens, of ``FORMS[form]``."""
    return ModelConfig(**{"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "max_seq_len": 16,
                          **FORMS[form]})


def _base(files: dict, form: str = "aux") -> TrainConfig:
    """``_model(form)`` trained STEPS steps on 4 sequences a step (tests/support/trainer_runs.py's tiny)."""
    return replace(tiny(files, steps=STEPS), model=_model(form))


def _control(ctx, files: dict, name: str, case: Case, before_step) -> dict:
    """One step of a negative control at ``case`` (``before_step`` plants the bug): its gradients."""
    grads: dict = {}
    run_case(ctx, _base(files), replace(case, steps=1), Path(files["root"]) / name,
             hooks=TrainHooks(before_step=before_step, gradient_probe=first_step_gradients(grads)))
    return grads


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("train_moe"), **corpus}  # tests/conftest.py's corpus


def _load(folder: Path, model: torch.nn.Module) -> None:
    checkpointer = Checkpointer(CheckpointConfig(folder=str(folder)))
    load_training_state(checkpointer, checkpointer.find_latest_valid(), model=model, restore_rng=False)


def _pieces(module: torch.nn.Module) -> dict:
    return {n: (s.box.offsets, s.box.global_shape, s.tensor.detach().cpu().numpy().copy())
            for n, s in module_shards(module).items()}


def _dp_cp_for_experts(step: int, setup) -> None:
    """The negative control: the experts' placements say dp x cp, so their gradients are averaged over the dp
    x cp ranks (which hold other experts) instead of summed over edp and divided by dp x cp."""
    if step == 0:
        for name, p in setup.parallel.placements.items():
            if "edp" in p.reduce_over:
                setup.parallel.placements[name] = replace(p, reduce_over=("dp x cp",))


def _first_stage_loss_dropped(step: int, setup) -> None:
    """The pipeline's negative control: stage 0's balance loss counted but not backpropagated (as if only
    the last stage's loss reached backward)."""
    if step == 0:
        full = setup.parallel.stage_balance_loss

        def last_only(stage, *, micro_batches):
            aux = full(stage, micro_batches=micro_batches)
            return aux if aux is None or stage.is_last else aux.detach().requires_grad_()

        setup.parallel.stage_balance_loss = last_only


def _counts_not_summed_over_cp(step: int, setup) -> None:
    """The context-parallel negative control: each cp rank's balance loss from its own half of every
    sequence's assignments (the counts not summed over the cp group)."""
    if step == 0:
        from refimpl.models.moe import moe_blocks

        for block in moe_blocks(setup.model):
            block.cp_group = None


def _zero3_experts_averaged_over_edp(step: int, setup) -> None:
    """The ZeRO-3 negative control: the expert units' reduce-scatter a mean over edp (ep times too large)."""
    if step == 0:
        for unit in setup.state_module.units:
            if unit.divide_factor is not None:
                unit.divide_factor = None


def _balance_loss_not_split_over_sp(step: int, setup) -> None:
    """The sequence-parallel negative control: each tp rank's balance loss from its own s/t tokens, whole
    (neither its counts summed over tp nor its gradient divided by t); the gradients are still summed."""
    if step == 0:
        from refimpl.models.moe import moe_blocks

        for block in moe_blocks(setup.model):
            block.sp_group = None


NORM_LAYOUTS = {  # name -> (degrees, options)
    "dp4-ep2": (dict(dp=4, ep=2), {}),
    "dp4-ep2-zero1": (dict(dp=4, ep=2), dict(zero_stage=1)),
    "tp2-dp2-ep2": (dict(dp=2, tp=2, ep=2), {}),
    "pp2-dp2-ep2": (dict(dp=2, pp=2, ep=2), {}),  # each stage's experts summed over pp too
    "tp2-sp-dp2-ep2": (dict(dp=2, tp=2, ep=2), dict(sequence_parallel=True)),
    "dp4-ep2-zero3": (dict(dp=4, ep=2), dict(zero_stage=3)),
}


def _norms(ctx, config) -> dict:
    """The trainer's clip norm (``clip_fn``) of a planted gradient, the same global one on every rank, each
    rank's boxes of it (tests/ranks/test_param_placements.py's check, with experts); and the norm with every
    replica counted (placements without their replicated axes), which must be larger."""
    from refimpl.distributed.mesh import ParallelDims
    from refimpl.parallel.parallelize import parallelize
    from refimpl.parallel.parallelized import held_parameters
    from refimpl.parallel.placements import HeldGradient, clip_grad_norm_

    gen = torch.Generator().manual_seed(11)
    full = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(config, seed=1).named_parameters()}
    out = {"global": float(torch.cat([g.flatten().double() for g in full.values()]).norm())}
    for name, (degrees, options) in NORM_LAYOUTS.items():
        groups = ParallelDims(**degrees).build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=60)
        par = parallelize(GPT(config, seed=1), groups, groups.dims.config(**options))
        opt = par.build_optimizer(OptimConfig(grad_clip=1e9))
        held = dict(held_parameters(par))
        for n, p in held.items():  # ZeRO-1 sums the experts over edp and divides by dp x cp: plant ep x g
            scale = 2.0 if options.get("zero_stage") == 1 and EXPERT in n else 1.0
            p.grad = scale * full[n][par.placements[n].box.slices()].clone()
        out[name] = float(opt.clip_fn(None))
        if not options:
            every = [HeldGradient(n, p.grad, replace(par.placements[n], replicated_over=()))
                     for n, p in held.items()]
            out[name, "replicas counted"] = float(clip_grad_norm_(every, 1e9, groups=par.groups(),
                                                                  device=torch.device("cpu")))
        dist.barrier()
    return out


def _worker(ctx, files: dict) -> dict:
    root = Path(files["root"])
    out = {}
    for name, (form, case) in LAYOUTS.items():
        grads: dict = {}
        records = run_case(ctx, _base(files, form), case, root / name, checkpoint_dir=root / name / "ckpt",
                           probe=first_step_gradients(grads))
        out[name] = [r["loss"] for r in records]
        out[name, "grads"] = grads
        out[name, "records"] = records
    # the negative controls, one step each
    controls = {"control": (Case(parallel=ParallelConfig(ep=2)), _dp_cp_for_experts),
                "control-pp": (LAYOUTS["pp2-dp2-ep2"][1], _first_stage_loss_dropped),
                "control-cp": (LAYOUTS["cp2-dp2-ep4"][1], _counts_not_summed_over_cp),
                "control-sp": (LAYOUTS["tp2-sp-dp2-ep2-zero1"][1], _balance_loss_not_split_over_sp),
                "control-zero3": (Case(parallel=ParallelConfig(ep=2, zero_stage=3)),
                                  _zero3_experts_averaged_over_edp)}
    for name, (case, plant) in controls.items():
        out[name, "grads"] = _control(ctx, files, name, case, plant)
    if ctx.rank == 0:  # the ep 2 checkpoint of step STEPS alone, a copy for each resumed run
        kept = root / "ep2-checkpoint"
        shutil.copytree(root / SAVED / "ckpt", kept)
        shutil.rmtree(kept / f"step_{STEPS + 2:08d}")
        for ep in (4, 1):
            shutil.copytree(kept, root / f"resumed-ep{ep}-ckpt")
    dist.barrier()
    # that checkpoint loaded into an ep 4 run's model: each rank's boxes
    config = replace(_base(files), out=str(root / "unused"))
    ep4 = RunOptions(parallel=ParallelConfig(ep=4))
    setup = build_setup(config, ctx, resolve(config, ep4, ctx.world_size))
    _load(root / "ep2-checkpoint", setup.state_module)
    out["ep4 load"] = _pieces(setup.state_module)
    # the ZeRO-3 run's checkpoint (experts' rows over edp inside their ep boxes) at pp 2 x dp 2 x ep 2, ZeRO-3
    zero3_pp2 = RunOptions(parallel=ParallelConfig(pp=2, ep=2, zero_stage=3))
    setup = build_setup(config, ctx, resolve(config, zero3_pp2, ctx.world_size))
    _load(root / "dp4-ep2-zero3-accum" / "ckpt", setup.state_module)
    out["zero3 at pp2 load"] = _pieces(setup.state_module)
    out["norms"] = _norms(ctx, _model())
    for ep in (4, 1):  # ... and the run resumed from it for 2 more steps (ep 1: plain data parallelism)
        case = replace(LAYOUTS[SAVED][1], parallel=ParallelConfig(ep=ep))
        records = run_case(ctx, _base(files), case, root / f"resumed-ep{ep}",
                           checkpoint_dir=root / f"resumed-ep{ep}-ckpt")
        out[f"resumed at ep{ep}"] = [r["loss"] for r in records]
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, 4, files, timeout_s=SPAWN_TIMEOUT_S)


def _one_device(files: dict, form: str, *, steps: int) -> dict:
    """tests/support/one_device.py's references in fp32 only (the whole batch, one sequence per micro-batch),
    with the first step's gradients and the records."""
    return one_device_losses(_base(files, form), Path(files["root"]) / f"one-{form}", steps=steps,
                             parallel=ParallelConfig(), precisions=("fp32",))


@pytest.fixture(scope="module")
def one_device(files, runs) -> dict:
    """Per balancing mode the one-device references, and the ep 2 checkpoint loaded into the plain GPT."""
    # STEPS + 2 for bias too: on AVX2 kernels (an AMD EPYC here) its two orders gave the same bits for the
    # first STEPS steps (AdamW's first updates, about lr x sign(g), absorb the gradients' last-bit
    # differences), so there was no yardstick; at STEPS + 2 the orders part (one ulp of the loss)
    out = {form: _one_device(files, form, steps=STEPS + 2) for form in FORMS}
    plain = GPT(_model(), seed=7)
    _load(Path(files["root"]) / "ep2-checkpoint", plain)
    out["ep1 load"] = {k: v.clone() for k, v in plain.state_dict().items()}
    plain = GPT(_model(), seed=7)
    _load(Path(files["root"]) / "dp4-ep2-zero3-accum" / "ckpt", plain)
    out["zero3 plain load"] = {k: v.clone() for k, v in plain.state_dict().items()}
    return out


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layouts_train_like_one_device(runs, one_device, name):
    reference = one_device[LAYOUTS[name][0]]
    assert_trains_like_one_device([out[name][:STEPS] for out in runs], reference, "fp32", factor=FACTOR,
                                  name=name)
    want = reference["fp32", "batch"]
    diff = max(abs(a - b) for out in runs for a, b in zip(out[name][:STEPS], want, strict=False))
    print(f"{name}: losses within {diff:.2e} of one device's, tolerance "
          f"{tolerance(reference, 'fp32', factor=FACTOR):.2e}")


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layouts_hand_the_optimizer_one_devices_gradients(runs, one_device, name):
    """Every rank's boxes of the first step's gradients (experts: its rows of ``[E, ...]``) against one
    device's; negative control: x 2 fails."""
    reference = one_device[LAYOUTS[name][0]]
    per_rank = [out[name, "grads"] for out in runs]
    worst = assert_gradients_like_one_device(per_rank, reference, "fp32", factor=FACTOR, name=name,
                                             control=2.0)
    # rows of [E, ...], never all E (under pp a rank holds its stage's blocks' experts only); DeepSeek: two
    # MoE blocks after the dense one, three SwiGLU tensors each
    experts = {n for pieces in per_rank for n in pieces if EXPERT in n}
    assert len(experts) == (6 if name.endswith("deepseek") else 4)
    assert all(pieces[n][2].shape[0] < 4 for pieces in per_rank for n in experts if n in pieces)
    if name == "dp4-ep2-zero3-accum":  # E/ep = 2 rows per ep rank, sharded over edp 2: one row each
        assert all(pieces[n][2].shape[0] == 1 for pieces in per_rank for n in experts), name
    print(f"{name}: worst gradient difference {worst:.3f} x its tolerance")


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_expert_gradients_averaged_over_dp_x_cp_fail(runs, one_device):
    """The negative control: the experts' gradients reduced over dp x cp (their placement says so) are off
    one device's by far more than the tolerance, the dense ones still equal."""
    per_rank = [out["control", "grads"] for out in runs]
    ratios = gradient_ratios(per_rank, one_device["aux"], "fp32", factor=FACTOR)
    experts = {n: r for n, r in ratios.items() if EXPERT in n}
    assert len(experts) == 4 and min(experts.values()) > 100, experts
    assert max(r for n, r in ratios.items() if EXPERT not in n) <= 1
    print(f"dp x cp instead of edp: the expert gradients {min(experts.values()):.0f} to "
          f"{max(experts.values()):.0f} x their tolerance off")


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_zero3_expert_gradients_averaged_over_edp_fail(runs, one_device):
    """The ZeRO-3 negative control: the expert units' gradients a mean over edp (not the sum divided by
    dp x cp) are ep times too large, far outside the tolerance; the dense ones still equal."""
    per_rank = [out["control-zero3", "grads"] for out in runs]
    ratios = gradient_ratios(per_rank, one_device["aux"], "fp32", factor=FACTOR)
    experts = {n: r for n, r in ratios.items() if EXPERT in n}
    assert len(experts) == 4 and min(experts.values()) > 100, experts
    assert max(r for n, r in ratios.items() if EXPERT not in n) <= 1
    print(f"ZeRO-3, a mean over edp: the expert gradients {min(experts.values()):.0f} x their tolerance off")


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_a_first_stage_balance_loss_left_out_of_backward_fails(runs, one_device):
    """The pipeline's negative control: without stage 0's balance loss in its backward, stage 0's router
    (and everything below it) is off one device's by far more than the tolerance; stage 1 is unchanged."""
    per_rank = [out["control-pp", "grads"] for out in runs]
    ratios = gradient_ratios(per_rank, one_device["aux"], "fp32", factor=FACTOR)
    assert ratios["layers.0.mlp.moe.router.gate.weight"] > 100, ratios
    assert max(r for n, r in ratios.items() if n.startswith("layers.1.")) <= 1, ratios
    print(f"stage 0's balance loss left out: its router's gradient "
          f"{ratios['layers.0.mlp.moe.router.gate.weight']:.0f} x its tolerance off")


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize(("control", "what"), [
    ("control-cp", "counts not summed over cp"),  # each cp rank's f from its own part of the sequence
    ("control-sp", "balance loss per tp rank, whole"),  # each tp rank's s/t tokens, neither summed nor 1/t
])
def test_balance_loss_not_spread_over_the_sequences_ranks_fails(runs, one_device, control, what):
    """The context- and sequence-parallel negative controls: a rank's balance loss from its own part of
    each sequence alone puts the routers' gradients off one device's by far more than the tolerance."""
    per_rank = [out[control, "grads"] for out in runs]
    ratios = gradient_ratios(per_rank, one_device["aux"], "fp32", factor=FACTOR)
    routers = {n: r for n, r in ratios.items() if "router" in n}
    assert len(routers) == 2 and min(routers.values()) > 100, routers
    print(f"{what}: the routers' gradients {min(routers.values()):.0f} to {max(routers.values()):.0f} x "
          "their tolerance off")


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("layout", list(NORM_LAYOUTS))
def test_the_trainers_norm_counts_every_expert_and_dense_element_once(runs, layout):
    """Within float32 rounding (tests/ranks/test_param_placements.py's 1e-5 relative); the control (every
    replica counted: the dense tensors ep or ep x tp times) is off by far more."""
    for rank, out in enumerate(runs):
        got, want = out["norms"][layout], out["norms"]["global"]
        assert abs(got - want) <= 1e-5 * want, (rank, layout, got, want)
        if (layout, "replicas counted") in out["norms"]:
            assert out["norms"][layout, "replicas counted"] > want * 1.1, (rank, layout)
    norms = runs[0]["norms"]
    print(f"{layout}: norm {norms[layout]:.6f} vs {norms['global']:.6f}"
          + (f", replicas counted {norms[layout, 'replicas counted']:.3f}" if not NORM_LAYOUTS[layout][1]
             else ""))


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", [SAVED, *PIPELINED, "cp2-dp2-ep4", "tp2-sp-dp2-ep2-zero1"])
def test_metrics_record_the_balance_loss_the_load_and_the_traffic(runs, one_device, name):
    """Under pp every rank reports every stage's blocks: the balance loss summed over the stages (each
    stage's in its own backward), the load's mean and most over all blocks; under cp the ranks' halves of
    each sequence: the same figures as one device."""
    reference = one_device[LAYOUTS[name][0]]
    want = reference["records", "fp32", "batch"]
    tol = tolerance(reference, "fp32", factor=FACTOR)
    mean = 4 * 16 * 2 / 4  # k T / E over the global batch's T tokens
    for out in runs:
        for got, ref in zip(out[name, "records"], want, strict=False):
            assert abs(got["moe_aux_loss"] - ref["moe_aux_loss"]) <= tol
            assert got["moe_tokens_per_expert_mean"] == mean <= got["moe_tokens_per_expert_max"]
            assert got["moe_tokens_per_expert_max"] == ref["moe_tokens_per_expert_max"]
            assert got["moe_dropped_fraction"] == 0.0
            assert got["lm_loss"] == pytest.approx(got["loss"] - got["moe_aux_loss"])
            assert got["bytes_sent"]["ep"] > 0
            # dp 4 / ep 2: two replicas of each expert sum their gradients; dp 2 (x cp 2) / ep 2 (4): one
            axis = "edp" if name == SAVED else name[:2]
            assert got["bytes_sent"].get(axis, 0) > 0, (axis, got["bytes_sent"])


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_a_zero3_ep2_checkpoint_loads_bitwise_into_the_plain_gpt_and_at_pp2(runs, one_device):
    """Saved at ``--dp 4 --ep 2 --zero-stage 3`` (an expert's rows: edp row shards inside its ep box),
    loaded into the plain GPT and into a ``--pp 2 --dp 2 --ep 2 --zero-stage 3`` run: every rank's boxes
    there are the plain GPT's elements, bit for bit, and together they cover the model."""
    plain = one_device["zero3 plain load"]
    fresh = GPT(_model(), seed=0).state_dict()
    assert not all(torch.equal(v, fresh[k]) for k, v in plain.items())  # it did load trained weights
    seen = set()
    for out in runs:
        for name, (offsets, shape, value) in out["zero3 at pp2 load"].items():
            assert tuple(shape) == tuple(plain[name].shape), name
            box = tuple(slice(o, o + n) for o, n in zip(offsets, value.shape, strict=True))
            assert np.array_equal(value, plain[name][box].numpy()), name
            seen.add(name)
    assert {n for n in seen if EXPERT in n} and seen == {k for k in plain if k != "output_layer.weight"}


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_an_ep2_checkpoint_loads_bitwise_at_ep1_and_ep4_and_resumes_there(runs, one_device):
    plain = one_device["ep1 load"]
    for out in runs:  # every rank's ep 4 boxes are the plain GPT's elements, bit for bit
        pieces = out["ep4 load"]
        assert {n for n in pieces if EXPERT in n} and sorted(pieces) == sorted(
            k for k in plain if k != "output_layer.weight")
        for name, (offsets, shape, value) in pieces.items():
            assert tuple(shape) == tuple(plain[name].shape)
            box = tuple(slice(o, o + n) for o, n in zip(offsets, value.shape, strict=True))
            assert np.array_equal(value, plain[name][box].numpy()), name
    fresh = GPT(_model(), seed=0).state_dict()
    assert not all(torch.equal(v, fresh[k]) for k, v in plain.items())  # it did load trained weights
    tol = tolerance(one_device["aux"], "fp32", factor=FACTOR)
    one = np.array(one_device["aux"]["fp32", "batch"][STEPS:])
    for ep in (4, 1):
        resumed, ep2 = runs[0][f"resumed at ep{ep}"], runs[0][SAVED]
        assert len(resumed) == 2  # a fresh --out: the two steps after the resume
        assert float(np.abs(np.array(resumed) - np.array(ep2[STEPS:])).max()) <= tol, (ep, resumed, ep2)
        assert float(np.abs(np.array(resumed) - one).max()) <= tol, (ep, resumed, one)
