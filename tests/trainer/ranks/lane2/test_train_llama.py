"""The trainer's Llama form (``--arch llama``: RMSNorm, RoPE, SwiGLU, no biases, untied; chapter 01) trains
the same model as one device at the layout families (chapters 04-08), with grouped-query attention.

One spawn of 4 ranks: ``--num-kv-heads 2`` (GQA: 4 query heads in 2 groups) at tp 2 x dp 2 with sequence
parallelism on RMSNorm and ZeRO-1 (each tensor-parallel rank holds one whole query group), at tp 4 with
sequence parallelism (two ranks share each key/value head), MQA at tp 2 x dp 2 with ZeRO-2 and at tp 4 (the
ranks share the one key/value head), HSDP (ZeRO-3 over 2 ranks, 2 replicas), pp 2 x dp 2 under each schedule
(1F1B, zbh1, GPipe, and interleaved 1F1B at 2 chunks of a 4-block model), dp 4 in fp8 (against one device in
fp8, by the same rule), at dp 4 with ZeRO-3 and activation checkpointing, and at cp 2 x dp 2 with Ulysses (the
key/value heads all-to-all'd at their own count); ``--num-kv-heads 1`` (MQA) at cp 2 x dp 2 with ring
attention (zig-zag: the one key/value head travels the ring, and RoPE must take each chunk's global
positions). Each against one device in fp32, losses and the first step's gradients before the optimizer
(tests/support/one_device.py's rule: ``FACTOR x`` the spread of two one-device summation orders; negative
controls: the gradients x 2 fail, and the cp run whose RoPE rotates by each rank's local positions fails the
losses). The layouts the Llama form cannot take yet are refused by the trainer's shape rules, by name. An MoE
block of SwiGLU experts at dp 4 with expert parallelism 2 trains like one device too. The tp 2 run's
checkpoint resumes at pp 2 and continues one device's losses; the cp group's bytes are the planner's formula
at the key/value heads."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist

from refimpl.config import LLAMA, ModelConfig, ParallelConfig, TrainConfig
from refimpl.launch import run_ranks
from refimpl.models import GPT
from refimpl.parallel.declarations import ContextParallelModules
from refimpl.planner import context_parallel_bytes
from refimpl.support import shape_refusals
from tests.support import timeouts
from tests.support.one_device import (
    assert_gradients_like_one_device,
    assert_trains_like_one_device,
    first_step_gradients,
    one_device_losses,
    tolerance,
)
from tests.support.trainer_runs import Case, run_case, tiny

# the one spawn timeout x 2: 4 ranks train the Llama form at each layout; it was 300 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4
MODELS = {"gqa": {"num_key_value_heads": 2}, "mqa": {"num_key_value_heads": 1},
          "moe": {"num_key_value_heads": 2, "num_experts": 4, "moe_every": 2, "moe_activation": "swiglu"},
          # interleaved: 2 chunks of 1 block per pp rank (at width 32 its two summation orders agree bitwise)
          "gqa-4": {"num_key_value_heads": 2, "num_layers": 4, "hidden_size": 48}}


def _pp(**options) -> ParallelConfig:
    """pp 2 (x dp 2) with two micro-batches, and ``options``."""
    return ParallelConfig(pp=2, microbatches=2, **options)


LAYOUTS = {  # name -> (model, the layout at world size 4)
    "tp2-dp2-sp-zero1": ("gqa", Case(parallel=ParallelConfig(tp=2, sequence_parallel=True, zero_stage=1),
                                     checkpoint_every=STEPS // 2)),  # resumed at pp 2 x dp 2 below
    "dp4-zero3-actckpt": ("gqa", Case(parallel=ParallelConfig(zero_stage=3, activation_checkpointing="all"))),
    "hsdp2x2-zero3": ("gqa", Case(parallel=ParallelConfig(zero_stage=3, dp_replicate=2))),  # 2 shards x 2
    "pp2-dp2-1f1b": ("gqa", Case(parallel=_pp())),
    "pp2-dp2-zbh1": ("gqa", Case(parallel=_pp(pp_schedule="zbh1"))),
    "pp2-dp2-gpipe": ("gqa", Case(parallel=_pp(pp_schedule="gpipe"))),
    "pp2-dp2-interleaved": ("gqa-4", Case(parallel=_pp(pp_schedule="interleaved", virtual_stages=2))),
    # ZB-V: stages 0 and 3 on pp rank 0 (the loss there), 1 and 2 on pp rank 1 (a local turn), B and W split
    "pp2-dp2-zbv": ("gqa-4", Case(parallel=_pp(pp_schedule="zbv", virtual_stages=2))),
    "dp4-fp8": ("gqa", Case(parallel=ParallelConfig(precision="fp8"))),  # the linears' GEMMs in fp8 (ch. 10)
    "tp2-dp2-mqa-zero2": ("mqa", Case(parallel=ParallelConfig(tp=2, zero_stage=2))),  # 2 ranks share k/v
    "tp4-gqa-sp": ("gqa", Case(parallel=ParallelConfig(tp=4, sequence_parallel=True))),  # 2 per k/v head
    "tp4-mqa": ("mqa", Case(parallel=ParallelConfig(tp=4))),  # all 4 ranks share the one k/v head
    "cp2-dp2-ring": ("mqa", Case(parallel=ParallelConfig(cp=2))),
    "cp2-dp2-ulysses": ("gqa", Case(parallel=ParallelConfig(cp=2, cp_method="ulysses"))),
    "dp4-ep2-moe": ("moe", Case(parallel=ParallelConfig(ep=2))),  # block 0 an MoE of SwiGLU experts, 2 a rank
}


PRECISION = {"dp4-fp8": "fp8"}  # the layouts not in fp32, against one device in their precision


def _base(files: dict, model: str) -> TrainConfig:
    """The Llama form, 2 blocks of width 32 (or ``MODELS[model]``'s), 8 sequences a step, STEPS steps."""
    return tiny(files, **{"num_layers": 2, "batch_size": 8, "steps": STEPS, **LLAMA, **MODELS[model]})


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("train_llama"), **corpus}  # tests/conftest.py's corpus


def _local_positions(model: GPT) -> ContextParallelModules:
    """The negative control's declaration: no position module, so RoPE rotates each cp rank's tokens by
    their local positions ``[0, s/cp)`` instead of their chunks' global ones."""
    return dataclasses.replace(DECLARED(model), positions=[])


DECLARED = GPT.context_parallel_modules


def _worker(ctx, files: dict) -> dict:
    out = {}
    root = Path(files["root"])
    for name, (model, case) in {**LAYOUTS, "cp2-local-positions": LAYOUTS["cp2-dp2-ring"]}.items():
        grads: dict = {}
        with mock.patch.object(GPT, "context_parallel_modules",
                               _local_positions if name == "cp2-local-positions" else DECLARED):
            records = run_case(ctx, _base(files, model), case, root / name,
                               checkpoint_dir=root / name / "ckpt", probe=first_step_gradients(grads))
        out[name], out[name, "grads"] = [r["loss"] for r in records], grads
        out[name, "bytes"] = [r["bytes_sent"] for r in records]
    if ctx.rank == 0:  # the tp 2 run's checkpoint of step STEPS / 2 alone, for a run at another layout
        shutil.copytree(root / "tp2-dp2-sp-zero1" / "ckpt", root / "resumed" / "ckpt")
        for later in (root / "resumed" / "ckpt").glob("step_*"):
            if int(later.name.removeprefix("step_")) > STEPS // 2:
                shutil.rmtree(later)
    dist.barrier()
    resumed = dataclasses.replace(LAYOUTS["pp2-dp2-1f1b"][1], checkpoint_every=STEPS // 2)
    records = run_case(ctx, _base(files, "gqa"), resumed, root / "resumed",
                       checkpoint_dir=root / "resumed" / "ckpt")
    out["resumed at pp2"] = [r["loss"] for r in records]
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, 4, files, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def one_device(files) -> dict:
    """fp32 one-device runs of each model in this process, in two summation orders."""
    def references(model: str) -> dict:
        precisions = sorted({"fp32", *(PRECISION.get(name, "fp32") for name, (m, _) in LAYOUTS.items()
                                       if m == model)})
        return one_device_losses(_base(files, model), Path(files["root"]) / f"one-{model}", steps=STEPS,
                                 parallel=ParallelConfig(), precisions=precisions)
    return {model: references(model) for model in MODELS}


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_llama_form_trains_like_one_device(runs, one_device, name):
    reference, precision = one_device[LAYOUTS[name][0]], PRECISION.get(name, "fp32")
    assert_trains_like_one_device([out[name] for out in runs], reference, precision, factor=FACTOR, name=name)
    worst = assert_gradients_like_one_device([out[name, "grads"] for out in runs], reference, precision,
                                             factor=FACTOR, name=name, control=2.0)
    print(f"{name}: worst gradient difference {worst:.3f} x its tolerance")


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_rope_with_each_ranks_local_positions_fails(runs, one_device):
    """Negative control: zig-zag chunks rotated by their local positions train another model: its losses
    leave one device's by more than 10x the tolerance within the steps."""
    with pytest.raises(AssertionError, match="cp2-local-positions rank 0"):
        assert_trains_like_one_device([out["cp2-local-positions"] for out in runs], one_device["mqa"], "fp32",
                                      factor=FACTOR, name="cp2-local-positions")
    want, tol = one_device["mqa"]["fp32", "batch"], tolerance(one_device["mqa"], "fp32", factor=FACTOR)
    off = max(abs(a - b) for a, b in zip(runs[0]["cp2-local-positions"], want, strict=True))
    print(f"local positions: losses off by {off:.2e}, {off / tol:.0f} x the tolerance")
    assert off > 10 * tol, off


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", ["cp2-dp2-ring", "cp2-dp2-ulysses"])
def test_the_cp_bytes_are_the_formula_at_the_key_value_heads(runs, name):
    """metrics.jsonl's bytes on the cp group per step equal ``num_layers x`` the planner's
    ``context_parallel_bytes`` (forward + backward) of the model, its K/V at their own head count; the
    same formula at the query heads (K/V repeated, picotron's ring) is not what the ranks sent."""
    config = _base({"corpus": Path("unused"), "cache": Path("unused")}, LAYOUTS[name][0]).model
    method = "ulysses" if "ulysses" in name else "ring"
    micro = 8 // 2  # the global batch over dp 2, one micro-batch

    def planned(c: ModelConfig) -> int:
        per_layer = context_parallel_bytes(c, micro_batch=micro, seq_len=16, cp=2, method=method)
        return c.num_layers * (per_layer["forward"] + per_layer["backward"])

    repeated = planned(dataclasses.replace(config, num_key_value_heads=config.num_attention_heads))
    for rank, out in enumerate(runs):
        steps = out[name, "bytes"]
        assert all(s["cp"] == planned(config) for s in steps), (rank, steps[0], planned(config))
        assert steps[0]["cp"] < repeated, (steps[0]["cp"], repeated)


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_a_tp_checkpoint_resumes_at_pp2_and_continues_one_devices_losses(runs, one_device):
    """The tp 2 x dp 2 run's checkpoint of step STEPS / 2 (GQA's qkv rows and SwiGLU's interleaved rows in
    their boxes) resumed at pp 2 x dp 2: its steps STEPS / 2 .. STEPS - 1 are one device's, within the
    tolerance."""
    want = one_device["gqa"]["fp32", "batch"][STEPS // 2:]
    tol = tolerance(one_device["gqa"], "fp32", factor=FACTOR)
    for rank, out in enumerate(runs):
        got = out["resumed at pp2"]
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) <= tol, \
            (rank, got, want)


def test_the_layouts_not_built_for_gqa_are_refused_by_name():
    gqa = ModelConfig(**LLAMA, num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    assert shape_refusals(gqa, ParallelConfig(tp=2), seq_len=16) == []
    assert shape_refusals(gqa, ParallelConfig(tp=4), seq_len=16) == []  # 2 ranks share each k/v head
    three = ModelConfig(**LLAMA, num_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    (tp2,) = shape_refusals(three, ParallelConfig(tp=2), seq_len=16)
    assert "--tp 2 and the 3 key/value heads (--num-kv-heads): one must divide the other" in tp2
    assert shape_refusals(gqa, ParallelConfig(cp=2, cp_method="ulysses"), seq_len=16) == []
    # one key/value head per tensor-parallel rank: Ulysses cannot split it over cp
    (ulysses,) = shape_refusals(gqa, ParallelConfig(cp=2, tp=2, cp_method="ulysses"), seq_len=16)
    assert "whole key/value heads too" in ulysses and "(2 / --tp 2: 1)" in ulysses
    mqa = dataclasses.replace(gqa, num_key_value_heads=1)
    (ulysses,) = shape_refusals(mqa, ParallelConfig(cp=2, cp_method="ulysses"), seq_len=16)
    assert "(1 / --tp 1: 1)" in ulysses
