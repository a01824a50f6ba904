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

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
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


def plan_pieces(metadata: Sequence[Sequence[ShardMeta]], *, split_min_numel: int = SPLIT_MIN_NUMEL,
                ) -> dict[str, dict]:
    """Decide which rank writes which range of every tensor: ``{name: {shape, dtype, pieces}}``.

    ``metadata[r]`` is what rank ``r`` holds. The global range of a tensor is cut at every shard boundary;
    each elementary segment is written by the ranks that hold it: split evenly among them when it is long
    (parallel writes), else by the holder with the fewest bytes so far. Pure and deterministic: every rank
    computes the same plan from the same gathered metadata, so a bad layout (shapes that disagree,
    elements no rank holds) raises the same error everywhere.
    """
    held: dict[str, list[tuple[int, ShardMeta]]] = {}
    for rank, metas in enumerate(metadata):
        for m in metas:
            held.setdefault(m.name, []).append((rank, m))
    load = [0] * len(metadata)
    plan: dict[str, dict] = {}
    for name in sorted(held):
        holders_of = held[name]
        shape, dtype = holders_of[0][1].shape, holders_of[0][1].dtype
        for rank, m in holders_of:
            if (m.shape, m.dtype) != (shape, dtype):
                raise CheckpointError(f"{name!r}: rank {holders_of[0][0]} says shape {shape} {dtype}, rank "
                                      f"{rank} says {m.shape} {m.dtype}")
        spans = [(r, m.offset, m.offset + m.numel) for r, m in holders_of if m.numel]
        total, itemsize = math.prod(shape), torch.empty((), dtype=dtype_of(dtype)).element_size()
        cuts = sorted({0, total} | {s for _, s, _ in spans} | {e for _, _, e in spans})
        pieces: list[dict] = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            ranks = [r for r, s, e in spans if s <= a and b <= e]
            if not ranks:
                raise CheckpointError(f"{name!r}: elements [{a}, {b}) of {total} are held by no rank")
            n, h = b - a, len(ranks)
            if h > 1 and n >= h * max(1, split_min_numel):
                parts = [(ranks[i], a + i * n // h, a + (i + 1) * n // h) for i in range(h)]
            else:
                owner = min(ranks, key=lambda r: (load[r], r))
                parts = [(owner, a, b)]
            for r, s, e in parts:
                load[r] += (e - s) * itemsize
                last = pieces[-1] if pieces else None
                if last and last["rank"] == r and last["start"] + last["numel"] == s:
                    last["numel"] += e - s
                else:
                    pieces.append({"rank": r, "start": s, "numel": e - s})
        plan[name] = {"shape": list(shape), "dtype": dtype, "pieces": pieces}
    return plan


def snapshot_pieces(shards: Mapping[str, FlatShard], plan: Mapping[str, dict], rank: int,
                    ) -> dict[str, torch.Tensor]:
    """CPU copies of the ranges this rank writes. Copies, never views: ``torch.save`` of a view writes the
    view's whole storage, and an asynchronous save must not see later in-place updates."""
    out = {}
    for name, entry in plan.items():
        for p in entry["pieces"]:
            if p["rank"] != rank:
                continue
            shard = shards[name]
            flat = shard.tensor.detach().reshape(-1)
            lo = p["start"] - shard.offset
            out[piece_key(name, p["start"])] = flat[lo : lo + p["numel"]].to("cpu", copy=True)
    return out


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


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def build_manifest(*, step: int, world_size: int, plan: Mapping[str, dict], files: Mapping[str, dict],
                   state: Mapping[str, Any], config: Mapping[str, Any] | None, versions: Mapping[str, Any],
                   ) -> dict:
    entries = {
        name: {"shape": e["shape"], "dtype": e["dtype"],
               "pieces": [{"file": rank_file_name(p["rank"]), "start": p["start"], "numel": p["numel"]}
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
                              f"version {FORMAT_VERSION})")
    if manifest.get("manifest_sha256") != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise CheckpointError(f"{path}: its checksum does not match its content (the manifest was altered)")
    return manifest


def _check_entries(manifest: Mapping[str, Any], where: Path) -> None:
    files = manifest["files"]
    for name, e in manifest["entries"].items():
        pos = 0
        for p in e["pieces"]:
            if p["file"] not in files or p["start"] != pos or p["numel"] <= 0:
                raise CheckpointError(f"{where}: the pieces of {name!r} do not tile it (bad manifest)")
            pos += p["numel"]
        if pos != math.prod(e["shape"]):
            raise CheckpointError(f"{where}: the pieces of {name!r} cover {pos} of {math.prod(e['shape'])} "
                                  "elements (bad manifest)")


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
    """Check a checkpoint folder; return its manifest or raise :class:`CheckpointError` saying why not.

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


def plan_read(pieces: Sequence[Mapping[str, Any]], start: int, numel: int) -> list[tuple[int, int, int, int]]:
    """Resharding as range arithmetic: what a reader of the flat range ``[start, start + numel)`` copies.

    ``pieces`` are a manifest entry's pieces (``{"start", "numel", ...}``, sorted, tiling the tensor). The
    result lists, for every piece ``[s, s + m)`` that overlaps the range, ``(piece index, offset in the
    piece, offset in the range, length)`` of the intersection ``[max(s, start), min(s + m, start + numel))``,
    in order; pieces that only touch the range at an end are left out.
    """
    end, out = start + numel, []
    for index, p in enumerate(pieces):
        s = p["start"]
        lo, hi = max(s, start), min(s + p["numel"], end)
        if lo < hi:
            out.append((index, lo - s, lo - start, hi - lo))
    return out


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
