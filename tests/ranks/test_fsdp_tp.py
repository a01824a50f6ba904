"""2-D sharding against PyTorch's own (chapters 04 and 06): our ZeRO-3 over
tensor-parallel shards at dp 2 x tp 2 and ``fully_shard`` over DTensor TP (``parallelize_module`` on the
mesh's tp dimension, ``fully_shard`` on its dp dimension) train the same GPT from the same seed on the same
batches in the same 4 processes (bench/bench_fsdp_tp.py's ``proof_worker``: one code path for the proof and
the benchmark).

Tolerance (the numerics rule): both sum the same per-token gradients in other orders than one device (the
vocab-parallel loss, the dp reduce-scatter), so each is compared with one device trained on the whole batch
within ``FACTOR x spread``, ``spread`` the distance one device moves when only its summation order changes
(the batch in 2 and in 4 micro-batches), measured in the same run; and ours with PyTorch's within the same.
Negative control: one device's parameters after the first step only (one AdamW step missing) lie far
outside it. The ZeRO collectives of a step (all-gathers and reduce-scatters over dp) have the counts and
payloads of ``refimpl.planner.zero_collectives`` of the rank's TP-local shapes, to the byte; the state
a rank holds at rest is no larger than PyTorch's.
"""

from __future__ import annotations

import pytest

from bench.bench_fsdp_tp import FACTOR, proof_worker
from refimpl.launch import run_ranks
from refimpl.planner import zero_collectives
from tests.support.timeouts import SPAWN_TIMEOUT_S

STEPS, MICRO_BATCH, SEQ = 3, 4, 16


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(proof_worker, 4, STEPS, MICRO_BATCH, SEQ, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_zero3_over_tp_trains_like_fully_shard_over_dtensor_tp_and_one_device(ranks):
    for rank, r in enumerate(ranks):
        tol = FACTOR * r["spread"]
        assert 0 < r["spread"] < 1e-3, r  # a yardstick, and a small one
        assert r["ours_vs_one"] <= tol, (rank, r)
        assert r["torch_vs_one"] <= tol, (rank, r)
        assert r["ours_vs_torch"] <= tol, (rank, r)
        assert r["one_step_short"] > 100 * tol, (rank, r)  # the negative control


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_the_first_steps_gradients_before_adamw_are_one_devices(ranks):
    """AdamW and clipping would hide a gradient off by a constant factor: the reduced gradients of the first
    step, assembled whole before the optimizer, against one device's, each tensor relative to its largest
    element, within FACTOR x the same measure between one device's whole batch and its 2 micro-batches.
    Negative control: ours x 2 (a sum over the dp replicas, not the mean) fails."""
    for rank, r in enumerate(ranks):
        tol = FACTOR * r["grad_spread"]
        assert 0 < r["grad_spread"] < 1e-4, r
        assert r["grads_ours_vs_one"] <= tol and r["grads_torch_vs_one"] <= tol, (rank, r)
        assert r["grads_x2_vs_one"] > 1000 * tol, (rank, r)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_the_zero_collectives_over_dp_equal_the_formula_of_the_tp_local_shapes(ranks):
    for rank, r in enumerate(ranks):
        want = zero_collectives(r["tp_shapes"], 2, 3)
        got = {op: r["ops"][op] for op in ("all_gather", "reduce_scatter")}
        assert got == {op: want[op] for op in ("all_gather", "reduce_scatter")}, (rank, got, want)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_our_state_at_rest_is_no_larger_than_fully_shards(ranks):
    """Parameter shards, gradient shards (freed by zero_grad: none) and AdamW state each rank holds after a
    step: ours no more than PyTorch's 2-D DTensors hold (both shard dim 0 of the TP-local tensors)."""
    for rank, r in enumerate(ranks):
        assert 0 < r["state_bytes"]["ours"] <= r["state_bytes"]["torch"], (rank, r["state_bytes"])
