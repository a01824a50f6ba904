"""ZeRO-3's units: a parameter's shard beside its full tensor, whose storage comes and goes (chapter 04).

A full tensor is freed by shrinking its storage to 0 bytes and re-allocated in place, so the tensor
objects autograd saved in forward stay valid (:func:`_free`, :func:`_alloc`). Used by the synchronous
lesson (:mod:`refimpl.parallel.zero.unit_hooks`) and by :class:`FullyShardedDataParallel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from refimpl.parallel.zero.sharding import ShardSpec


def _free(t: torch.Tensor) -> None:
    """Release a tensor's memory but keep the tensor (autograd may hold it): its storage shrinks to 0."""
    if t.untyped_storage().nbytes() != 0:
        t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


@dataclass(eq=False)
class _ShardedParam:
    """One parameter under stage 3: where it is registered, its shard, and its (usually freed) full tensor."""

    registrations: list[tuple[nn.Module, str]]
    spec: ShardSpec
    sharded: nn.Parameter  # this rank's rows, [end - start, ...]: what the optimizer steps
    unsharded: nn.Parameter  # the full tensor; its storage is allocated only while the unit is gathered


@dataclass(eq=False)
class FSDPUnit:
    """A unit of stage 3: the parameters gathered together (one transformer block, or the root's rest)."""

    name: str
    module: nn.Module
    params: list[_ShardedParam]
    gathered: bool = False
    pending: tuple | None = None  # an async all-gather in flight: (work, output buffer)
    ready: int = 0  # trainable parameters whose gradient arrived in this backward
    reduced: bool = False
    hooks: list = field(default_factory=list)

    @property
    def trainable(self) -> list[_ShardedParam]:
        return [p for p in self.params if p.sharded.requires_grad]


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
