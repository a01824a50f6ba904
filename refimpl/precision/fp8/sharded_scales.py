"""A tensor-parallel shard cast to fp8 with the whole layer's scales (chapters 06 and 10).

Tensor-parallel shards (chapter 06; torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``,
whose DTensor amax is the whole tensor's): a column layer holds ``W[N/t, K]`` and sees ``g[M, N/t]``, a row
layer ``W[N, K/t]`` and ``x[M, K/t]``. A scale taken from the shard alone would differ from one device's,
so ``ShardedScales`` all-reduces (MAX, over the tensor-parallel group) the amax of every operand that
is split along a dimension its amax runs over: tensorwise, any operand holding the split dimension;
rowwise, only where the split dimension is the contraction dimension (a per-row amax of whole rows is
already the whole row's, and the ranks hold other rows). Then every rank casts with one device's scales.

Under sequence parallelism the column layer's input is the gathered ``x[M, K]`` (whole), so only its
weight and gradient amaxes are agreed, as without it. Used by ``refimpl.precision.fp8.float8_linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.precision.fp8.scaling import Scaling

__all__ = ["ShardedScales"]

_DIMS = {"x": "MK", "weight": "NK", "grad": "MN"}  # each operand's dims: tokens M, in K, out N


@dataclass(frozen=True, kw_only=True)
class ShardedScales:
    """A tensor-parallel shard's scales made the whole layer's (module docstring): ``split`` ``"out"`` (a
    column-parallel layer: ``N`` over the group) or ``"in"`` (row-parallel: ``K``), ``group`` the
    tensor-parallel process group."""

    group: Any
    split: Literal["in", "out"]

    def __post_init__(self) -> None:
        if self.split not in ("in", "out"):
            raise ValueError(f"split must be 'in' or 'out', got {self.split!r}")

    def reducer(self, operand: str, contraction_dim: int, scaling: Scaling
                ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The MAX all-reduce the amax of ``operand`` (``x``, ``weight`` or ``grad``) cast along
        ``contraction_dim`` needs, or None when the local amax is already the whole tensor's."""
        dims, split = _DIMS[operand], "K" if self.split == "in" else "N"
        if split not in dims or (scaling == "rowwise" and dims[contraction_dim] != split):
            return None

        def all_reduce_max(amax: torch.Tensor) -> torch.Tensor:
            amax = amax.to(torch.float32)  # exact; gloo takes fp32
            ops.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            return amax
        return all_reduce_max


