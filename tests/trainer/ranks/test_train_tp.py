"""The trainer with ``--tp`` (chapter 06): it trains the same model as one device, composes with ``--dp``,
ZeRO-1/2, ``--sequence-parallel`` (and ``--tp-comm-overlap``, the collective matmul: the same losses and
bytes as without it), ``--precision`` (fp16 with its loss scaler) and activation checkpointing
(the recomputed forward repeats the collectives), and its checkpoints resume at another TP size.

One spawn of 4 ranks trains each layout (tests/support/trainer_runs.py); the one-device references run in
this process. Tolerance (the numerics rule): the layouts sum the same numbers in other orders, so their
losses are compared within ``FACTOR x spread``, ``spread`` the largest difference between two one-device
runs of the same arithmetic in two summation orders (the whole batch at once vs one sequence per
micro-batch), measured here, per precision. Checkpoints: a tp 2 x dp 2 run's checkpoint loads into the plain
GPT (tp 1) and into a tp 4 model bitwise, and the tp 4 run resumed from it continues the tp 2 losses.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from refimpl.checkpoint import CheckpointConfig, Checkpointer, load_training_state
from refimpl.config import ParallelConfig
from refimpl.launch import run_ranks
from refimpl.models import GPT
from refimpl.parallel.tensor_parallel import apply_tensor_parallel, full_state_dict
from tests.support import timeouts
from tests.support.one_device import tolerance
from tests.support.trainer_runs import Case, layout_tests, run_case, run_layouts, tiny

# the one spawn timeout x 2: 4 ranks train the GPT at each of the module's layouts; it was 420 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4
SP = {"sequence_parallel": True}
# the layouts at world size 4 (each compared with one device at its precision)
LAYOUTS = {
    "tp2-dp2-zero1": Case(parallel=ParallelConfig(tp=2, zero_stage=1), steps=STEPS + 2,
                          checkpoint_every=STEPS),  # saves at STEPS: resumed at tp 4 below
    "tp2-dp2-zero0-sp-accum": Case(parallel=ParallelConfig(tp=2, **SP), micro_batch_size=1),
    "tp4-sp": Case(parallel=ParallelConfig(tp=4, **SP)),
    # the same run with the collective matmul (refimpl/parallel/tensor_parallel/collective_matmul.py)
    "tp4-sp-overlap": Case(parallel=ParallelConfig(tp=4, tp_comm_overlap=True, **SP)),
    # ZeRO-1 sums the s/t-token gradients' shards over tp before the step (the probe reads those shards)
    "tp2-dp2-zero1-sp": Case(parallel=ParallelConfig(tp=2, zero_stage=1, **SP)),
    "tp2-dp2-zero2-sp-bf16": Case(parallel=ParallelConfig(tp=2, zero_stage=2, precision="bf16", **SP)),
    "tp2-dp2-sp-fp16-actckpt": Case(parallel=ParallelConfig(tp=2, precision="fp16",
                                                            activation_checkpointing="all", **SP)),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("train_tp"), **corpus}  # tests/conftest.py's corpus


def _load(folder: Path, model: torch.nn.Module) -> None:
    checkpointer = Checkpointer(CheckpointConfig(folder=str(folder)))
    load_training_state(checkpointer, checkpointer.find_latest_valid(), model=model, restore_rng=False)


def _worker(ctx, files: dict) -> dict:
    root, base = Path(files["root"]), tiny(files, steps=STEPS)
    out = run_layouts(ctx, base, LAYOUTS, root)
    if ctx.rank == 0:  # the tp 2 x dp 2 checkpoint of step STEPS alone
        shutil.copytree(root / "tp2-dp2-zero1" / "checkpoints", root / "tp2-checkpoint")
        shutil.rmtree(root / "tp2-checkpoint" / f"step_{STEPS + 2:08d}")
        shutil.copytree(root / "tp2-checkpoint", root / "resumed-checkpoints")  # the resumed run saves here
    dist.barrier()
    # that checkpoint loaded into a tp 4 model and gathered ...
    model = apply_tensor_parallel(GPT(base.model, seed=5), tp_group=dist.group.WORLD)
    _load(root / "tp2-checkpoint", model)
    out["tp4 load"] = {k: v.clone() for k, v in full_state_dict(model, dist.group.WORLD).items()}
    # ... and the run resumed from it at tp 4 for 2 more steps
    tp4 = Case(parallel=ParallelConfig(tp=4, zero_stage=1), steps=STEPS + 2, checkpoint_every=STEPS)
    records = run_case(ctx, base, tp4, root / "resumed", checkpoint_dir=root / "resumed-checkpoints")
    out["resumed at tp4"] = [r["loss"] for r in records]
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, 4, files, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def one_device(files, one_device_references) -> dict:
    """One-device runs in this process: per precision the plain run and one in another summation order
    (tests/conftest.py's, shared with test_train_cp and _zero3: the same config), and the tp 2 checkpoint
    at tp 1."""
    out = dict(one_device_references(tiny(files), steps=STEPS + 2))
    plain = GPT(tiny(files).model, seed=7)
    _load(Path(files["root"]) / "tp2-checkpoint", plain)
    out["tp1 load"] = {k: v.clone() for k, v in plain.state_dict().items()}
    return out


def _tolerance(one_device: dict, precision: str) -> float:
    """tests/support/one_device.py's rule. Why 16 bits need ``|16-bit - fp32|``: a 16-bit TP run rounds each
    row layer's partial sum before the all-reduce (measured on these runs: fp16 at tp 2 differs from one
    device by 2.7e-4 to 3.3e-4, about 20x the fp16 order spread of 1.4e-5 and 0.6-0.8x |fp16 - fp32| =
    4.2e-4)."""
    return tolerance(one_device, precision, factor=FACTOR)


# the losses and the first step's gradients (before clipping and AdamW, every rank's boxes) against one
# device's (tests/support/one_device.py); negative control: the gradients x 2 (a sum over two replicas)
(test_tensor_parallel_layouts_train_like_one_device,
 test_tensor_parallel_layouts_hand_the_optimizer_one_devices_gradients) = layout_tests(
    LAYOUTS, factor=FACTOR, timeout_s=2 * SPAWN_TIMEOUT_S)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_metrics_record_the_tp_bytes_of_the_formula_each_step(runs, files):
    """metrics.jsonl's per-step bytes on the tp group equal the planner's count of the TP collectives of
    one micro-batch (tp 4, SP, one micro-batch per step) plus the gradient norm's one-scalar all-reduce;
    the tracer books collectives by the ring model, the formula counts the calls and payloads."""
    from refimpl.planner import tensor_parallel_collectives, wire_bytes

    model = tiny(files).model
    calls = tensor_parallel_collectives(num_layers=model.num_layers, hidden_size=model.hidden_size,
                                        micro_batch=4, seq_len=16, tp=4, sequence_parallel=True)
    norm = wire_bytes("all_reduce", 4, 4)  # the gradient norm's float32 scalar over tp
    want = sum(wire_bytes(op, payload, 4) for op, (_, payload) in calls.items()) + norm
    for rank, out in enumerate(runs):
        steps = [r["bytes_sent"] for r in out["tp4-sp", "records"]]
        assert len(steps) == STEPS and all(s["tp"] == want for s in steps), (rank, steps[0], want)
        assert "dp x cp" not in steps[0]  # one replica: no loss or gradient average
    # negative control: without sequence parallelism the same model sends other bytes
    plain = tensor_parallel_collectives(num_layers=model.num_layers, hidden_size=model.hidden_size,
                                        micro_batch=4, seq_len=16, tp=4)
    assert sum(wire_bytes(op, p, 4) for op, (_, p) in plain.items()) + norm != want


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_a_tp2_checkpoint_loads_bitwise_at_tp1_and_tp4_and_resumes_at_tp4(runs, one_device, files):
    tp1, tp4 = one_device["tp1 load"], runs[0]["tp4 load"]
    assert sorted(tp4) == sorted(k for k in tp1 if k != "output_layer.weight")  # tied: saved once
    for k, v in tp4.items():
        assert torch.equal(v, tp1[k]), k
    fresh = GPT(tiny(files).model, seed=0).state_dict()
    assert not all(torch.equal(v, fresh[k]) for k, v in tp4.items())  # it did load trained weights
    resumed, tp2 = runs[0]["resumed at tp4"], runs[0]["tp2-dp2-zero1"]
    assert len(resumed) == 2  # a fresh --out: the two steps after the resume
    tol = _tolerance(one_device, "fp32")
    assert float(np.abs(np.array(resumed) - np.array(tp2[STEPS:])).max()) <= tol
    assert float(np.abs(np.array(resumed) - np.array(one_device["fp32", "batch"][STEPS:])).max()) <= tol


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_tp_comm_overlap_trains_like_the_same_run_without_it_and_sends_the_same_bytes(runs, one_device):
    """``--tp-comm-overlap`` against the same tp 4 SP run without it: the losses within the tolerance (the
    rings add the row layers' partial sums in ring order, not bitwise), and on the tp group the same bytes
    per step (a ring's ``t - 1`` chunk transfers are the all-gather's and the reduce-scatter's bytes)."""
    tol = _tolerance(one_device, "fp32")
    for out in runs:
        overlap, plain = np.array(out["tp4-sp-overlap"]), np.array(out["tp4-sp"])
        assert len(overlap) == STEPS and float(np.abs(overlap - plain).max()) <= tol, (overlap, plain, tol)
        tp_bytes = {name: [r["bytes_sent"]["tp"] for r in out[name, "records"]]
                    for name in ("tp4-sp-overlap", "tp4-sp")}
        assert tp_bytes["tp4-sp-overlap"] == tp_bytes["tp4-sp"]
