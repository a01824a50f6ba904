"""refimpl's answers to the exercises of chapter 12, under the exercise's names and signatures.

The grid is ``refimpl.distributed.ParallelDims`` (``coordinates``, ``groups_of``), the state per GPU
the planner's ``refimpl.planner.zero_memory_paper`` applied to the GPU's ``N / (tp pp)`` parameters and
the ``dp x cp`` ZeRO group; the gradient average over the ``dp x cp`` group
(``refimpl.distributed.mesh.LOSS_AXES``), the norm's counting by the rule of
``refimpl.parallel.tensor_parallel.grad_norm`` (a replicated parameter on tp rank 0, a sharded one on every
rank) and ``refimpl.parallel.pipeline_parallel.PipelineModule.is_tied_copy`` (the last stage's copy of a
tied embedding left out). The grader's self-test grades this module and expects full marks
(tests/course/cli/test_exercises.py).
"""

from __future__ import annotations

from refimpl.distributed import ParallelDims
from refimpl.distributed.mesh import LOSS_AXES
from refimpl.measure.state import StateMemory
from refimpl.planner import zero_memory_paper


def rank_coordinates(rank: int, *, dp: int, cp: int, tp: int, pp: int) -> tuple[int, int, int, int]:
    """refimpl's coordinates of ``rank``."""
    c = ParallelDims(dp=dp, cp=cp, tp=tp, pp=pp).coordinates(rank)
    return (c.pp, c.dp, c.cp, c.tp)


def axis_groups(axes: tuple[str, ...], *, dp: int, cp: int, tp: int, pp: int) -> list[tuple[int, ...]]:
    """refimpl's groups along ``axes``, sorted by their first rank."""
    return sorted(ParallelDims(dp=dp, cp=cp, tp=tp, pp=pp).groups_of(*axes))


def state_bytes_per_gpu(num_params: float, *, dp: int, cp: int, tp: int, pp: int,
                        zero_stage: int) -> StateMemory:
    """The paper's per-device model state of the GPU's share, sharded over ``dp x cp``."""
    return zero_memory_paper(num_params / (tp * pp), dp * cp, zero_stage)


# the plain GPT's parameters that Megatron's layers split over tp (chapter 06): column-parallel weights and
# biases, row-parallel weights, the vocabulary-parallel embedding and an untied column-parallel output layer
_TP_SHARDED = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
               "self_attention.dense.weight", "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
               "mlp.dense_4h_to_h.weight", "embedding.word_embeddings.weight", "output_layer.weight")


def gradient_average_group(rank: int, *, dp: int, cp: int, tp: int, pp: int) -> tuple[int, ...]:
    """The ``dp x cp`` group of ``rank`` (the trainer's ``Parallelized.group``)."""
    dims = ParallelDims(dp=dp, cp=cp, tp=tp, pp=pp)
    return next(g for g in dims.groups_of(*LOSS_AXES) if rank in g)


def counted_in_grad_norm(name: str, *, stage: int, pp: int, tp_rank: int, tp: int, tied: bool) -> bool:
    """A tp-sharded gradient on every tp rank, a replicated one on tp rank 0; the tied copy never."""
    if tied and pp > 1 and stage == pp - 1 and name == "embedding.word_embeddings.weight":
        return False
    sharded = tp > 1 and name.endswith(_TP_SHARDED)
    return sharded or tp_rank == 0


__all__ = ["StateMemory", "axis_groups", "counted_in_grad_norm", "gradient_average_group", "rank_coordinates",
           "state_bytes_per_gpu"]
