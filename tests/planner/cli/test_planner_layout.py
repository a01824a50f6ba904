"""Planner functions take a layout (refimpl.planner.layout): ParallelDims(dp=4) gives the figures the planner
gave for world_size=4 before it took a layout, any object with dp/cp/tp/pp works, tensor- and
context-parallel degrees are planned (chapters 06 and 07; measured against the TP and CP models in
tests/planner/ranks/test_planner_tp.py and tests/planner/ranks/test_planner_cp.py), a pipeline degree is
planned with data, tensor and context parallelism and ZeRO 0-2 (chapters 08 and 10; measured in
tests/planner/ranks/test_planner_pp.py) and refused with ZeRO-3."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from refimpl.config import ModelConfig
from refimpl.distributed import ParallelDims
from refimpl.planner import (
    context_parallel_degree,
    data_parallel_degree,
    pipeline_parallel_degree,
    run_memory_per_rank,
    state_memory,
    state_memory_per_rank,
    tensor_parallel_degree,
    zero_shard_degree,
)

CONFIG = ModelConfig()  # the default model: 4 layers, hidden 128, tied embeddings

# Recorded at commit 1a4db69 (before the planner took a layout) from the code, not from the formula:
#   run_memory_per_rank(ModelConfig(), micro_batch=2, seq_len=128, world_size=4, zero_stage=z,
#                       precision=p, checkpointed_blocks=(1,))
RECORDED_TOTAL = {
    (0, "fp32"): 23088340, (0, "bf16"): 20860116,
    (1, "fp32"): 18033364, (1, "bf16"): 15805140,
    (2, "fp32"): 15505876, (2, "bf16"): 13277652,
    (3, "fp32"): 13969108, (3, "bf16"): 11740884,
}
RECORDED_STATE = {  # (weights, grads, AdamW state) of the same calls; zero_memory(param_shapes, 4, z) alike
    0: (3369984, 3369984, 6740176),
    1: (3369984, 3369984, 1685200),
    2: (3369984, 842496, 1685200),
    3: (842496, 842496, 1685200),
}
RECORDED_ZERO3_GATHERED = 990720
RECORDED_ACTIVATIONS_FP32 = {
    "block activations": 6447104, "recomputed block (backward)": 2105344,
    "final layernorm + output layer inputs": 264192, "log-softmax (fp32)": 262144,
    "token ids, labels, positions": 5124, "logits + their gradient (transient)": 524288,
}


def _run(dims, zero_stage: int, precision: str):
    return run_memory_per_rank(CONFIG, dims, micro_batch=2, seq_len=128, zero_stage=zero_stage,
                               precision=precision, checkpointed_blocks=(1,))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_dp4_layout_gives_the_recorded_world_size_4_figures(zero_stage, precision):
    plan = _run(ParallelDims(dp=4), zero_stage, precision)
    assert plan.total == RECORDED_TOTAL[zero_stage, precision]
    held = (plan.state["weights"], plan.state["grads"], plan.state["AdamW state"])
    assert held == RECORDED_STATE[zero_stage]
    if zero_stage == 3:
        assert plan.state["ZeRO-3 gathered units"] == RECORDED_ZERO3_GATHERED
    if precision == "fp32":
        assert plan.activations == RECORDED_ACTIVATIONS_FP32
    state = state_memory_per_rank(CONFIG, ParallelDims(dp=4), zero_stage=zero_stage)
    assert (state.weights, state.grads, state.optimizer) == RECORDED_STATE[zero_stage]
    # Negative control: another data-parallel degree is another figure once anything is sharded.
    if zero_stage > 0:
        assert _run(ParallelDims(dp=2), zero_stage, precision).total != plan.total


def test_stage_0_per_rank_is_the_replica_and_any_degree_object_is_a_layout():
    assert state_memory_per_rank(CONFIG, ParallelDims(dp=4)) == state_memory(CONFIG)
    duck = SimpleNamespace(dp=4, cp=1, tp=1, pp=1)  # not a ParallelDims: only the degrees matter
    assert _run(duck, 2, "bf16") == _run(ParallelDims(dp=4), 2, "bf16")
    assert data_parallel_degree(duck) == 4


def test_a_pipeline_degree_is_planned_with_data_parallelism():
    """dp 2 x pp 2: each rank holds its stages' state (less than the replica) and the figures are the worst
    pipeline rank's; ZeRO-1 shards the optimizer state over dp (less than ZeRO-0), ZeRO-2 the gradients too,
    ZeRO-3 the weights too (the figures are measured in tests/planner/ranks/test_planner_pp.py)."""
    dims = ParallelDims(dp=2, pp=2)
    assert (data_parallel_degree(dims), pipeline_parallel_degree(dims), zero_shard_degree(dims)) == (2, 2, 2)
    plan = _run(dims, 0, "fp32")
    assert plan.rank in (0, 1) and plan.describe().startswith(f"pipeline rank {plan.rank}: ")
    states = [state_memory_per_rank(CONFIG, dims, pp_rank=r) for r in (0, 1)]
    assert all(st.total < state_memory(CONFIG).total for st in states)
    assert (plan.state["weights"], plan.state["grads"], plan.state["AdamW state"]) in [
        (st.weights, st.grads, st.optimizer) for st in states]
    zero1 = [state_memory_per_rank(CONFIG, dims, zero_stage=1, pp_rank=r) for r in (0, 1)]
    assert all(z.optimizer < st.optimizer and z.weights == st.weights
               for z, st in zip(zero1, states, strict=True))
    zero2 = [state_memory_per_rank(CONFIG, dims, zero_stage=2, pp_rank=r) for r in (0, 1)]
    assert all(z2.grads < z1.grads and z2.optimizer == z1.optimizer
               for z2, z1 in zip(zero2, zero1, strict=True))
    zero3 = _run(dims, 3, "fp32")  # at rest the weights sharded too; the gathered stages on top
    assert zero3.state["weights"] < _run(dims, 2, "fp32").state["weights"]
    assert zero3.state["ZeRO-3 gathered stages and their full gradients (kept through the step)"] > 0


@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (1, 2)])
def test_a_pipeline_degree_with_context_or_tensor_parallelism_is_planned(cp, tp):
    """pp 2 inside cp 2 or tp 2: every degree is read as given, and each rank plans less than pp 2 alone
    (its s/cp tokens, its 1/tp shards; measured in tests/planner/ranks/test_planner_pp.py)."""
    dims = ParallelDims(dp=1, cp=cp, tp=tp, pp=2)
    assert (tensor_parallel_degree(dims), context_parallel_degree(dims), pipeline_parallel_degree(dims),
            zero_shard_degree(dims), data_parallel_degree(dims)) == (tp, cp, 2, cp, 1)
    assert _run(dims, 0, "fp32").total < _run(ParallelDims(dp=1, pp=2), 0, "fp32").total


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_a_context_parallel_degree_is_planned_not_refused(zero_stage):
    """dp 2 x cp 2 shards the state over the 4 ranks of dp x cp (as dp 4 does: the parameters are
    replicated over cp), and each rank's activations are those of s/cp tokens (fewer than dp 4's); the
    figures themselves are measured in tests/planner/ranks/test_planner_cp.py."""
    dims = ParallelDims(dp=2, cp=2)
    assert (data_parallel_degree(dims), context_parallel_degree(dims), zero_shard_degree(dims)) == (2, 2, 4)
    cp_plan, dp_plan = _run(dims, zero_stage, "fp32"), _run(ParallelDims(dp=4), zero_stage, "fp32")
    assert cp_plan.state == dp_plan.state
    assert cp_plan.activations["block activations"] < dp_plan.activations["block activations"]
    for index in range(4):
        assert state_memory_per_rank(CONFIG, dims, zero_stage=zero_stage, dp_rank=index) == \
            state_memory_per_rank(CONFIG, ParallelDims(dp=4), zero_stage=zero_stage, dp_rank=index)


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_a_tensor_parallel_degree_is_planned_not_refused(zero_stage):
    """dp 2 x tp 2 plans the rank's shards: less state and fewer activation bytes than dp 2 alone, and
    ZeRO over dp of those shards (the figures themselves are measured in
    tests/planner/ranks/test_planner_tp.py)."""
    dims = ParallelDims(dp=2, tp=2)
    assert (data_parallel_degree(dims), tensor_parallel_degree(dims)) == (2, 2)
    tp_plan, dp_plan = _run(dims, zero_stage, "fp32"), _run(ParallelDims(dp=2), zero_stage, "fp32")
    assert all(tp_plan.state[k] < dp_plan.state[k] for k in ("weights", "grads", "AdamW state"))
    assert tp_plan.activations["block activations"] < dp_plan.activations["block activations"]
    sp_plan = run_memory_per_rank(CONFIG, dims, micro_batch=2, seq_len=128, zero_stage=zero_stage,
                                  checkpointed_blocks=(1,), sequence_parallel=True)
    assert sp_plan.activations["block activations"] < tp_plan.activations["block activations"]
    assert sp_plan.state == tp_plan.state
    two_d = _run(dims, 3, "fp32")  # ZeRO-3 of the tp blocks (2-D sharding): their weights sharded too
    assert two_d.state["weights"] < _run(dims, 2, "fp32").state["weights"]


@pytest.mark.parametrize("dims", [SimpleNamespace(dp=4, tp=1, pp=1), SimpleNamespace(dp=0, cp=1, tp=1, pp=1),
                                  SimpleNamespace(dp=True, cp=1, tp=1, pp=1), 4])
def test_a_layout_without_positive_integer_degrees_is_refused(dims):
    with pytest.raises(ValueError, match="positive integer degrees"):
        _run(dims, 0, "fp32")


def test_imports_run_one_way_measure_below_parallel_below_planner():
    """config/comm/distributed -> measure -> parallel -> planner: measuring never loads the planner or a
    technique, and the planner loads no trainer or checkpoint (checked in a fresh interpreter)."""
    import subprocess
    import sys

    def loaded(module: str) -> set[str]:
        code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('refimpl.')))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        return set(out.split())

    below_measure = loaded("refimpl.measure")
    assert "refimpl.measure.state" in below_measure  # the probe sees what it loads
    assert not {m for m in below_measure if m.startswith(("refimpl.planner", "refimpl.parallel",
                                                              "refimpl.precision", "refimpl.train"))}
    below_planner = loaded("refimpl.planner")
    assert not {m for m in below_planner if m.startswith(("refimpl.train", "refimpl.checkpoint",
                                                              "refimpl.elastic", "refimpl.launch"))}
