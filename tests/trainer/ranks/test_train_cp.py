"""The trainer with ``--cp`` (chapter 07): it trains the same model as one device with ring attention and
with Ulysses, composes with ``--dp``, ZeRO-1/3, ``--tp --sequence-parallel``, gradient accumulation,
``--precision`` (fp16 with its loss scaler) and activation checkpointing (the recomputed forward repeats the
ring), and a ``cp 2 x dp 2`` checkpoint resumes at ``dp 4`` (the parameters are replicated over cp, so the
checkpoint holds no trace of the sequence split).

One spawn of 4 ranks trains each layout (tests/support/trainer_runs.py); the one-device references run in
this process. Tolerance (the numerics rule, as tests/trainer/ranks/test_train_tp.py): ``FACTOR x spread``,
``spread`` the largest difference between two one-device runs in two summation orders (the whole batch at once
vs one sequence per micro-batch), and in 16 bits at least ``|16-bit - fp32|`` on one device: ring attention
computes its blocks in float32, one device's attention in the 16-bit dtype.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from refimpl.config import ParallelConfig
from refimpl.launch import run_ranks
from tests.support import timeouts
from tests.support.one_device import tolerance
from tests.support.trainer_runs import Case, layout_tests, run_case, run_layouts, tiny

# the one spawn timeout x 2: 4 ranks train the GPT at each of the module's layouts; it was 420 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4
# the layouts at world size 4 (each compared with one device at its precision)
LAYOUTS = {
    "cp2-dp2-zero1-ring": Case(parallel=ParallelConfig(cp=2, zero_stage=1), steps=STEPS + 2,
                               checkpoint_every=STEPS),  # saves at STEPS: resumed at dp 4
    "cp4-ulysses-accum": Case(parallel=ParallelConfig(cp=4, cp_method="ulysses"), micro_batch_size=2),
    "cp2-dp2-zero3-ulysses": Case(parallel=ParallelConfig(cp=2, cp_method="ulysses", zero_stage=3)),
    "cp2-tp2-sp-bf16": Case(parallel=ParallelConfig(cp=2, tp=2, sequence_parallel=True, precision="bf16"),
                            report=True),  # its sample is read below
    "cp2-dp2-fp16-actckpt": Case(parallel=ParallelConfig(cp=2, precision="fp16",
                                                         activation_checkpointing="all")),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("train_cp"), **corpus}  # tests/conftest.py's corpus


def _worker(ctx, files: dict) -> dict:
    root, base = Path(files["root"]), tiny(files, steps=STEPS)
    out = run_layouts(ctx, base, LAYOUTS, root)
    if ctx.rank == 0:  # the cp 2 x dp 2 checkpoint of step STEPS alone, resumed at dp 4 below
        shutil.copytree(root / "cp2-dp2-zero1-ring" / "checkpoints", root / "resumed-checkpoints")
        shutil.rmtree(root / "resumed-checkpoints" / f"step_{STEPS + 2:08d}")
    dist.barrier()
    dp4 = Case(parallel=ParallelConfig(zero_stage=1), steps=STEPS + 2, checkpoint_every=STEPS)
    records = run_case(ctx, base, dp4, root / "resumed", checkpoint_dir=root / "resumed-checkpoints")
    out["resumed at dp4"] = [r["loss"] for r in records]
    out["sample"] = (root / "cp2-tp2-sp-bf16" / "sample.txt").read_text() if ctx.rank == 0 else None
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, 4, files, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def one_device(corpus, one_device_references) -> dict:
    """One-device runs in this process: per precision the plain run and one in another summation order
    (tests/conftest.py's, shared with test_train_tp and _zero3: the same config)."""
    return one_device_references(tiny(corpus), steps=STEPS + 2)


# the losses and the first step's gradients (before clipping and AdamW, every rank's boxes) against one
# device's (tests/support/one_device.py); negative control: the gradients x 2 (a sum over two replicas)
(test_context_parallel_layouts_train_like_one_device,
 test_context_parallel_layouts_hand_the_optimizer_one_devices_gradients) = layout_tests(
    LAYOUTS, factor=FACTOR, timeout_s=2 * SPAWN_TIMEOUT_S)


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_a_cp2_checkpoint_resumes_at_dp4_and_continues_the_losses(runs, one_device):
    resumed, cp2 = runs[0]["resumed at dp4"], runs[0]["cp2-dp2-zero1-ring"]
    assert len(resumed) == 2  # a fresh out folder: the two steps after the resume
    tol = tolerance(one_device, "fp32", factor=FACTOR)
    assert float(np.abs(np.array(resumed) - np.array(cp2[STEPS:])).max()) <= tol
    assert float(np.abs(np.array(resumed) - np.array(one_device["fp32", "batch"][STEPS:])).max()) <= tol


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_rank_zero_samples_from_a_plain_copy_of_the_context_parallel_model(runs):
    sample = runs[0]["sample"]
    assert sample.startswith("def ") and len(sample) > len("def ")
