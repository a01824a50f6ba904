"""The layout a planner function is given: the degrees of the four parallel axes (chapters 06 and 10).

A planner function that answers "per rank" takes the layout of the ranks, a
:class:`refimpl.distributed.ParallelDims` or any object with positive integer ``dp``, ``cp``, ``tp`` and
``pp`` (Megatron's names: data, context, tensor and pipeline parallelism; Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters", section 3), so that the terms of tensor,
context and pipeline parallelism join the same functions as the chapters that build them land.

Today the planner models data parallelism (and ZeRO over the data-parallel ranks, chapter 04) and tensor
parallelism with or without sequence parallelism (chapter 06: each rank holds ``1/tp`` of the sharded
tensors, :func:`refimpl.planner.params_flops.param_shapes`, and the activations of
:mod:`refimpl.planner.activations`). :func:`data_parallel_degree` refuses a layout with ``cp`` or ``pp``
above 1 with a ValueError that names the chapter that brings it, rather than returning a figure that leaves
those terms out.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Layout", "data_parallel_degree", "tensor_parallel_degree"]

AXES = ("dp", "cp", "tp", "pp")
_NOT_YET = {"cp": ("context", "07"), "pp": ("pipeline", "08")}


class Layout(Protocol):
    """The degrees of the parallel axes; their product is the world size (:class:`ParallelDims` has them)."""

    dp: int
    cp: int
    tp: int
    pp: int


def _check(dims: Layout) -> None:
    for axis in AXES:
        value = getattr(dims, axis, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"a planner layout needs positive integer degrees {', '.join(AXES)} (e.g. "
                             f"refimpl.distributed.ParallelDims); got {axis}={value!r} in {dims!r}")
    for axis, (name, chapter) in _NOT_YET.items():
        degree = getattr(dims, axis)
        if degree > 1:
            raise ValueError(f"the planner models data and tensor parallelism only: {name} parallelism "
                             f"({axis}={degree}) comes with chapter {chapter}")


def data_parallel_degree(dims: Layout) -> int:
    """``dims.dp``, the number of ranks the model state is replicated (or ZeRO-sharded) over, after checking
    that ``dims`` is a layout the planner models: positive integer degrees, ``cp = pp = 1``."""
    _check(dims)
    return dims.dp


def tensor_parallel_degree(dims: Layout) -> int:
    """``dims.tp``, the number of ranks the sharded tensors and the activations are split over (chapter
    06), after the same check as :func:`data_parallel_degree`."""
    _check(dims)
    return dims.tp
