"""Ring attention: exact attention over a sequence split across the ranks of a ring (chapter 07).

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context". Each of the ``n``
ranks of the context-parallel group holds ``s/n`` tokens of the queries, keys and values, ``[b, a, s/n, d]``.
The K/V blocks travel round the ring (:mod:`.context_parallel_communications`); at each of the ``n`` steps a
rank attends its queries to the block it holds while the next one is on the wire. Softmax over the whole
row is recovered exactly from partial results, as FlashAttention merges tiles (the online softmax): a
block gives ``o_j = softmax(S_j) V_j`` and ``lse_j = log sum_k exp(S_j)_k`` (``S = q k^T / sqrt(d)``),
and two partial results merge as

    lse = logaddexp(lse_1, lse_2),    o = e^(lse_1 - lse) o_1 + e^(lse_2 - lse) o_2,

which is associative, so the order the blocks arrive in does not matter (:func:`merge_partial_attention`).
Blocks are computed in float32 (or the inputs' wider dtype), scores explicitly, with autocast off inside
(under the caller's bf16/fp16 autocast too): on CPU the sizes are tiny. The output returns in the inputs'
dtype; the saved output and log-sum-exp and the travelling dK/dV are float32.

Backward is a ring too (as in ring-flash-attention and picotron's ring backward): with the
saved row ``lse`` and ``D = rowsum(dO * O)`` each block's ``P = exp(S - lse)`` is rebuilt, and
``dV_j += P^T dO``, ``dS = P (dO V_j^T - D)``, ``dQ += dS K_j / sqrt(d)``, ``dK_j += dS^T Q / sqrt(d)``.
dQ accumulates where it is; the K/V blocks travel the ring again, and the partial dK/dV of each block
travels behind it, picking up one rank's contribution per hop, ``n - 1`` hops, and arrives back at its owner,
which adds its own. Per rank: forward sends ``n - 1`` K/V blocks, ``(n - 1)/n`` of the whole sequence's K and
V; backward the same again plus as much in dK/dV.

Layouts and the causal mask. The sequence is cut into equal chunks; ``layout`` says which chunks a rank
holds (:func:`chunk_ids`). ``"contiguous"``: ``n`` chunks, rank ``i`` holds chunk ``i``; under a causal mask
rank ``i`` attends to ``i + 1`` blocks, so the last rank works ``n`` times as much as the first.
``"zigzag"``: ``2n`` chunks, rank ``i`` holds chunks ``i`` and ``2n - 1 - i`` (an early and a late one), and
every rank does the same causal work (:func:`causal_work`). A (query chunk, key chunk) pair with the key
chunk later than the query chunk is skipped, not computed; equal chunks get the triangular mask; earlier
ones none. Both layouts are exactly full attention: ``ring_attention`` on the split tensors equals
``scaled_dot_product_attention`` on the whole sequence, split the same way.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from refimpl.comm.tracer import now
from refimpl.config import CP_LAYOUTS
from refimpl.parallel.context_parallel.context_parallel_communications import (
    Group,
    cp_rank,
    cp_size,
    ring_exchange,
)
from refimpl.parallel.context_parallel.ring_timeline import RingTimeline

Layout = Literal["zigzag", "contiguous"]
LAYOUTS = CP_LAYOUTS
SEQ_DIM = 2
"""The sequence dim of the ``[batch, heads, seq, head_dim]`` blocks attention works on."""


# ---- which chunks a rank holds -----------------------------------------------------------------------------


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
    """Rank ``cp_rank``'s part of the sequence ``dim`` of ``x``: its chunks (:func:`chunk_ids`), in order."""
    ids = chunk_ids(cp_rank=cp_rank, cp_size=cp_size, layout=layout)
    c = _check_length(x.shape[dim], cp_size, layout)
    return torch.cat([x.narrow(dim, i * c, c) for i in ids], dim=dim)  # [..., len(ids) * c, ...]


def zigzag_split(x: torch.Tensor, *, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Zig-zag: cut ``dim`` into ``2 cp`` chunks, keep chunks ``cp_rank`` and ``2 cp - 1 - cp_rank``."""
    return split_sequence(x, dim=dim, cp_rank=cp_rank, cp_size=cp_size, layout="zigzag")


def gather_sequence(parts: list[torch.Tensor], *, dim: int, layout: Layout) -> torch.Tensor:
    """The inverse of :func:`split_sequence`: the whole sequence from every rank's part, in rank order."""
    n = len(parts)
    chunks: dict[int, torch.Tensor] = {}
    for r, part in enumerate(parts):
        ids = chunk_ids(cp_rank=r, cp_size=n, layout=layout)
        chunks.update(zip(ids, part.chunk(len(ids), dim=dim), strict=True))
    return torch.cat([chunks[i] for i in range(_n_chunks(n, layout))], dim=dim)


def zigzag_gather(parts: list[torch.Tensor], *, dim: int) -> torch.Tensor:
    """The inverse of :func:`zigzag_split` (tests, figures): the whole sequence from every rank's part."""
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


# ---- one block, forward and backward, and the merge --------------------------------------------------------


def _future_mask(n: int, device: torch.device) -> torch.Tensor:
    """``[n, n]``, True where the key comes after the query (the diagonal block of a causal mask)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def _scores(q: torch.Tensor, k: torch.Tensor, *, scale: float, diagonal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * scale                         # [b, a, c_q, c_k]
    return s.masked_fill(_future_mask(s.shape[-1], s.device), float("-inf")) if diagonal else s


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(S) V, logsumexp(S))`` of one block, ``S = q k^T scale`` masked above the diagonal when
    ``diagonal``: ``[b, a, c, d]`` and ``[b, a, c]``."""
    s = _scores(q, k, scale=scale, diagonal=diagonal)
    row_max = s.amax(dim=-1, keepdim=True)                      # [b, a, c_q, 1]: finite, the diagonal is kept
    e = torch.exp(s - row_max)
    total = e.sum(dim=-1, keepdim=True)
    return (e @ v) / total, (row_max + torch.log(total)).squeeze(-1)


def merge_partial_attention(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                            block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exp rule: ``lse = logaddexp(lse_1, lse_2)``, ``o = e^(lse_1-lse) o_1 + e^(lse_2-lse) o_2``
    (the first block of a row: ``out`` None, returned as it is).

    Computed as ``o = o_1 - sigmoid(lse_2 - lse_1) (o_1 - o_2)``, the same number (``e^(lse_2 - lse) =
    sigmoid(lse_2 - lse_1)``, the weights summing to 1) with one rounded weight instead of two, each off
    by ``ulp(lse)``: it rounds like one-device attention (ring-flash-attention's merge, zhuzilin PR 34)."""
    if out is None or lse is None:
        return block_out, block_lse
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)      # e^(lse_2 - lse): [b, a, c, 1]
    return out - weight * (out - block_out), torch.logaddexp(lse, block_lse)


def block_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             lse: torch.Tensor, delta: torch.Tensor, *, scale: float, diagonal: bool):
    """``(dQ, dK, dV)`` of one block given the whole row's ``lse`` and ``delta = rowsum(dO * O)``."""
    p = torch.exp(_scores(q, k, scale=scale, diagonal=diagonal) - lse.unsqueeze(-1))  # [b, a, c_q, c_k]
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do


# ---- the ring ----------------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    """Forward and backward rings of :func:`ring_attention` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group: Group, causal: bool, layout: Layout, scale: float,
                timeline: RingTimeline | None):
        # the blocks in float32 under the caller's autocast too (its matmuls would round them to 16 bits)
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._forward(ctx, q, k, v, group, causal, layout, scale, timeline)

    @staticmethod
    def _forward(ctx, q, k, v, group: Group, causal: bool, layout: Layout, scale: float,
                 timeline: RingTimeline | None):
        n, r = cp_size(group), cp_rank(group)
        owned = [chunk_ids(cp_rank=i, cp_size=n, layout=layout) for i in range(n)]
        m, cdt = len(owned[r]), torch.promote_types(q.dtype, torch.float32)
        qs = q.to(cdt).chunk(m, dim=SEQ_DIM)                   # m x [b, a, c, d]
        outs: list = [None] * m
        lses: list = [None] * m
        kv = (k, v)
        for step in range(n):
            posted = now()
            transfer = ring_exchange(kv, group=group, step=step) if step < n - 1 else None
            begin = now()
            ks, vs = (t.to(cdt).chunk(m, dim=SEQ_DIM) for t in kv)
            for i, j, diagonal in block_pairs(owned[r], owned[(r - step) % n], causal=causal):
                o, lse = block_attention(qs[i], ks[j], vs[j], scale=scale, diagonal=diagonal)
                outs[i], lses[i] = merge_partial_attention(outs[i], lses[i], o, lse)
            computed = now()
            if transfer is not None:
                kv = transfer.wait()
            if timeline is not None:  # chapter 07's figure: what the transfer of this step overlapped
                timeline.add("compute", step, begin, computed)
                if transfer is not None:
                    timeline.add("transfer", step, posted, now())
        out, lse = torch.cat(outs, dim=SEQ_DIM), torch.cat(lses, dim=SEQ_DIM)  # [b, a, s/n, d], [b, a, s/n]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, layout, scale)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout, scale = ctx.args
        n, r = cp_size(group), cp_rank(group)
        owned = [chunk_ids(cp_rank=i, cp_size=n, layout=layout) for i in range(n)]
        m, cdt = len(owned[r]), out.dtype
        do = dout.to(cdt)
        delta = (do * out).sum(-1)                             # [b, a, s/n]
        qs, dos = q.to(cdt).chunk(m, dim=SEQ_DIM), do.chunk(m, dim=SEQ_DIM)
        lses, deltas = lse.chunk(m, dim=SEQ_DIM), delta.chunk(m, dim=SEQ_DIM)
        dq = torch.zeros_like(q, dtype=cdt)
        dqs = dq.chunk(m, dim=SEQ_DIM)                         # views: += accumulates into dq
        kv, own, behind = (k, v), None, None                   # behind: the partial dK/dV arriving from left
        for step in range(n):
            transfer = ring_exchange(kv, group=group, step=step) if step < n - 1 else None
            ks, vs = (t.to(cdt).chunk(m, dim=SEQ_DIM) for t in kv)
            dk, dv = torch.zeros_like(kv[0], dtype=cdt), torch.zeros_like(kv[1], dtype=cdt)
            dks, dvs = dk.chunk(m, dim=SEQ_DIM), dv.chunk(m, dim=SEQ_DIM)
            for i, j, diagonal in block_pairs(owned[r], owned[(r - step) % n], causal=causal):
                gq, gk, gv = block_attention_backward(dos[i], qs[i], ks[j], vs[j], lses[i], deltas[i],
                                                      scale=scale, diagonal=diagonal)
                dqs[i].add_(gq)
                dks[j].add_(gk)
                dvs[j].add_(gv)
            if step == 0:
                own = (dk, dv)                                 # my own block's share: kept, added at the end
            else:
                if behind is not None:
                    pk, pv = behind.wait()
                    dk, dv = dk + pk, dv + pv
                behind = ring_exchange((dk, dv), group=group, step=step)  # on to the next holder of the block
            if transfer is not None:
                kv = transfer.wait()
        dk, dv = own
        if behind is not None:                                 # n - 1 hops: my block's dK/dV is back
            pk, pv = behind.wait()
            dk, dv = dk + pk, dv + pv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group: Group, causal: bool,
                   layout: Layout = "zigzag", scale: float | None = None,
                   timeline: RingTimeline | None = None) -> torch.Tensor:
    """Exact attention of the local queries over the whole sequence split across ``cp_group``.

    ``q, k, v``: this rank's ``[b, a, s/n, d]`` blocks (``v`` may have another head dim), the sequence split
    by ``layout`` (:func:`split_sequence`); returns this rank's ``[b, a, s/n, d_v]`` of
    ``scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale)`` on the whole sequence. A group
    of one is plain SDPA. ``timeline``: records the forward's compute and transfer spans per ring step
    (:class:`~refimpl.parallel.context_parallel.ring_timeline.RingTimeline`). Liu et al. 2023; chapter 07.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"ring_attention needs [b, a, s/cp, d] blocks, k like q, v of the same b, a, s: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    n = cp_size(cp_group)
    if n == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    _check_length(n * q.shape[SEQ_DIM], n, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, cp_group, causal, layout, scale, timeline)


__all__ = [
    "LAYOUTS",
    "block_attention",
    "block_attention_backward",
    "block_pairs",
    "causal_work",
    "chunk_ids",
    "gather_sequence",
    "merge_partial_attention",
    "ring_attention",
    "sequence_positions",
    "split_sequence",
    "zigzag_gather",
    "zigzag_split",
]
