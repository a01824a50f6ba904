"""Who writes which range, and who reads which: the two plans of a checkpoint (chapter 09).

:func:`plan_pieces` cuts every tensor's flat range at every shard boundary and gives each segment to one
writer (replicas split a long segment evenly, so the ranks write in parallel); :func:`snapshot_pieces`
copies this rank's pieces to CPU; :func:`plan_read` is resharding as range arithmetic: a reader of
``[o, o + n)`` copies the intersection ``[max(o, s), min(o + n, s + m))`` with every saved piece
``[s, s + m)``, whatever world size wrote it. The format they serve is in :mod:`refimpl.checkpoint.format`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from refimpl.checkpoint.format import (
    SPLIT_MIN_NUMEL,
    CheckpointError,
    FlatShard,
    ShardMeta,
    dtype_of,
    piece_key,
)


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
