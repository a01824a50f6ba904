"""Bytes in, batches out: the tokenizer, corpus preparation and rank-sharded resumable batches.

Chapter 01 introduces them; chapter 03 explains the sharding. Three ideas:

* **Tokenizer**: a byte is a token (vocabulary 256), so any text trains with no download.
* **Corpus**: text is encoded once into a flat ``uint8`` token file, read through ``numpy.memmap``, beside
  a manifest (token count, sha256 of the tokens, sources). The default corpus is Python's own standard
  library source (a fixed, sorted selection read from the running interpreter).
* **Batches are a pure function of (seed, step, rank, world size)**. The corpus is cut into windows of
  ``seq_len + 1`` tokens; every epoch the windows are permuted by ``randperm(seed, epoch)`` (the role of
  ``DistributedSampler.set_epoch``); step ``k`` takes the next ``global_batch_size`` windows of the
  permutation and data-parallel rank ``r`` takes rows ``[r*B/W, (r+1)*B/W)`` of them. So ranks never
  overlap, the global batch does not depend on the world size (a run at 4 ranks and one at 1 rank see the
  same tokens), and resuming at step ``k`` needs nothing but ``k``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
DEFAULT_CORPUS_BYTES = 4_000_000  # about 4 MB of stdlib source: plenty for the default run


class DataError(ValueError):
    """The corpus cannot be prepared or cannot feed the requested batches."""


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as int64 token ids in [0, 256)."""
    data = bytearray(text.encode("utf-8"))
    if not data:  # torch.frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(data, dtype=torch.uint8).long()


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Inverse of ``encode``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return bytes(int(t) for t in values).decode("utf-8", errors="replace")


def default_corpus_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """A fixed, sorted selection of ``.py`` files of the running interpreter's standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in stdlib.glob("*.py")  # top-level modules only: no tests, no site-packages
        if p.is_file()
    )
    chosen, total = [], 0
    for p in files:
        if total >= max_bytes:
            break
        chosen.append(p)
        total += p.stat().st_size
    if not chosen:
        raise DataError(f"no Python source found in the standard library folder {stdlib}")
    return chosen


def _source_files(data: str | None) -> list[Path]:
    if data is None:
        return default_corpus_files()
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(
            f"data path {str(path)!r} does not exist (give a text file or a folder of text files)"
        )
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise DataError(f"data folder {str(path)!r} holds no files")
    return files


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A prepared token file: ``tokens`` is a read-only uint8 memmap; ``manifest`` describes it."""

    tokens: np.ndarray
    manifest: dict
    path: Path

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def prepare_corpus(data: str | None = None, cache_dir: str | os.PathLike | None = None) -> Corpus:
    """Encode ``data`` (file, folder, or None for the stdlib corpus) once into ``cache_dir``; reuse it after.

    The token file is written to a temporary name and renamed, so concurrent ranks and interrupted runs
    never see half a file. A cached file whose sha256 no longer matches its manifest is rebuilt.
    """
    files = _source_files(data)
    default_cache = os.environ.get("REFIMPL_CACHE", Path.home() / ".cache" / "refimpl")
    cache = Path(cache_dir or default_cache).expanduser()
    key = hashlib.sha256()
    for f in files:
        st = f.stat()
        key.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    stem = cache / f"corpus-{key.hexdigest()[:16]}"
    token_path, manifest_path = stem.with_suffix(".bin"), stem.with_suffix(".json")

    if manifest_path.exists() and token_path.exists():
        manifest = json.loads(manifest_path.read_text())
        tokens = np.memmap(token_path, dtype=np.uint8, mode="r")
        if manifest.get("format_version") == FORMAT_VERSION and manifest.get("sha256") == _sha256(tokens):
            return Corpus(tokens=tokens, manifest=manifest, path=token_path)

    blob = b"".join(f.read_bytes() for f in files)
    if not blob:
        raise DataError(f"the corpus {data or 'stdlib'} is empty: nothing to train on")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = token_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(blob)
    os.replace(tmp, token_path)
    tokens = np.memmap(token_path, dtype=np.uint8, mode="r")
    manifest = {
        "format_version": FORMAT_VERSION,
        "token_count": int(tokens.shape[0]),
        "dtype": "uint8",
        "sha256": _sha256(tokens),
        "sources": [str(f) for f in files],
        "source": data or "python-stdlib",
    }
    tmp = manifest_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, manifest_path)
    return Corpus(tokens=tokens, manifest=manifest, path=token_path)


def _sha256(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens).data).hexdigest()


class ShardedBatches:
    """The batches of a run as a pure function of (seed, step, rank, world size); see the module docstring.

    ``batch(step, rank, world_size)`` returns ``(inputs, labels)``, each ``[B / world_size, seq_len]`` int64,
    with ``labels`` the inputs shifted by one token.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch_size: int, seed: int = 0) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // seq_len  # windows of seq_len + 1 tokens, stride seq_len
        if self.num_windows < global_batch_size:
            raise DataError(
                f"the corpus has {len(tokens):,} tokens = {self.num_windows} windows of {seq_len + 1} "
                f"tokens, "
                f"fewer than one global batch of {global_batch_size} sequences; use more data, a smaller "
                f"--batch-size or a shorter --seq-len"
            )
        self.steps_per_epoch = self.num_windows // global_batch_size

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_windows, generator=generator)  # [num_windows]

    def window_ids(self, step: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """Indices of the windows rank ``rank`` trains at ``step`` (disjoint across ranks)."""
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} outside a world of size {world_size}")
        if self.global_batch_size % world_size != 0:
            raise DataError(
                f"global batch size {self.global_batch_size} does not divide among {world_size} ranks"
            )
        epoch, position = divmod(step, self.steps_per_epoch)
        b = self.global_batch_size
        rows = self._permutation(epoch)[position * b : (position + 1) * b]  # [B] window ids of the step
        per_rank = self.global_batch_size // world_size
        return rows[rank * per_rank : (rank + 1) * per_rank]  # [B / W]

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.window_ids(step, rank, world_size)
        starts = ids.numpy() * self.seq_len
        rows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])  # [B/W, s+1]
        window = torch.from_numpy(rows.astype(np.int64))
        return window[:, :-1], window[:, 1:]  # inputs, labels: [B/W, s] each


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``batch`` (a CPU tensor) on ``device``, once per step: on a GPU copied through pinned (page-locked)
    memory with ``non_blocking=True``, so the host queues the copy and goes on to the step's kernels
    instead of waiting for it (a copy from pageable memory is staged and waited for); the kernels that read
    the batch run after the copy on the same stream. On a CPU the tensor itself, untouched."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def make_corpus_file(path: str | os.PathLike, *, num_bytes: int = 20_000, seed: int = 0) -> Path:
    """Write a small deterministic pseudo-text file (for tests and examples that need no real corpus)."""
    rng = np.random.default_rng(seed)
    words = ["the", "model", "rank", "tensor", "all", "reduce", "shard", "gradient", "step", "loss", "\n"]
    out, size = [], 0
    while size < num_bytes:
        w = words[int(rng.integers(len(words)))]
        out.append(w)
        size += len(w) + 1
    path = Path(path)
    path.write_text(" ".join(out)[:num_bytes])
    return path
