"""The on-disk format of a refimpl checkpoint: rank files plus a manifest that describes them (chapter 11).

A checkpoint is a folder ``step_00000042/``::

    step_00000042/
      manifest.json      format version, step, world size, config, library versions, global state,
                         the sha256 and size of every file, and where every tensor's bytes lie
      rank_00000.pt      torch.save({"pieces": {"<name>@<offsets>": the piece's box}, "objects": ...})
      rank_00001.pt      ...

**Tensors are described globally, pieces as boxes.** Every tensor has a global name
(``model/blocks.0.mlp.fc.weight``), a global shape and a dtype. A rank that holds part of it passes a
``refimpl.distributed.placement.LocalShard``: its local tensor holds the *box* ``global[o_0 : o_0 + s_0,
..., o_{n-1} : o_{n-1} + s_{n-1}]`` (a ``refimpl.distributed.placement.Box``, the one shard descriptor
of refimpl; a plain tensor is the full box, a ``DTensor`` the box of its placements). A ZeRO/FSDP row
shard is a box of rows (torch's ``fully_shard`` too: its padding is not saved); a row-parallel
tensor-parallel shard a box of *columns* (strided in memory, still one box); a 1-D range ``[a, b)`` is the
1-D box. When several ranks hold the same elements (data-parallel replicas), ``plan_pieces`` cuts every
dimension at every box boundary and gives each cell of that grid to one holder, splitting large replicated
cells among their holders so each element is written exactly once and the bytes to write are balanced:
a replicated tensor of ``n`` elements is written as ``W`` slabs of about ``n / W`` in parallel.

**Resharding is box intersection.** The manifest lists, for each tensor, its *pieces*: ``(file, offsets,
shape)``, disjoint boxes covering the tensor exactly once. A rank that now needs box ``R`` (at any world
size, for any sharding: rows, columns, a block) copies ``I = P ∩ R`` out of every piece ``P`` that meets it,
``out[I - R.offsets] = piece[I - P.offsets]`` (``refimpl.checkpoint.plan.plan_read``). Nothing in the
format depends on the world size or the layout that wrote it.

**Trust.** The manifest records each file's sha256 and size and carries its own checksum (the sha256 of
its canonical JSON without that field). ``verify_checkpoint`` rejects a missing manifest, a wrong
format version (a checkpoint of format version 1, flat ranges, is refused with one line naming both
versions), a missing, truncated or altered file, and tensors whose shape differs from the expected,
each with a message that names the file or tensor. Rank files are read with ``weights_only=True`` (no
arbitrary code runs when a checkpoint is loaded), so per-rank objects are restricted to tensors, numbers,
strings and containers of them.

Why not ``torch.distributed.checkpoint`` (DCP)? It reshards too, but a flipped bit in a shard loads
silently (nothing verifies content) and its ``CheckpointException`` derives from ``BaseException``; the
course's format is small enough to read in one sitting and verifies every byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refimpl.distributed.placement import Box, LocalShard, held_shard

FORMAT_NAME = "refimpl-checkpoint"
FORMAT_VERSION = 2  # 1: flat ranges of the flattened tensor; 2: N-D boxes (offsets + shape)
MANIFEST = "manifest.json"
SPLIT_MIN_NUMEL = 1 << 16  # a replicated cell smaller than (holders x this) is written by one rank


class CheckpointError(Exception):
    """A checkpoint cannot be written, found, verified or loaded; the message says which file and why.

    An ``Exception`` (unlike DCP's ``CheckpointException``, a ``BaseException``): ``except Exception``
    handlers and test harnesses see it.
    """


def as_local_shard(value: LocalShard | torch.Tensor) -> LocalShard:
    """A ``LocalShard`` as given, a DTensor as the box of its placements, a plain tensor held whole
    (``refimpl.distributed.placement.held_shard``)."""
    if isinstance(value, LocalShard):
        return value
    if isinstance(value, torch.Tensor):
        return held_shard(value)
    raise CheckpointError(f"a checkpoint saves tensors or LocalShards, not a {type(value).__name__}")


@dataclass(frozen=True)
class ShardMeta:
    """What one rank holds of one tensor (its box of the global tensor): exchanged before a save."""

    name: str
    dtype: str
    box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape."""
        return self.box.global_shape


def shard_metadata(shards: Mapping[str, LocalShard]) -> list[ShardMeta]:
    return [ShardMeta(name, str(s.tensor.dtype).removeprefix("torch."), s.box)
            for name, s in sorted(shards.items())]


def piece_box(global_shape: Sequence[int], piece: Mapping[str, Any]) -> Box:
    """The box of a manifest or plan piece (``{"offsets", "shape", ...}``)."""
    return Box(tuple(global_shape), tuple(piece["offsets"]), tuple(piece["shape"]))


def describe_box(box: Box) -> str:
    """``[0, 6) x [5, 10)``: the elements of a box, one half-open range per dimension."""
    ranges = [f"[{o}, {o + s})" for o, s in zip(box.offsets, box.shape, strict=True)]
    return " x ".join(ranges) or "the single element"


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dtype


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def piece_key(name: str, offsets: Sequence[int]) -> str:
    """A piece's key in its rank file: the tensor's name and the box's offsets, ``"w@0,5"``."""
    return f"{name}@{','.join(str(int(o)) for o in offsets)}"


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
