"""The bytes on disk: fsync, sha256, a rank's file written and read back (chapter 11).

A rank file is ``torch.save({"format_version", "pieces": {"<name>@<offsets>": tensor of the piece's box},
"objects"})``, fsynced before its sha256 and size are reported (``write_rank_file``).
``CheckpointReader`` opens the files of a verified checkpoint (mmap, ``weights_only=True``: no code
runs on load) and copies boxes of global tensors out of them by box intersection
(``refimpl.checkpoint.plan.plan_read``), into any tensor that holds the box, strided ones included (a
column block is a view with a row stride: the copy goes through ``tensor[slices]``, never ``.view(-1)``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from refimpl.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointError,
    as_local_shard,
    describe_box,
    dtype_of,
    piece_box,
    piece_key,
    rank_file_name,
)
from refimpl.checkpoint.plan import plan_read
from refimpl.distributed.placement import Box, LocalShard


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a created or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_rank_file(path: Path, pieces: Mapping[str, torch.Tensor], objects: Any) -> dict:
    """Write one rank's file, fsync it, and return ``{"sha256", "bytes"}`` of what is on disk."""
    with open(path, "wb") as f:
        torch.save({"format_version": FORMAT_VERSION, "pieces": dict(pieces), "objects": objects}, f)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


class CheckpointReader:
    """Reads ranges of global tensors out of a verified checkpoint; files are opened (mmap) on demand."""

    def __init__(self, folder: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        self._files: dict[str, dict] = {}

    def _file(self, name: str) -> dict:
        if name not in self._files:
            try:
                self._files[name] = torch.load(self.folder / name, map_location="cpu", mmap=True,
                                               weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unreadable file becomes one clear error
                raise CheckpointError(f"{self.folder / name} cannot be read ({type(exc).__name__}: "
                                      f"{exc})") from exc
        return self._files[name]

    def entry(self, name: str, shape: Sequence[int] | None = None) -> dict:
        entry = self.manifest["entries"].get(name)
        if entry is None:
            raise CheckpointError(f"{self.folder}: no tensor {name!r} in this checkpoint")
        if shape is not None and tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(f"{self.folder}: {name!r} has shape {tuple(entry['shape'])}, "
                                  f"{tuple(shape)} was asked for")
        return entry

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """The box ``box`` (None: the whole tensor) of the global tensor ``name``, in the saved dtype."""
        entry = self.entry(name)
        box = Box.full(entry["shape"]) if box is None else box
        out = torch.empty(box.shape, dtype=dtype_of(entry["dtype"]))
        self._copy_into(name, entry, box, out)
        return out

    def _copy_into(self, name: str, entry: Mapping[str, Any], box: Box, target: torch.Tensor) -> None:
        """``target`` (holding ``box``) gets ``piece[I.slices(P)]`` at ``I.slices(box)`` for each piece."""
        shape = tuple(entry["shape"])
        if box.global_shape != shape:
            raise CheckpointError(f"{self.folder}: {name!r} has shape {shape}, a box of a "
                                  f"{box.global_shape} tensor was asked for")
        filled = 0
        for index, common in plan_read(entry["pieces"], box):
            p = entry["pieces"][index]
            src = self._file(p["file"])["pieces"][piece_key(name, p["offsets"])]
            target[common.slices(box)].copy_(src[common.slices(piece_box(shape, p))])
            filled += common.numel
        if filled != box.numel:
            raise CheckpointError(f"{name!r}: only {filled} of the {box.numel} elements of "
                                  f"{describe_box(box)} found")

    def load_into(self, shards: Mapping[str, LocalShard | torch.Tensor]) -> None:
        """Copy each shard's box into its tensor, in place (any strides: a column block is fine)."""
        with torch.no_grad():
            for name, value in shards.items():
                shard = as_local_shard(value)
                self._copy_into(name, self.entry(name, shard.global_shape), shard.box, shard.tensor)

    def rank_objects(self, rank: int) -> Any:
        """The per-rank objects rank ``rank`` saved, or None when the checkpoint had fewer ranks."""
        name = rank_file_name(rank)
        return self._file(name)["objects"] if name in self.manifest["files"] else None

    def close(self) -> None:
        self._files.clear()
