"""Ring attention: exact attention over a sequence split across the ranks of a ring (chapter 07).

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context". Each of the ``n``
ranks of the context-parallel group holds ``s/n`` tokens of the queries, keys and values, ``[b, a, s/n, d]``.
The K/V blocks travel round the ring (``.context_parallel_communications``); at each of the ``n`` steps a
rank attends its queries to the block it holds while the next one is on the wire. Softmax over the whole
row is recovered exactly from partial results, as FlashAttention merges tiles (the online softmax): a
block gives ``o_j = softmax(S_j) V_j`` and ``lse_j = log sum_k exp(S_j)_k`` (``S = q k^T / sqrt(d)``),
and two partial results merge as

    lse = logaddexp(lse_1, lse_2),    o = e^(lse_1 - lse) o_1 + e^(lse_2 - lse) o_2,

which is associative, so the order the blocks arrive in does not matter (``merge_partial_attention``).
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

Grouped-query attention (``g`` key/value heads for ``a`` query heads): K/V travel the ring at their own
``g`` heads, ``g/a`` of multi-head attention's bytes, and each block expands them to the query heads it
meets (``expand_groups``), its dK/dV summed back over each group (``reduce_groups``) before they
travel: picotron repeats K/V before its ring and moves ``a/g`` times the bytes.

Layouts and the causal mask: which chunks of the sequence a rank holds (contiguous or zig-zag) and which
(query chunk, key chunk) pairs a causal mask skips or masks are ``.sequence_layout``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refimpl.comm.tracer import now
from refimpl.parallel.context_parallel.context_parallel_communications import (
    Group,
    cp_rank,
    cp_size,
    ring_exchange,
)
from refimpl.parallel.context_parallel.ring_timeline import RingTimeline
from refimpl.parallel.context_parallel.sequence_layout import (
    LAYOUTS,
    Layout,
    _check_length,
    block_pairs,
    chunk_ids,
)

SEQ_DIM = 2
"""The sequence dim of the ``[batch, heads, seq, head_dim]`` blocks attention works on."""


# ---- one block, forward and backward, and the merge --------------------------------------------------------


def _future_mask(n: int, device: torch.device) -> torch.Tensor:
    """``[n, n]``, True where the key comes after the query (the diagonal block of a causal mask)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def _scores(q: torch.Tensor, k: torch.Tensor, *, scale: float, diagonal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * scale                         # [b, a, c_q, c_k]
    return s.masked_fill(_future_mask(s.shape[-1], s.device), float("-inf")) if diagonal else s


def expand_groups(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention's k or v ``[b, g, c, d]`` for ``heads`` query heads: ``[b, heads, c, d]``,
    head ``i`` reading key/value head ``i // (heads / g)`` (Ainslie et al. 2023); ``kv`` itself when
    ``g = heads``."""
    b, g, c, d = kv.shape
    if g == heads:
        return kv
    return kv[:, :, None].expand(b, g, heads // g, c, d).reshape(b, heads, c, d)


def reduce_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The adjoint of ``expand_groups``: ``[b, heads, c, d]`` summed over each group's query heads."""
    b, heads, c, d = grad.shape
    return grad if groups == heads else grad.view(b, groups, heads // groups, c, d).sum(2)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(S) V, logsumexp(S))`` of one block, ``S = q k^T scale`` masked above the diagonal when
    ``diagonal``: ``[b, a, c, d]`` and ``[b, a, c]`` (k and v of ``g`` key/value heads: expanded here, after
    the ring moved them at their own size)."""
    k, v = expand_groups(k, q.shape[1]), expand_groups(v, q.shape[1])
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
    """``(dQ, dK, dV)`` of one block given the whole row's ``lse`` and ``delta = rowsum(dO * O)`` (dK, dV
    summed over each key/value head's query heads under grouped-query attention)."""
    g = k.shape[1]
    k, v = expand_groups(k, q.shape[1]), expand_groups(v, q.shape[1])
    p = torch.exp(_scores(q, k, scale=scale, diagonal=diagonal) - lse.unsqueeze(-1))  # [b, a, c_q, c_k]
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    dk, dv = ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do
    return ds @ k * scale, reduce_groups(dk, g), reduce_groups(dv, g)


# ---- the ring ----------------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    """Forward and backward rings of ``ring_attention`` (see the module docstring)."""

    @staticmethod  # autograd.Function.apply passes the inputs positionally
    def forward(ctx, q, k, v, group: Group, causal: bool, layout: Layout, scale: float,  # noqa: PLR0917
                timeline: RingTimeline | None, overlap: bool):
        # the blocks in float32 under the caller's autocast too (its matmuls would round them to 16 bits)
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._forward(ctx, q, k, v, group, causal, layout, scale, timeline, overlap)

    @staticmethod  # forward's body, called with forward's positional inputs
    def _forward(ctx, q, k, v, group: Group, causal: bool, layout: Layout, scale: float,  # noqa: PLR0917
                 timeline: RingTimeline | None, overlap: bool):
        n, r = cp_size(group), cp_rank(group)
        owned = [chunk_ids(cp_rank=i, cp_size=n, layout=layout) for i in range(n)]
        m, cdt = len(owned[r]), torch.promote_types(q.dtype, torch.float32)
        qs = q.to(cdt).chunk(m, dim=SEQ_DIM)                   # m x [b, a, c, d]
        outs: list = [None] * m
        lses: list = [None] * m
        kv: tuple[torch.Tensor, ...] = (k, v)
        for step in range(n):
            posted = now()
            transfer = ring_exchange(kv, group=group, step=step) if step < n - 1 else None
            arrived = transfer.wait() if transfer is not None and not overlap else None  # the control
            begin = now()
            ks, vs = (t.to(cdt).chunk(m, dim=SEQ_DIM) for t in kv)
            for i, j, diagonal in block_pairs(owned[r], owned[(r - step) % n], causal=causal):
                o, lse = block_attention(qs[i], ks[j], vs[j], scale=scale, diagonal=diagonal)
                outs[i], lses[i] = merge_partial_attention(outs[i], lses[i], o, lse)
            computed = now()
            if transfer is not None:
                kv = transfer.wait() if arrived is None else arrived
            if timeline is not None:  # chapter 07's figure: what the transfer of this step overlapped
                timeline.add("compute", step, begin, computed)
                if transfer is not None:
                    timeline.add("transfer", step, posted, now())
        out, lse = torch.cat(outs, dim=SEQ_DIM), torch.cat(lses, dim=SEQ_DIM)  # [b, a, s/n, d], [b, a, s/n]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, layout, scale, overlap)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout, scale, overlap = ctx.args
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
            arrived = transfer.wait() if transfer is not None and not overlap else None  # the control
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
                if not overlap:  # the control: the partial dK/dV delivered before the next block's compute
                    pk, pv = behind.wait()
                    behind = _Arrived((pk, pv))
            if transfer is not None:
                kv = transfer.wait() if arrived is None else arrived
        dk, dv = own
        if behind is not None:                                 # n - 1 hops: my block's dK/dV is back
            pk, pv = behind.wait()
            dk, dv = dk + pk, dv + pv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


class _Arrived:
    """An exchange already waited for (the serialized control): ``wait()`` returns what it received."""

    def __init__(self, tensors: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.tensors = tensors

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group: Group, causal: bool,
                   layout: Layout = "zigzag", scale: float | None = None,
                   timeline: RingTimeline | None = None, overlap: bool = True) -> torch.Tensor:
    """Exact attention of the local queries over the whole sequence split across ``cp_group``.

    ``q, k, v``: this rank's ``[b, a, s/n, d]`` blocks (``v`` may have another head dim; grouped-query
    attention: k and v ``[b, g, s/n, d]``, moved round the ring at that size and expanded per block), the
    sequence split by ``layout`` (``split_sequence``); returns this rank's ``[b, a, s/n, d_v]`` of
    ``scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale)`` on the whole sequence. A group
    of one is plain SDPA. ``timeline``: records the forward's compute and transfer spans per ring step
    (``refimpl.parallel.context_parallel.ring_timeline.RingTimeline``). ``overlap=False`` is the
    serialized control: each exchange is waited for as soon as it is posted, before the block it could
    have hidden behind (the same arithmetic, bitwise; tests/ranks/cli/test_overlap.py times the two on a
    shaped link). Liu et al. 2023; chapter 07.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    gqa_heads = k.dim() == 4 and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
    same = k.dim() == 4 and (k.shape[0], k.shape[2], k.shape[3]) == (q.shape[0], q.shape[2], q.shape[3])
    if q.dim() != 4 or not (same and gqa_heads) or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"ring_attention needs [b, a, s/cp, d] queries and [b, g, s/cp, d] keys and values "
                         f"(g divides a): q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    n = cp_size(cp_group)
    if n == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    _check_length(n * q.shape[SEQ_DIM], n, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, cp_group, causal, layout, scale, timeline, overlap)


__all__ = [
    "block_attention",
    "block_attention_backward",
    "expand_groups",
    "merge_partial_attention",
    "reduce_groups",
    "ring_attention",
]
