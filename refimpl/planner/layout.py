"""The layout a planner function is given: the degrees of the four parallel axes (chapters 06, 07 and 10).

A planner function that answers "per rank" takes the layout of the ranks, a
``refimpl.distributed.ParallelDims`` or any object with positive integer ``dp``, ``cp``, ``tp`` and
``pp`` (Megatron's names: data, context, tensor and pipeline parallelism; Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters", section 3), so that the terms of each
technique join the same functions as the chapters that build them land.

Today the planner models data parallelism (chapter 04: ZeRO), tensor parallelism with or without sequence
parallelism (chapter 06: each rank holds ``1/tp`` of the sharded tensors,
``refimpl.planner.params_flops.param_shapes``, and the activations of
``refimpl.planner.activations``) and context parallelism (chapter 07: each rank holds ``s/cp`` tokens of
every sequence; ring attention, Liu et al. 2023, or Ulysses, Jacobs et al. 2023). The parameters are
replicated over ``cp`` as over ``dp``, so the loss, the gradients and ZeRO's shards span the ``dp x cp``
ranks (``refimpl.distributed.mesh.LOSS_AXES``): ``zero_shard_degree`` is ``dp * cp``.
Pipeline parallelism (chapter 08: each pipeline rank holds its stages, ``refimpl.planner.pipeline_stages``)
composes with all three (chapter 12): the stages hold the tensor-parallel shards and the context-parallel
attention, as ``refimpl.parallel.parallelize`` builds them.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Layout", "context_parallel_degree", "data_parallel_degree", "pipeline_parallel_degree",
           "tensor_parallel_degree", "zero_shard_degree"]

AXES = ("dp", "cp", "tp", "pp")


class Layout(Protocol):
    """The degrees of the parallel axes; their product is the world size (``ParallelDims`` has them).
    Read-only members, so that a frozen dataclass (``ParallelDims``) is one."""

    @property
    def dp(self) -> int: ...

    @property
    def cp(self) -> int: ...

    @property
    def tp(self) -> int: ...

    @property
    def pp(self) -> int: ...


def _check(dims: Layout) -> None:
    for axis in AXES:
        value = getattr(dims, axis, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"a planner layout needs positive integer degrees {', '.join(AXES)} (e.g. "
                             f"refimpl.distributed.ParallelDims); got {axis}={value!r} in {dims!r}")


def data_parallel_degree(dims: Layout) -> int:
    """``dims.dp``, the ranks that read different batches (each degree function checks that ``dims`` is a
    layout: positive integer degrees)."""
    _check(dims)
    return dims.dp


def tensor_parallel_degree(dims: Layout) -> int:
    """``dims.tp``, the ranks the sharded tensors and the activations are split over (chapter 06)."""
    _check(dims)
    return dims.tp


def context_parallel_degree(dims: Layout) -> int:
    """``dims.cp``, the ranks each sequence is split over (``s/cp`` tokens each, chapter 07)."""
    _check(dims)
    return dims.cp


def zero_shard_degree(dims: Layout) -> int:
    """``dims.dp * dims.cp``: the ranks that hold the same model shard and see other tokens, the group the
    gradients are averaged and ZeRO shards the state over (``refimpl.parallel.parallelize`` uses
    ``refimpl.distributed.mesh.LOSS_AXES``). Under HSDP
    (``dims.dp_replicate`` R > 1) ZeRO-3 shards over a shard group only: ``dp / R * cp``."""
    _check(dims)
    return dims.dp // getattr(dims, "dp_replicate", 1) * dims.cp


def pipeline_parallel_degree(dims: Layout) -> int:
    """``dims.pp``, the pipeline ranks the stages are spread over (chapter 08)."""
    _check(dims)
    return dims.pp
