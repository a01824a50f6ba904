"""Where a rank's piece of a global tensor lies: ``Box``, the one shard descriptor of refimpl.

A parallel technique holds *part* of each global tensor. Every part refimpl holds is an axis-aligned box of
the global tensor: ``local = global[o_0 : o_0 + s_0, ..., o_{n-1} : o_{n-1} + s_{n-1}]`` with per-dimension
``offsets`` ``o_d`` and local ``shape`` ``s_d`` (the chunk metadata of ``torch.distributed.checkpoint``:
offsets and sizes). The cases the course builds are all boxes:

* replicated (data parallelism, plain modules): the whole tensor, ``Box.full(shape)``;
* ZeRO / FSDP row shards (chapter 04): rows ``[a, b)`` of dim 0, ``Box.full(shape).narrow(0, a, b - a)``;
* Megatron tensor parallelism (chapter 06): a column-parallel ``[out, in]`` weight holds a block of rows
  (dim 0), a row-parallel one a block of *columns* (dim 1): strided in memory order, yet one box;
* compositions, e.g. ZeRO-1 over a tensor-parallel shard: a box inside a box, ``Box.narrow`` of the
  outer one, still a box of the global tensor.

The chunking rule of all of them is ``chunk_range`` (``torch.chunk``'s and FSDP2's ``Shard(d)``): ``N``
chunks of ``ceil(size / N)``, the last ones smaller or empty. The runtime shards with it and the planner
counts bytes with it, so the two cannot disagree.

Resharding is box intersection (chapter 11): a reader that needs box ``R`` copies ``P ∩ R`` out of every
saved piece ``P`` that meets it, ``out[(P ∩ R) - R.offsets] = piece[(P ∩ R) - P.offsets]``.

Who holds what is said by the tensors and wrappers themselves: a module with ``local_shards()`` declares
its boxes, a ``DTensor`` (torch's FSDP2 ``fully_shard``, ``parallelize_module``) says its box by its
placements (``dtensor_box``), the rest of a model is held whole (``module_shards``, what the
checkpoint saves).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def chunk_range(size: int, index: int, chunks: int) -> tuple[int, int]:
    """``[start, end)`` of chunk ``index`` of ``size`` elements cut into chunks of ``ceil(size / chunks)``.

    The last chunks are smaller, possibly empty (9 over 4: 3, 3, 3, 0), as ``torch.chunk`` and FSDP2 cut.
    """
    if not 0 <= index < chunks:
        raise ValueError(f"chunk {index} outside {chunks} chunks")
    step = -(-size // chunks)
    start = min(index * step, size)
    return start, min(start + step, size)


@dataclass(frozen=True)
class Box:
    """The box ``global[offsets[d] : offsets[d] + shape[d] for every d]`` of a tensor of ``global_shape``.

    ``shape`` is the local tensor's shape. A 0-d tensor is the empty tuple in all three fields.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        g, o, s = (tuple(int(v) for v in t) for t in (self.global_shape, self.offsets, self.shape))
        object.__setattr__(self, "global_shape", g)
        object.__setattr__(self, "offsets", o)
        object.__setattr__(self, "shape", s)
        if not len(g) == len(o) == len(s):
            raise ValueError(f"a box needs one offset and one size per dimension: global shape {g}, "
                             f"offsets {o}, shape {s}")
        for d, (gd, od, sd) in enumerate(zip(g, o, s, strict=True)):
            if not (0 <= od and 0 <= sd and od + sd <= gd):
                raise ValueError(f"dim {d}: [{od}, {od + sd}) lies outside a global tensor of shape {g}")

    @classmethod
    def full(cls, global_shape: Sequence[int]) -> Box:
        """The whole tensor (a replica)."""
        shape = tuple(int(d) for d in global_shape)
        return cls(shape, (0,) * len(shape), shape)

    @classmethod
    def chunk(cls, global_shape: Sequence[int], dim: int, index: int, chunks: int) -> Box:
        """Chunk ``index`` of ``chunks`` along ``dim`` (``chunk_range``): a row shard for ``dim=0``."""
        whole = cls.full(global_shape)
        start, end = chunk_range(whole.global_shape[dim], index, chunks)
        return whole.narrow(dim, start, end - start)

    @property
    def ndim(self) -> int:
        return len(self.global_shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_full(self) -> bool:
        return self.shape == self.global_shape

    def narrow(self, dim: int, start: int, length: int) -> Box:
        """The sub-box ``[start, start + length)`` of *this box's local* dim ``dim``, in global coordinates
        (``local.narrow(dim, start, length)`` as a box of the global tensor)."""
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"[{start}, {start + length}) outside local dim {dim} of size {self.shape[dim]}")
        offsets, shape = list(self.offsets), list(self.shape)
        offsets[dim] += start
        shape[dim] = length
        return Box(self.global_shape, tuple(offsets), tuple(shape))

    def within(self, inner: Box) -> Box:
        """``inner`` is a box of this box's *local* tensor (its ``global_shape`` is our ``shape``); the same
        elements as a box of the global tensor. ZeRO-1's row shard of a tensor-parallel shard is
        ``tp_box.within(zero_box)``."""
        if inner.global_shape != self.shape:
            raise ValueError(f"a box of a {inner.global_shape} tensor is not in a local shape {self.shape}")
        offsets = tuple(a + b for a, b in zip(self.offsets, inner.offsets, strict=True))
        return Box(self.global_shape, offsets, inner.shape)

    def intersection(self, other: Box) -> Box | None:
        """The common elements of two boxes of the same tensor, or None when they share none."""
        if other.global_shape != self.global_shape:
            raise ValueError(f"boxes of tensors of shapes {self.global_shape} and {other.global_shape}")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a + s, b + t) for a, s, b, t in
                   zip(self.offsets, self.shape, other.offsets, other.shape, strict=True))
        if any(h <= lo_d for lo_d, h in zip(lo, hi, strict=True)):
            return None
        return Box(self.global_shape, lo, tuple(h - lo_d for lo_d, h in zip(lo, hi, strict=True)))

    def slices(self, of: Box | None = None) -> tuple[slice, ...]:
        """Index this box's elements out of the tensor of box ``of`` (None: the global tensor).

        ``local_of[box.slices(of)]`` is ``box``'s part of a tensor holding ``of`` (``box`` must lie in it).
        """
        base = (0,) * self.ndim if of is None else of.offsets
        if of is not None and of.intersection(self) != self:
            raise ValueError(f"{self} does not lie inside {of}")
        return tuple(slice(o - b, o - b + s) for o, b, s in zip(self.offsets, base, self.shape, strict=True))

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, global_shape: Sequence[int], entry: dict) -> Box:
        return cls(tuple(global_shape), tuple(entry["offsets"]), tuple(entry["shape"]))


@dataclass(frozen=True, eq=False)
class LocalShard:
    """``tensor`` holds the elements ``box`` of a global tensor: what a rank says it holds (chapter 11).

    Wrappers hand these to the checkpoint (``local_shards()``); ``tensor.shape`` must be ``box.shape``.
    """

    tensor: torch.Tensor
    box: Box

    def __post_init__(self) -> None:
        if is_dtensor(self.tensor):
            raise TypeError("a LocalShard holds a plain local tensor; a DTensor says its own box: "
                            "held_shard(t) or dtensor_shard(t)")
        if tuple(self.tensor.shape) != self.box.shape:
            raise ValueError(f"a local tensor of shape {tuple(self.tensor.shape)} cannot hold the box "
                             f"{self.box.shape} at {self.box.offsets} of {self.box.global_shape}")

    @classmethod
    def full(cls, tensor: torch.Tensor) -> LocalShard:
        """A tensor held whole (replicated on every rank that passes it)."""
        return cls(tensor, Box.full(tensor.shape))

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.box.global_shape


def _dtensor_class() -> type | None:
    """torch's ``DTensor`` class, or None while ``torch.distributed.tensor`` is not imported: then no DTensor
    exists. This module does not import it (0.7 s, and most users of a Box never need it)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """``t`` is a ``torch.distributed.tensor.DTensor`` (as ``fully_shard``'s and ``parallelize_module``'s
    parameters are)."""
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``t``: a DTensor's ``_local_tensor``, any other tensor itself.

    ``_local_tensor`` is one object for as long as the DTensor keeps its storage, so it can key a map by
    ``id``; ``to_local()`` under autograd returns a new view on every call.
    """
    return t._local_tensor if is_dtensor(t) else t


def dtensor_box(t: DTensor) -> Box:
    """The box of the global tensor that this rank's local tensor of the DTensor ``t`` holds (chapter 11).

    torch's own rule (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, what DCP
    saves): along the mesh axes in order, ``Shard(d)`` over an axis of ``n`` ranks cuts the current extent of
    dim ``d`` into ``n`` chunks of ``ceil(size / n)`` rows (``chunk_range``, the last ones smaller or
    empty) and keeps chunk ``coordinate``; ``Replicate()`` keeps the whole extent (a replica is the full
    box). FSDP2's ``fully_shard`` pads dim 0 to a multiple of the world size ``W`` for its all-gather, but
    the DTensor's local tensor is the unpadded part: rank ``r`` of ``N`` rows holds
    ``[min(r c, N), min((r + 1) c, N))``, ``c = ceil(N / W)`` (11 rows over 3 ranks: 4, 4, 3; 2 rows: 1, 1,
    0). The offset is ``r c``, not ``r`` times the rank's own row count, which is right only when ``W``
    divides ``N``. ``Partial`` (a pending sum) and ``_StridedShard`` (interleaved rows) hold no box: refused.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    odd = [p for p in t.placements if not isinstance(p, (Shard, Replicate))]
    if odd:
        raise ValueError(f"a DTensor placed {tuple(t.placements)} holds no box of its global tensor "
                         f"(only Shard and Replicate do): {odd}")
    if t.device_mesh.get_coordinate() is None:
        raise ValueError(f"this rank is not in the DTensor's mesh {t.device_mesh}: it holds nothing of it")
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    box = Box(tuple(t.shape), offsets, shape)
    if box.shape != tuple(t._local_tensor.shape):
        raise ValueError(f"a DTensor of shape {tuple(t.shape)} placed {tuple(t.placements)} should hold "
                         f"{box.shape} here, its local tensor is {tuple(t._local_tensor.shape)}")
    return box


def dtensor_shard(t: DTensor) -> LocalShard:
    """The DTensor ``t`` as a ``LocalShard``: its local tensor (written in place on load) and
    ``dtensor_box``."""
    return LocalShard(t._local_tensor, dtensor_box(t))


def dtensor_like(t: DTensor, local: torch.Tensor) -> torch.Tensor:
    """The DTensor on ``t``'s mesh and placements, of ``t``'s global shape and strides, whose local tensor
    is ``local`` (this rank's box of it, ``dtensor_box`` of ``t``): no communication."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def held_shard(t: torch.Tensor) -> LocalShard:
    """What this rank holds of ``t``: a DTensor its box (``dtensor_shard``), any other tensor the
    whole of it (``LocalShard.full``)."""
    return dtensor_shard(t) if is_dtensor(t) else LocalShard.full(t)


def module_shards(module: nn.Module) -> dict[str, LocalShard]:
    """What a rank holds of ``module``'s parameters and persistent buffers, by their names in the module.

    The rule the checkpoint reads (chapter 11): a module, at any depth, that has a method
    ``local_shards() -> dict[str, LocalShard]`` claims its whole subtree and says itself which boxes it holds
    (names relative to that module, as the plain wrapped model names them: ZeRO-3 its row shards, a data-
    parallel wrapper its replicas); every tensor of the rest is what ``held_shard`` says: a DTensor
    (torch's ``fully_shard``) the box of its placements (``dtensor_box``), a plain tensor the whole.
    A tensor registered twice (tied weights) is listed once, under its first name (``named_parameters``).
    """
    declare = getattr(module, "local_shards", None)
    if callable(declare):
        return _declared(module, declare)
    out: dict[str, LocalShard] = {}
    seen_modules: set[int] = set()
    seen: set[int] = set()

    def walk(m: nn.Module, prefix: str) -> None:
        if id(m) in seen_modules:
            return
        seen_modules.add(id(m))
        declare = getattr(m, "local_shards", None)
        if callable(declare):
            for name, shard in _declared(m, declare).items():
                out.setdefault(prefix + name, shard)
            seen.update(id(t) for t in (*m.parameters(), *m.buffers()))
            seen_modules.update(id(sub) for sub in m.modules())
            return
        own = [*m._parameters.items(),
               *((n, b) for n, b in m._buffers.items() if n not in m._non_persistent_buffers_set)]
        for name, t in own:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out[prefix + name] = held_shard(t)
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return out


def _declared(module: nn.Module, declare) -> dict[str, LocalShard]:
    shards = dict(declare())
    for name, shard in shards.items():
        if not isinstance(shard, LocalShard):
            raise TypeError(f"{type(module).__name__}.local_shards()[{name!r}] is a {type(shard).__name__}, "
                            "not a LocalShard")
    return shards
