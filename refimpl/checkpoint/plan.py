"""Who writes which box, and who reads which: the two plans of a checkpoint (chapter 11).

``plan_pieces`` cuts every dimension of every tensor at every box boundary the ranks hold, so the
tensor becomes a grid of cells each of which lies either wholly inside or wholly outside every rank's box;
each cell goes to one of its holders (replicas split a large cell along its longest dimension, so the ranks
write in parallel), and cells of one writer that follow each other along a dimension are merged.
``snapshot_pieces`` copies this rank's pieces to CPU. ``plan_read`` is resharding as box
intersection: a reader of box ``R`` copies ``I = P ∩ R`` out of every saved piece ``P`` that meets it,
``out[I.slices(R)] = piece[I.slices(P)]``, whatever world size or layout wrote it (a 1-D range is the 1-D
box). The format they serve is in ``refimpl.checkpoint.format``; ``Box`` in
``refimpl.distributed.placement``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from refimpl.checkpoint.format import (
    SPLIT_MIN_NUMEL,
    CheckpointError,
    ShardMeta,
    describe_box,
    dtype_of,
    piece_box,
    piece_key,
)
from refimpl.distributed.placement import Box, LocalShard


def _contains(outer: Box, inner: Box) -> bool:
    return all(o <= i and i + s <= o + t for o, t, i, s in
               zip(outer.offsets, outer.shape, inner.offsets, inner.shape, strict=True))


def _cells(shape: tuple[int, ...], boxes: Sequence[Box]) -> list[Box]:
    """The grid cut at every box boundary in every dimension, cells in lexicographic order of offsets."""
    cuts = [sorted({0, size} | {b.offsets[d] for b in boxes} | {b.offsets[d] + b.shape[d] for b in boxes})
            for d, size in enumerate(shape)]
    spans = [list(zip(c, c[1:], strict=False)) for c in cuts]
    return [Box(shape, tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
            for cell in itertools.product(*spans)]


def _split(cell: Box, ranks: list[int]) -> list[tuple[int, Box]]:
    """A replicated cell cut along its longest dim into ``len(ranks)`` slabs, one per holder."""
    dim = max(range(cell.ndim), key=lambda d: (cell.shape[d], -d))
    n, h = cell.shape[dim], len(ranks)
    parts = [(ranks[i], i * n // h, (i + 1) * n // h) for i in range(h)]
    return [(r, cell.narrow(dim, a, b - a)) for r, a, b in parts if b > a]


def _join(a: Box, b: Box, dim: int) -> Box | None:
    """``a`` and ``b`` as one box when ``b`` follows ``a`` along ``dim`` with the same extents elsewhere."""
    others = [d for d in range(a.ndim) if d != dim]
    if (any((a.offsets[d], a.shape[d]) != (b.offsets[d], b.shape[d]) for d in others)
            or a.offsets[dim] + a.shape[dim] != b.offsets[dim]):
        return None
    shape = list(a.shape)
    shape[dim] += b.shape[dim]
    return Box(a.global_shape, a.offsets, tuple(shape))


def _merge(pieces: list[tuple[int, Box]]) -> list[tuple[int, Box]]:
    """Join pieces of one writer that follow each other along a dim with equal extents in the others (the
    last dim first, then the ones before it down to dim 0): fewer, larger pieces."""
    ndim = pieces[0][1].ndim if pieces else 0
    for dim in reversed(range(ndim)):
        merged: list[tuple[int, Box]] = []
        for r, box in sorted(pieces, key=lambda rp: (rp[0], *rp[1].offsets[:dim], *rp[1].offsets[dim + 1 :],
                                                     rp[1].offsets[dim])):
            joined = _join(merged[-1][1], box, dim) if merged and merged[-1][0] == r else None
            if joined is None:
                merged.append((r, box))
            else:
                merged[-1] = (r, joined)
        pieces = merged
    return sorted(pieces, key=lambda rp: rp[1].offsets)


def plan_pieces(metadata: Sequence[Sequence[ShardMeta]], *, split_min_numel: int = SPLIT_MIN_NUMEL,
                ) -> dict[str, dict]:
    """Decide which rank writes which box of every tensor: ``{name: {shape, dtype, pieces}}``, each piece
    ``{"rank", "offsets", "shape"}``.

    ``metadata[r]`` is what rank ``r`` holds (a box per tensor). Every dimension is cut at every box
    boundary; each cell of the grid is written by a rank that holds it: split evenly among its holders along
    its longest dim when it has at least ``holders x split_min_numel`` elements (parallel writes), else by
    the holder with the fewest bytes so far. Every element is written exactly once. Pure and deterministic:
    every rank computes the same plan from the same gathered metadata, so a bad layout (shapes or dtypes
    that disagree, elements no rank holds) raises the same error everywhere.
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
        boxes = [(r, m.box) for r, m in holders_of if m.box.numel]
        itemsize = torch.empty((), dtype=dtype_of(dtype)).element_size()
        pieces: list[tuple[int, Box]] = []
        for cell in _cells(shape, [b for _, b in boxes]):
            ranks = [r for r, b in boxes if _contains(b, cell)]
            if not ranks:
                raise CheckpointError(f"{name!r}: elements {describe_box(cell)} of a tensor of shape {shape} "
                                      "are held by no rank")
            h = len(ranks)
            if h > 1 and cell.numel >= h * max(1, split_min_numel):
                parts = _split(cell, ranks)
            else:
                parts = [(min(ranks, key=lambda r: (load[r], r)), cell)]
            for r, part in parts:
                load[r] += part.numel * itemsize
            pieces.extend(parts)
        plan[name] = {"shape": list(shape), "dtype": dtype,
                      "pieces": [{"rank": r, "offsets": list(b.offsets), "shape": list(b.shape)}
                                 for r, b in _merge(pieces)]}
    return plan


def snapshot_pieces(shards: Mapping[str, LocalShard], plan: Mapping[str, dict], rank: int,
                    ) -> dict[str, torch.Tensor]:
    """Compact CPU copies of the boxes this rank writes. Copies, never views: ``torch.save`` of a view
    writes the view's whole storage, and an asynchronous save must not see later in-place updates."""
    out = {}
    for name, entry in plan.items():
        for p in entry["pieces"]:
            if p["rank"] != rank:
                continue
            shard = shards[name]
            part = piece_box(entry["shape"], p)
            local = shard.tensor.detach()[part.slices(shard.box)]
            out[piece_key(name, p["offsets"])] = torch.empty(part.shape, dtype=local.dtype).copy_(local)
    return out


def plan_read(pieces: Sequence[Mapping[str, Any]], want: Box) -> list[tuple[int, Box]]:
    """Resharding as box intersection: what a reader of box ``want`` copies out of the saved pieces.

    ``pieces`` are a manifest entry's pieces (``{"offsets", "shape", ...}``: disjoint boxes of a tensor of
    shape ``want.global_shape`` that tile it). The result lists, in piece order, ``(piece index, I)`` for
    every piece ``P`` that shares at least one element with ``want``, ``I = P ∩ want``; copying
    ``out[I.slices(want)] = piece[I.slices(P)]`` for each fills ``out`` (a tensor holding ``want``) exactly
    once.
    """
    out = []
    for index, p in enumerate(pieces):
        common = piece_box(want.global_shape, p).intersection(want)
        if common is not None and common.numel:
            out.append((index, common))
    return out
