"""ZeRO-3's units: a parameter's shard beside its full tensor, whose storage comes and goes (chapter 04).

A full tensor is freed by shrinking its storage to 0 bytes and re-allocated in place, so the tensor
objects autograd saved in forward stay valid (``_free``, ``_alloc``). Used by the synchronous
lesson (``refimpl.parallel.zero.unit_hooks``) and by ``FullyShardedDataParallel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from refimpl.distributed.placement import Box, LocalShard
from refimpl.measure.state import StateMemory, state_bytes, storage_bytes
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
    float8: Any = None  # a weight gathered in fp8 instead (fsdp_float8.Float8Gather): its full fp8 tensor


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
    # the group it is sharded over and its gradients reduce-scattered over (the wrapper's, or an expert
    # unit's expert-data-parallel group), and what the sum is divided by (None: the group's size, a mean)
    group: Any = None
    divide_factor: int | None = None

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


def _cast_floats(obj: object, dtype: torch.dtype) -> object:
    """``obj`` with every floating-point tensor in it cast to ``dtype`` (tuples kept tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floats(o, dtype) for o in obj)
    return obj


def _full_tensors(sps: list[_ShardedParam]) -> list[torch.Tensor]:
    """The full tensors of ``sps``: each full parameter, and the full fp8 weight of one gathered in fp8."""
    return [sp.unsharded for sp in sps] + [sp.float8.tensor.data for sp in sps if sp.float8 is not None]


def gathered_bytes(units: list[FSDPUnit]) -> StateMemory:
    """Bytes of *full* tensors a ZeRO-3 rank holds now: gathered parameters and all-gathers in flight
    (weights) and full gradients not yet reduce-scattered (grads); the shards are not counted.
    ``refimpl.planner.zero3_peak_gathered_bytes`` bounds its peak over a step."""
    sps = [sp for u in units for sp in u.params]
    in_flight = [u.pending[1] for u in units if u.pending is not None]
    seen: set = set()
    weights = storage_bytes(_full_tensors(sps) + in_flight, exclude=seen)
    grads = storage_bytes([sp.unsharded.grad for sp in sps], exclude=seen)
    return StateMemory(weights=weights, grads=grads, optimizer=0)


def held_bytes(units: list[FSDPUnit], optimizer: torch.optim.Optimizer | None = None) -> StateMemory:
    """Bytes a ZeRO-3 rank holds now in parameters (shards, gathered units and all-gathers in flight),
    gradients (shards and full gradients not yet reduced) and optimizer state."""
    sps = [sp for u in units for sp in u.params]
    in_flight = [u.pending[1] for u in units if u.pending is not None]  # prefetched all-gathers
    return state_bytes([sp.sharded for sp in sps], optimizer,
                       extra_params=_full_tensors(sps) + in_flight,
                       extra_grads=[sp.unsharded.grad for sp in sps])


def units_local_shards(module: nn.Module, units: list[FSDPUnit],
                       inner_boxes: dict[str, Box]) -> dict[str, LocalShard]:
    """What a ZeRO-3 rank holds of ``module``, by name (the checkpoint reads it, chapter 11): each
    parameter's rows (``ShardSpec.box``, under its first name when tied) and every persistent buffer
    whole. A parameter that was itself a block of a larger tensor (a tensor-parallel shard: its box in
    ``inner_boxes``) gets the rows inside that block, ``inner.within(rows)``: the 2-D box of FSDP2 over TP
    (torch's ``_StridedShard`` places the same elements for a DTensor)."""
    names = {(id(m), attr): f"{prefix}.{attr}" if prefix else attr
             for prefix, m in module.named_modules() for attr in m._parameters}
    index = {key: i for i, key in enumerate(names)}
    out = {}
    for unit in units:
        for sp in unit.params:
            name = names[min(((id(m), a) for m, a in sp.registrations), key=index.__getitem__)]
            inner = inner_boxes.get(name)
            out[name] = LocalShard(sp.sharded, sp.spec.box if inner is None else inner.within(sp.spec.box))
    persistent = set(module.state_dict(keep_vars=True))
    return out | {n: LocalShard.full(b) for n, b in module.named_buffers() if n in persistent}
