"""The bytes on disk: fsync, sha256, a rank's file written and read back (chapter 09).

A rank file is ``torch.save({"format_version", "pieces": {"<name>@<start>": flat tensor}, "objects"})``,
fsynced before its sha256 and size are reported (:func:`write_rank_file`). :class:`CheckpointReader`
opens the files of a verified checkpoint (mmap, ``weights_only=True``: no code runs on load) and copies
ranges of global tensors out of them, following :func:`~refimpl.checkpoint.plan.plan_read`.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from refimpl.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointError,
    FlatShard,
    as_flat_shard,
    dtype_of,
    piece_key,
    rank_file_name,
)
from refimpl.checkpoint.plan import plan_read


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

    def read(self, name: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened global tensor ``name`` (1-D, saved dtype)."""
        entry = self.entry(name)
        total = math.prod(entry["shape"])
        numel = total - start if numel is None else numel
        if not 0 <= start <= start + numel <= total:
            raise CheckpointError(f"range [{start}, {start + numel}) outside {name!r} ({total} elements)")
        out = torch.empty(numel, dtype=dtype_of(entry["dtype"]))
        filled = 0
        for index, src_at, dst_at, n in plan_read(entry["pieces"], start, numel):
            p = entry["pieces"][index]
            src = self._file(p["file"])["pieces"][piece_key(name, p["start"])]
            out[dst_at : dst_at + n].copy_(src[src_at : src_at + n])
            filled += n
        if filled != numel:
            raise CheckpointError(f"{name!r}: only {filled} of {numel} requested elements found")
        return out

    def load_into(self, shards: Mapping[str, FlatShard | torch.Tensor]) -> None:
        """Copy each shard's range into its tensor, in place (the tensors must be contiguous)."""
        with torch.no_grad():
            for name, value in shards.items():
                shard = as_flat_shard(value)
                self.entry(name, shard.global_shape)
                if not shard.tensor.is_contiguous():
                    raise CheckpointError(f"{name!r}: loading in place needs a contiguous tensor")
                shard.tensor.view(-1).copy_(self.read(name, shard.offset, shard.numel))

    def rank_objects(self, rank: int) -> Any:
        """The per-rank objects rank ``rank`` saved, or None when the checkpoint had fewer ranks."""
        name = rank_file_name(rank)
        return self._file(name)["objects"] if name in self.manifest["files"] else None

    def close(self) -> None:
        self._files.clear()
