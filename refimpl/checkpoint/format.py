"""The on-disk format of a refimpl checkpoint: rank files plus a manifest that describes them (chapter 09).

A checkpoint is a folder ``step_00000042/``::

    step_00000042/
      manifest.json      format version, step, world size, config, library versions, global state,
                         the sha256 and size of every file, and where every tensor's bytes lie
      rank_00000.pt      torch.save({"pieces": {"<name>@<start>": flat tensor}, "objects": per-rank state})
      rank_00001.pt      ...

**Tensors are described globally.** Every tensor has a global name (``model/blocks.0.mlp.fc.weight``),
a global shape and a dtype. A rank that holds part of it passes a :class:`FlatShard`: its local values
are the range ``[offset, offset + numel)`` of the *flattened* global tensor (a ZeRO/FSDP row shard of
rows ``[a, b)`` is the flat range ``[a * row_numel, b * row_numel)``; a replicated tensor is offset 0,
numel = all). When several ranks hold the same elements (data-parallel replicas), :func:`plan_pieces`
splits the overlap so each element is written exactly once and the bytes to write are balanced over the
ranks: a replicated tensor of ``n`` elements is written as ``W`` slices of ``n / W`` in parallel.

**Resharding is range arithmetic.** The manifest lists, for each tensor, its *pieces*: ``(file, start,
numel)``, sorted and covering ``[0, numel)`` exactly once. A rank that now needs the range ``[o, o + n)``
(at any world size, for any sharding) copies the intersection ``[max(o, s), min(o + n, s + m))`` of every
piece ``[s, s + m)`` that overlaps it (:func:`plan_read`). Nothing in the format depends on the world size
that wrote it.

**Trust.** The manifest records each file's sha256 and size and carries its own checksum (the sha256 of
its canonical JSON without that field). :func:`verify_checkpoint` rejects a missing manifest, a wrong
format version, a missing, truncated or altered file, and tensors whose shape differs from the expected,
each with a message that names the file or tensor. Rank files are read with ``weights_only=True`` (no
arbitrary code runs when a checkpoint is loaded), so per-rank objects are restricted to tensors, numbers,
strings and containers of them.

Why not ``torch.distributed.checkpoint`` (DCP)? It reshards too, but a flipped bit in a shard loads
silently (nothing verifies content) and its ``CheckpointException`` derives from ``BaseException``; the
course's format is small enough to read in one sitting and verifies every byte.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

FORMAT_NAME = "refimpl-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLIT_MIN_NUMEL = 1 << 16  # a replicated range shorter than (holders x this) is written by one rank


class CheckpointError(Exception):
    """A checkpoint cannot be written, found, verified or loaded; the message says which file and why.

    An ``Exception`` (unlike DCP's ``CheckpointException``, a ``BaseException``): ``except Exception``
    handlers and test harnesses see it.
    """


@dataclass(frozen=True, eq=False)
class FlatShard:
    """``tensor`` holds elements ``[offset, offset + tensor.numel())`` of the flattened global tensor."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        total = math.prod(self.global_shape)
        if self.numel and not 0 <= self.offset <= self.offset + self.numel <= total:
            raise CheckpointError(f"shard [{self.offset}, {self.offset + self.numel}) lies outside a global "
                                  f"tensor of shape {self.global_shape} ({total} elements)")

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    @classmethod
    def full(cls, tensor: torch.Tensor) -> FlatShard:
        """A tensor held whole (replicated on every rank that passes it)."""
        return cls(tensor, tuple(tensor.shape), 0)


def as_flat_shard(value: FlatShard | torch.Tensor) -> FlatShard:
    return value if isinstance(value, FlatShard) else FlatShard.full(value)


@dataclass(frozen=True)
class ShardMeta:
    """What one rank holds of one tensor: exchanged between ranks before a save."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int


def shard_metadata(shards: Mapping[str, FlatShard]) -> list[ShardMeta]:
    return [ShardMeta(name, s.global_shape, str(s.tensor.dtype).removeprefix("torch."), s.offset, s.numel)
            for name, s in sorted(shards.items())]


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dtype


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def piece_key(name: str, start: int) -> str:
    return f"{name}@{start}"


_PLAIN = (type(None), bool, int, float, str, torch.Tensor)


def check_plain(obj: Any, where: str) -> None:
    """Refuse what ``torch.load(weights_only=True)`` would refuse to read back (fail at save, not resume)."""
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where}: key {k!r} is a {type(k).__name__}; use str or int keys")
            check_plain(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(f"{where} is a {type(obj).__name__}; checkpoints store tensors, numbers, strings, "
                          "None and lists/tuples/dicts of them (convert it, e.g. a numpy array to a tensor)")
