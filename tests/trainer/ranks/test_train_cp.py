"""The trainer with ``--cp`` (chapter 07): it trains the same model as one device with ring attention and
with Ulysses, composes with ``--dp``, ZeRO-1/3, ``--tp --sequence-parallel``, gradient accumulation,
``--precision`` (fp16 with its loss scaler) and activation checkpointing (the recomputed forward repeats the
ring), and a ``cp 2 x dp 2`` checkpoint resumes at ``dp 4`` (the parameters are replicated over cp, so the
checkpoint holds no trace of the sequence split).

One spawn of 4 ranks runs each layout through ``refimpl.train.train``; the one-device references run in
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

from refimpl.launch import run_ranks
from refimpl.train import build_parser, config_from_args, options_from_args, train
from tests.support import timeouts
from tests.support.one_device import (
    assert_gradients_like_one_device,
    assert_trains_like_one_device,
    first_step_gradients,
    tolerance,
)

# the one spawn timeout x 2: 4 ranks train the GPT at each of the module's layouts; it was 420 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "100",
        "--checkpoint-every", "0", "--no-report"]
# name -> (flags at world size 4, the one-device precision it is compared with)
LAYOUTS = {
    "cp2-dp2-zero1-ring": (["--cp", "2", "--zero-stage", "1", "--steps", str(STEPS + 2),
                            "--checkpoint-every", str(STEPS)], "fp32"),  # saves at STEPS: resumed at dp 4
    "cp4-ulysses-accum": (["--cp", "4", "--cp-method", "ulysses", "--micro-batch-size", "2"], "fp32"),
    "cp2-dp2-zero3-ulysses": (["--cp", "2", "--cp-method", "ulysses", "--zero-stage", "3"], "fp32"),
    "cp2-tp2-sp-bf16": (["--cp", "2", "--tp", "2", "--sequence-parallel", "--precision", "bf16", "--report"],
                        "bf16"),  # its sample is read below
    "cp2-dp2-fp16-actckpt": (["--cp", "2", "--precision", "fp16", "--activation-checkpointing"], "fp16"),
}


def _args(files: dict, out: Path, *extra: str):
    return build_parser().parse_args([*TINY, "--steps", str(STEPS), "--data", str(files["corpus"]),
                                      "--cache-dir", str(files["cache"]), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("train_cp"), **corpus}  # tests/conftest.py's corpus


def _worker(ctx, files: dict) -> dict:
    root = Path(files["root"])
    out = {}
    for name, (flags, _) in LAYOUTS.items():
        args = _args(files, root / name, *flags, "--checkpoint-dir", str(root / name / "ckpt"))
        grads: dict = {}
        out[name] = [r["loss"] for r in train(config_from_args(args), ctx, options_from_args(args),
                                              gradient_probe=first_step_gradients(grads))]
        out[name, "grads"] = grads
    if ctx.rank == 0:  # the cp 2 x dp 2 checkpoint of step STEPS alone, resumed at dp 4 below
        shutil.copytree(root / "cp2-dp2-zero1-ring" / "ckpt", root / "resumed-checkpoints")
        shutil.rmtree(root / "resumed-checkpoints" / f"step_{STEPS + 2:08d}")
    dist.barrier()
    args = _args(files, root / "resumed", "--zero-stage", "1", "--steps", str(STEPS + 2),
                 "--checkpoint-every", str(STEPS), "--checkpoint-dir", str(root / "resumed-checkpoints"))
    out["resumed at dp4"] = [r["loss"] for r in train(config_from_args(args), ctx, options_from_args(args))]
    out["sample"] = (root / "cp2-tp2-sp-bf16" / "sample.txt").read_text() if ctx.rank == 0 else None
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, 4, files, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def one_device(one_device_references) -> dict:
    """One-device runs in this process: per precision the plain run and one in another summation order
    (tests/conftest.py's, shared with test_train_tp: the same flags)."""
    return one_device_references([*TINY, "--steps", str(STEPS)], steps=STEPS + 2)


def _tolerance(one_device: dict, precision: str) -> float:
    return tolerance(one_device, precision, factor=FACTOR)


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layouts_train_like_one_device(runs, one_device, name):
    assert_trains_like_one_device([out[name] for out in runs], one_device, LAYOUTS[name][1], factor=FACTOR,
                                  name=name)


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layouts_hand_the_optimizer_one_devices_gradients(runs, one_device, name):
    """The first step's gradients before clipping and AdamW, every rank's boxes against one device's
    (tests/support/one_device.py); negative control: the same gradients x 2 (a sum over two replicas, not the
    mean) fail."""
    worst = assert_gradients_like_one_device([out[name, "grads"] for out in runs], one_device,
                                             LAYOUTS[name][1], factor=FACTOR, name=name, control=2.0)
    print(f"{name}: worst gradient difference {worst:.3f} x its tolerance")


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_a_cp2_checkpoint_resumes_at_dp4_and_continues_the_losses(runs, one_device):
    resumed, cp2 = runs[0]["resumed at dp4"], runs[0]["cp2-dp2-zero1-ring"]
    assert len(resumed) == 2  # a fresh --out: the two steps after the resume
    tol = _tolerance(one_device, "fp32")
    assert float(np.abs(np.array(resumed) - np.array(cp2[STEPS:])).max()) <= tol
    assert float(np.abs(np.array(resumed) - np.array(one_device["fp32", "batch"][STEPS:])).max()) <= tol


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_rank_zero_samples_from_a_plain_copy_of_the_context_parallel_model(runs):
    sample = runs[0]["sample"]
    assert sample.startswith("def ") and len(sample) > len("def ")
