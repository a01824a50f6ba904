"""Where a rank's piece of a global tensor lies: :class:`Box`, the one shard descriptor of refimpl.

A parallel technique holds *part* of each global tensor. Every part refimpl holds is an axis-aligned box of
the global tensor: ``local = global[o_0 : o_0 + s_0, ..., o_{n-1} : o_{n-1} + s_{n-1}]`` with per-dimension
``offsets`` ``o_d`` and local ``shape`` ``s_d`` (the chunk metadata of ``torch.distributed.checkpoint``:
offsets and sizes). The cases the course builds are all boxes:

* replicated (data parallelism, plain modules): the whole tensor, ``Box.full(shape)``;
* ZeRO / FSDP row shards (chapter 04): rows ``[a, b)`` of dim 0, ``Box.full(shape).narrow(0, a, b - a)``;
* Megatron tensor parallelism (chapter 06): a column-parallel ``[out, in]`` weight holds a block of rows
  (dim 0), a row-parallel one a block of *columns* (dim 1): strided in memory order, yet one box;
* compositions, e.g. ZeRO-1 over a tensor-parallel shard: a box inside a box, :meth:`Box.narrow` of the
  outer one, still a box of the global tensor.

The chunking rule of all of them is :func:`chunk_range` (``torch.chunk``'s and FSDP2's ``Shard(d)``): ``N``
chunks of ``ceil(size / N)``, the last ones smaller or empty. The runtime shards with it and the planner
counts bytes with it, so the two cannot disagree.

Resharding is box intersection (chapter 11): a reader that needs box ``R`` copies ``P ∩ R`` out of every
saved piece ``P`` that meets it, ``out[(P ∩ R) - R.offsets] = piece[(P ∩ R) - P.offsets]``.

Who holds what is said by the wrappers themselves: a module with ``local_shards()`` declares its boxes, the
rest of a model is held whole (:func:`module_shards`, what the checkpoint saves).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


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
        """Chunk ``index`` of ``chunks`` along ``dim`` (:func:`chunk_range`): a row shard for ``dim=0``."""
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


def module_shards(module: nn.Module) -> dict[str, LocalShard]:
    """What a rank holds of ``module``'s parameters and persistent buffers, by their names in the module.

    The rule the checkpoint reads (chapter 11): a module, at any depth, that has a method
    ``local_shards() -> dict[str, LocalShard]`` claims its whole subtree and says itself which boxes it holds
    (names relative to that module, as the plain wrapped model names them: ZeRO-3 its row shards, a data-
    parallel wrapper its replicas); every tensor of the rest is held whole (:meth:`LocalShard.full`). A
    tensor registered twice (tied weights) is listed once, under its first name (``named_parameters``).
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
                out[prefix + name] = LocalShard.full(t)
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
