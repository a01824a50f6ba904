"""Which chunks of the sequence a rank holds: the contiguous and the zig-zag layouts (chapter 07).

The sequence is cut into equal chunks; ``layout`` says which chunks a rank holds (``chunk_ids``).
``"contiguous"``: ``n`` chunks, rank ``i`` holds chunk ``i``; under a causal mask rank ``i`` attends to
``i + 1`` blocks, so the last rank works ``n`` times as much as the first. ``"zigzag"`` (the load-balanced
split of Megatron-LM's context parallelism and Llama 3): ``2n`` chunks, rank ``i`` holds chunks ``i`` and
``2n - 1 - i`` (an early and a late one), and every rank does the same causal work (``causal_work``).
A (query chunk, key chunk) pair with the key chunk later than the query chunk is skipped, not computed;
equal chunks get the triangular mask; earlier ones none (``block_pairs``). Both layouts are exactly full
attention: ``refimpl.parallel.context_parallel.ring_attention.ring_attention`` on the split tensors
equals ``scaled_dot_product_attention`` on the whole sequence, split the same way.
"""

from __future__ import annotations

from typing import Literal

import torch

from refimpl.config import CP_LAYOUTS

Layout = Literal["zigzag", "contiguous"]
LAYOUTS = CP_LAYOUTS


def chunk_ids(*, cp_rank: int, cp_size: int, layout: Layout) -> tuple[int, ...]:
    """The global chunks rank ``cp_rank`` holds, in order: ``(i,)`` of ``n`` (contiguous) or ``(i, 2n-1-i)``
    of ``2n`` (zigzag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not in range({cp_size})")
    return (cp_rank,) if layout == "contiguous" else (cp_rank, 2 * cp_size - 1 - cp_rank)


def _n_chunks(cp_size: int, layout: Layout) -> int:
    return cp_size if layout == "contiguous" else 2 * cp_size


def _check_length(seq: int, cp_size: int, layout: Layout) -> int:
    """The chunk length; a one-line ValueError when ``seq`` does not cut into the layout's chunks."""
    n = _n_chunks(cp_size, layout)
    if seq % n:
        what = f"2*cp = {n}" if layout == "zigzag" else f"cp = {n}"
        raise ValueError(f"sequence length {seq} does not divide into {what} equal chunks ({layout} layout)")
    return seq // n


def split_sequence(x: torch.Tensor, *, dim: int, cp_rank: int, cp_size: int, layout: Layout) -> torch.Tensor:
    """Rank ``cp_rank``'s part of the sequence ``dim`` of ``x``: its chunks (``chunk_ids``), in order."""
    ids = chunk_ids(cp_rank=cp_rank, cp_size=cp_size, layout=layout)
    c = _check_length(x.shape[dim], cp_size, layout)
    return torch.cat([x.narrow(dim, i * c, c) for i in ids], dim=dim)  # [..., len(ids) * c, ...]


def zigzag_split(x: torch.Tensor, *, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Zig-zag: cut ``dim`` into ``2 cp`` chunks, keep chunks ``cp_rank`` and ``2 cp - 1 - cp_rank``."""
    return split_sequence(x, dim=dim, cp_rank=cp_rank, cp_size=cp_size, layout="zigzag")


def gather_sequence(parts: list[torch.Tensor], *, dim: int, layout: Layout) -> torch.Tensor:
    """The inverse of ``split_sequence``: the whole sequence from every rank's part, in rank order."""
    n = len(parts)
    chunks: dict[int, torch.Tensor] = {}
    for r, part in enumerate(parts):
        ids = chunk_ids(cp_rank=r, cp_size=n, layout=layout)
        chunks.update(zip(ids, part.chunk(len(ids), dim=dim), strict=True))
    return torch.cat([chunks[i] for i in range(_n_chunks(n, layout))], dim=dim)


def zigzag_gather(parts: list[torch.Tensor], *, dim: int) -> torch.Tensor:
    """The inverse of ``zigzag_split`` (tests, figures): the whole sequence from every rank's part."""
    return gather_sequence(parts, dim=dim, layout="zigzag")


def sequence_positions(*, seq_len: int, cp_rank: int, cp_size: int, layout: Layout) -> torch.Tensor:
    """The global positions of this rank's tokens (what position ids and the batch shard must follow)."""
    return split_sequence(torch.arange(seq_len), dim=0, cp_rank=cp_rank, cp_size=cp_size, layout=layout)


def block_pairs(q_ids: tuple[int, ...], k_ids: tuple[int, ...], *,
                causal: bool) -> list[tuple[int, int, bool]]:
    """The (query chunk, key chunk, diagonal?) pairs to compute, as local indices; under a causal mask a key
    chunk later than the query chunk is skipped and an equal one is masked (``diagonal=True``)."""
    return [(i, j, causal and kq == kk) for i, kq in enumerate(q_ids) for j, kk in enumerate(k_ids)
            if not causal or kk <= kq]


def causal_work(*, cp_size: int, layout: Layout) -> list[int]:
    """Per rank, the (query chunk, key chunk) pairs its causal ring attention computes over all steps.

    Chunks are the layout's: ``s/n`` tokens (contiguous) or ``s/(2n)`` (zigzag). Contiguous gives
    ``[1, 2, ..., n]`` (rank ``i`` sees ``i + 1`` blocks); zigzag gives ``2n + 1`` to every rank (chunk ``i``
    sees ``i + 1`` chunks, chunk ``2n - 1 - i`` sees ``2n - i``), ``(2n + 1)/4`` contiguous blocks' worth.
    """
    owned = [chunk_ids(cp_rank=r, cp_size=cp_size, layout=layout) for r in range(cp_size)]
    return [sum(len(block_pairs(owned[r], owned[src], causal=True)) for src in range(cp_size))
            for r in range(cp_size)]


__all__ = [
    "LAYOUTS",
    "block_pairs",
    "causal_work",
    "chunk_ids",
    "gather_sequence",
    "sequence_positions",
    "split_sequence",
    "zigzag_gather",
    "zigzag_split",
]
