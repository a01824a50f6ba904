"""Model state of ZeRO stages 0-3 per rank, as formulas a chapter checks against measurement (chapter 04).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section
5 and figure 1. With Psi parameters, N data-parallel ranks and mixed-precision Adam (fp16 weights and
gradients, K = 12 bytes of optimizer state per parameter: fp32 master weights, momentum and variance), the
model state held by one device is

    stage 0 (plain data parallelism)        (2 + 2 + K) Psi
    stage 1 (P_os, optimizer state sharded)  4 Psi + K Psi / N
    stage 2 (P_os+g, + gradients sharded)    2 Psi + (2 + K) Psi / N
    stage 3 (P_os+g+p, + parameters)         (4 + K) Psi / N

``zero_memory_paper`` is that table. The course trains in fp32 on a CPU with ``torch.optim.AdamW`` and no
master copy, so the same table with the dtypes actually used is ``weights 4, gradients 4, K = 8`` (two fp32
moments) plus PyTorch's ``step`` counter, one fp32 scalar tensor per parameter tensor (as
``refimpl.planner.memory.state_memory`` counts it). ``zero_memory`` is that table made *exact*: a
parameter is split along dim 0 into chunks of ``ceil(rows / N)`` rows (torch.chunk and FSDP2's rule, the
runtime's own ``refimpl.distributed.placement.chunk_range``), so the last ranks may hold fewer rows (or
none); ``Psi / N`` becomes the rank's true shard size ``sharded_numel``. For shapes whose first dim
divides by N the two agree to the byte.

Which collectives a step issues and the bytes they move are in ``refimpl.planner.communication``.
The ``refimpl.measure.state.StateMemory`` returned is the class ``refimpl.measure.state_bytes``
measures, so a chapter compares formula and measurement with ``==``. ``world_size`` is the number ``N`` of
ranks the state is sharded over: the ``dp x cp`` ranks of the layout, which hold the same parameters and
see other tokens (context parallelism replicates the parameters as data parallelism does, chapter 07;
``refimpl.planner.memory.state_memory_per_rank`` takes the layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from refimpl.distributed.placement import chunk_range
from refimpl.measure.state import StateMemory

__all__ = ["ADAM_MIXED_PRECISION_K", "STAGES", "check_zero_stage", "padded_numel", "shard_rows",
           "sharded_numel", "zero3_peak_gathered_bytes", "zero_memory", "zero_memory_paper"]

ADAM_MIXED_PRECISION_K = 12  # fp32 master weights + momentum + variance, bytes per parameter (the paper's K)
STAGES = (0, 1, 2, 3)

Shape = Sequence[int]


def check_zero_stage(zero_stage: int, world_size: int) -> None:
    """A ValueError unless ``zero_stage`` is 0-3 and ``world_size`` >= 1."""
    if zero_stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {zero_stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def zero_memory_paper(
    psi: float, world_size: int, zero_stage: int, *, k: float = ADAM_MIXED_PRECISION_K,
    weight_bytes: float = 2, grad_bytes: float = 2,
) -> StateMemory:
    """The paper's per-device model-state bytes (fractional: ``Psi / N`` is not rounded)."""
    check_zero_stage(zero_stage, world_size)
    n = world_size
    weights = weight_bytes * psi / (n if zero_stage >= 3 else 1)
    grads = grad_bytes * psi / (n if zero_stage >= 2 else 1)
    optimizer = k * psi / (n if zero_stage >= 1 else 1)
    return StateMemory(weights=weights, grads=grads, optimizer=optimizer)  # type: ignore[arg-type]


def shard_rows(dim0: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a tensor's dim 0 that ``rank`` owns: the runtime's own rule,
    ``refimpl.distributed.placement.chunk_range`` (chunks of ``ceil(dim0 / N)`` rows, the last ranks
    fewer or none: 9 rows over 4 ranks are 3, 3, 3, 0, as ``torch.chunk`` and FSDP2 split)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of size {world_size}")
    return chunk_range(dim0, rank, world_size)


def _rows_and_row_numel(shape: Shape) -> tuple[int, int]:
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def sharded_numel(shapes: Sequence[Shape], rank: int, world_size: int) -> int:
    """Elements ``rank`` holds of parameters ``shapes``, each split along dim 0: the exact ``Psi / N``."""
    total = 0
    for shape in shapes:
        rows, row_numel = _rows_and_row_numel(shape)
        start, end = shard_rows(rows, rank, world_size)
        total += (end - start) * row_numel
    return total


def padded_numel(shapes: Sequence[Shape], world_size: int) -> int:
    """Elements a collective moves for ``shapes``: each padded to ``N * ceil(rows / N)`` rows."""
    total = 0
    for shape in shapes:
        rows, row_numel = _rows_and_row_numel(shape)
        total += world_size * -(-rows // world_size) * row_numel
    return total


def zero_memory(
    shapes: Sequence[Shape], world_size: int, zero_stage: int, *, rank: int = 0,
    trainable: Sequence[bool] | None = None, param_bytes: int = 4, grad_bytes: int = 4,
    moment_bytes: int = 8, step_bytes: int = 4,
) -> StateMemory:
    """Exact bytes of model state on ``rank`` at ZeRO ``zero_stage`` for parameters of ``shapes``.

    Counted at rest (after backward or after the optimizer step, when no unit is gathered): weights,
    gradients of the ``trainable`` parameters (default: all), and AdamW's state: ``moment_bytes`` per
    element (exp_avg + exp_avg_sq) plus one ``step`` scalar of ``step_bytes`` per trainable tensor (the
    sharded optimizers keep a, possibly empty, shard of every tensor on every rank).
    """
    check_zero_stage(zero_stage, world_size)
    trainable = [True] * len(shapes) if trainable is None else list(trainable)
    if len(trainable) != len(shapes):
        raise ValueError(f"{len(trainable)} trainable flags for {len(shapes)} shapes")
    trained = [s for s, t in zip(shapes, trainable, strict=True) if t]
    full_all = sum(math.prod(s) for s in shapes)
    full_trained = sum(math.prod(s) for s in trained)
    shard_all = sharded_numel(shapes, rank, world_size)
    shard_trained = sharded_numel(trained, rank, world_size)
    weights = param_bytes * (shard_all if zero_stage >= 3 else full_all)
    grads = grad_bytes * (shard_trained if zero_stage >= 2 else full_trained)
    moments = moment_bytes * (shard_trained if zero_stage >= 1 else full_trained)
    return StateMemory(weights=weights, grads=grads, optimizer=moments + step_bytes * len(trained))


def zero3_peak_gathered_bytes(
    unit_shapes: Sequence[Sequence[Shape]], world_size: int, *,
    trainable: Sequence[Sequence[bool]] | None = None, prefetch: bool = False, bytes_per_element: int = 4,
    root_unit: int = 0,
) -> StateMemory:
    """Upper bounds on the *full* (gathered) bytes a ZeRO-3 rank holds at any moment of one step.

    ``weights``: the root unit stays gathered from forward to the end of backward; besides it one other
    unit at a time: ``full(root) + max_u full(u)``; with ``prefetch`` the next unit's all-gather output
    (padded rows) is in flight meanwhile: ``+ max_u padded(u)``. A unit freed late (kept until the end of
    backward) adds a second unit and exceeds it; a prefetch that never happens stays at the first form.
    ``grads``: the root's full gradients and those of one other unit before its reduce-scatter,
    ``trained(root) + max_u trained(u)``. The two peaks need not fall at the same moment.
    """
    n, b = world_size, bytes_per_element
    if trainable is None:
        trainable = [[True] * len(shapes) for shapes in unit_shapes]

    def full(u: int, only_trained: bool) -> int:
        pairs = zip(unit_shapes[u], trainable[u], strict=True)
        return sum(math.prod(s) for s, t in pairs if t or not only_trained)

    others = [u for u in range(len(unit_shapes)) if u != root_unit]
    ahead = max((padded_numel(unit_shapes[u], n) for u in others), default=0) if prefetch else 0
    weights = full(root_unit, False) + max((full(u, False) for u in others), default=0) + ahead
    grads = full(root_unit, True) + max((full(u, True) for u in others), default=0)
    return StateMemory(weights=b * weights, grads=b * grads, optimizer=0)
