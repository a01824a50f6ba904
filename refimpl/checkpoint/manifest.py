"""The manifest: what a checkpoint holds, and the checks that make it trusted (chapter 11).

``manifest.json`` records the format version, step, world size, config, library versions, the global
state, every file's sha256 and size, and where every tensor's pieces lie (per piece its file and its box:
offsets and shape); it carries its own checksum (the sha256 of its canonical JSON without that field).
``verify_checkpoint`` rejects a missing manifest, a wrong format version (one line naming the
checkpoint's version and the one this reader reads), pieces that do not tile their tensor, a missing,
truncated or altered file, and unexpected shapes, each with a message that names the file or tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from refimpl.checkpoint.files import sha256_file
from refimpl.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    piece_box,
    rank_file_name,
)
from refimpl.distributed.placement import Box


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def build_manifest(*, step: int, world_size: int, plan: Mapping[str, dict], files: Mapping[str, dict],
                   state: Mapping[str, Any], config: Mapping[str, Any] | None, versions: Mapping[str, Any],
                   ) -> dict:
    entries = {
        name: {"shape": e["shape"], "dtype": e["dtype"],
               "pieces": [{"file": rank_file_name(p["rank"]), "offsets": p["offsets"], "shape": p["shape"]}
                          for p in e["pieces"]]}
        for name, e in plan.items()
    }
    manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step,
                "world_size": world_size, "library_versions": dict(versions), "config": config,
                "state": dict(state), "files": dict(files), "entries": entries}
    manifest["manifest_sha256"] = hashlib.sha256(_canonical(manifest)).hexdigest()
    return manifest


def write_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> dict:
    """Parse and check the manifest of ``folder`` (presence, JSON, own checksum, format and version)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (the save never committed, or the folder was damaged)")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a {FORMAT_NAME} manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version!r} is not supported (this refimpl reads "
                              f"version {FORMAT_VERSION} only; version 1 stored flat ranges, 2 stores boxes)")
    if manifest.get("manifest_sha256") != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise CheckpointError(f"{path}: its checksum does not match its content (the manifest was altered)")
    return manifest


def _check_entries(manifest: Mapping[str, Any], where: Path) -> None:
    """Every tensor's pieces are boxes of it in known files, pairwise disjoint, covering every element."""
    files = manifest["files"]
    for name, e in manifest["entries"].items():
        boxes: list[Box] = []
        for p in e["pieces"]:
            try:
                box = piece_box(e["shape"], p)
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{where}: a piece of {name!r} is not a box of it ({exc}; bad "
                                      "manifest)") from None
            if p.get("file") not in files or box.numel == 0:
                raise CheckpointError(f"{where}: the pieces of {name!r} do not tile it (bad manifest)")
            if any(other.intersection(box) is not None for other in boxes):
                raise CheckpointError(f"{where}: two pieces of {name!r} overlap at {box.offsets} (bad "
                                      "manifest)")
            boxes.append(box)
        covered, total = sum(b.numel for b in boxes), math.prod(e["shape"])
        if covered != total:
            raise CheckpointError(f"{where}: the pieces of {name!r} cover {covered} of {total} elements "
                                  "(bad manifest)")


def check_expected(manifest: Mapping[str, Any], expected: Mapping[str, Sequence[int]], where: Path) -> None:
    entries = manifest["entries"]
    for name, shape in expected.items():
        if name not in entries:
            raise CheckpointError(f"{where}: no tensor {name!r} (is it a checkpoint of another model?)")
        if tuple(entries[name]["shape"]) != tuple(shape):
            raise CheckpointError(f"{where}: {name!r} has shape {tuple(entries[name]['shape'])} but "
                                  f"{tuple(shape)} is expected (a different model configuration?)")


def verify_checkpoint(folder: str | os.PathLike, *, expected: Mapping[str, Sequence[int]] | None = None,
                      share: tuple[int, int] = (0, 1)) -> dict:
    """Check a checkpoint folder; return its manifest or raise ``CheckpointError`` saying why not.

    Checks the manifest (present, its checksum, format version), that the pieces tile every tensor,
    that the ``expected`` tensors exist with those shapes, that every file exists with its recorded size,
    and the sha256 of the files in ``share = (rank, world)``: file ``i`` (sorted) is hashed by rank
    ``i % world``, so several ranks verify a large checkpoint in parallel; ``(0, 1)`` hashes all.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    _check_entries(manifest, folder)
    if expected:
        check_expected(manifest, expected, folder)
    rank, world = share
    for i, (name, record) in enumerate(sorted(manifest["files"].items())):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, the manifest says {record['bytes']} "
                                  f"({'truncated' if size < record['bytes'] else 'overwritten'})")
        if i % world == rank and sha256_file(path) != record["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch, its content changed after the save (a flipped "
                                  "bit, a partial write or an edit)")
    return manifest


def library_versions() -> dict[str, str | None]:
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "cuda": torch.version.cuda, "format_version": str(FORMAT_VERSION)}
