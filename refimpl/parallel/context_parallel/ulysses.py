"""All-to-all sequence parallelism: DeepSpeed-Ulysses (chapter 07).

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models". The ``cp`` ranks of a context-parallel group each hold ``s/cp`` consecutive tokens of the
sequence (rank ``r`` the tokens ``[r s/cp, (r+1) s/cp)``) and, after the q/k/v projections, all ``a`` heads
of them. Attention needs every token, but the heads are independent:

    O_h = softmax(Q_h K_h^T / sqrt(d) + M) V_h        for each head h,

so one all-to-all regroups the work: afterwards each rank holds ``a/cp`` heads (rank ``r`` the heads
``[r a/cp, (r+1) a/cp)``) of the **whole** sequence, computes ordinary attention for them (the causal mask
``M`` of the full sequence, unchanged), and a second all-to-all sends the output back to the sequence split.

* ``sequence_to_heads``: ``[b, a, s/cp, d] -> [b, a/cp, s, d]``; backward is its inverse (the all-to-all
  is a permutation of blocks, so its adjoint is the inverse permutation: ``heads_to_sequence``);
* ``heads_to_sequence``: ``[b, a/cp, s, d] -> [b, a, s/cp, d]``; backward ``sequence_to_heads``;
* ``ulysses_attention``: ``sequence_to_heads`` of q, k and v, local
  ``torch.nn.functional.scaled_dot_product_attention``, ``heads_to_sequence`` of the output.

Traffic: an all-to-all keeps ``1/cp`` of its input (the block addressed to itself) and sends each other rank
one block, so each rank sends ``(cp-1)/cp`` of its local tensor, ``(cp-1)/cp * b a (s/cp) d`` elements.
Forward makes **four** all-to-alls (q, k, v in; the output back; not fused, so each is one traced call), and
backward four more (dO in; dQ, dK, dV back): ``4 (cp-1)/cp * b a (s/cp) d`` per rank each way, which for a
fixed sequence falls as ``1/cp``, where the ring sends ``(cp-1)/cp`` of the **whole** sequence's K and V
whatever ``cp``. The price: the heads must divide by ``cp`` (a one-line ``ValueError`` otherwise), which caps
``cp`` at the number of heads.

Every rank must hold the same local shape (the all-to-all's blocks are equal); a sequence that does not
divide by ``cp`` is a one-line ``ValueError`` where the whole sequence is seen (``heads_to_sequence``).
A group of size 1 (or ``None`` without a process group) is plain SDPA with no collective. Collectives go
through ``refimpl.comm.ops``, so a ``refimpl.comm.CommTracer`` sees each all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from refimpl.comm import ops
from refimpl.parallel.tensor_parallel.tp_communications import group_size

Group = dist.ProcessGroup | None


def _check_4d(x: torch.Tensor, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{what}: needs [batch, heads, seq, head_dim], got shape {tuple(x.shape)}")


def _check_heads(heads: int, cp: int, what: str) -> None:
    if heads % cp:
        raise ValueError(f"{what}: {heads} attention heads do not divide by cp = {cp} (Ulysses splits heads)")


def _check_seq(seq: int, cp: int, what: str) -> None:
    if seq % cp:
        raise ValueError(f"{what}: sequence length {seq} does not divide by cp = {cp}")


# ---- the primitives: no autograd, one all-to-all each ------------------------------------------------------


def _all_to_all(blocks: torch.Tensor, group: Group) -> torch.Tensor:
    """``out[j] = blocks_j[r]``: block ``j`` of dim 0 goes to rank ``j``, rank ``j``'s block ``r`` comes back
    as ``out[j]`` (one all-to-all, ``(cp-1)/cp`` of ``blocks`` sent)."""
    out = torch.empty_like(blocks)
    ops.all_to_all_single(out, blocks, group=group)
    return out


def _sequence_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[b, a, s/cp, d]`` (all heads, my tokens) -> ``[b, a/cp, s, d]`` (my heads, all tokens)."""
    cp = group_size(group)
    b, a, sc, d = x.shape
    _check_heads(a, cp, "sequence_to_heads")
    blocks = x.reshape(b, cp, a // cp, sc, d)            # [b, cp, a/cp, s/cp, d]: head block j for rank j
    blocks = blocks.movedim(1, 0).contiguous()           # [cp, b, a/cp, s/cp, d]: dim 0 = destination
    got = _all_to_all(blocks, group)                     # [cp, b, a/cp, s/cp, d]: got[j] = rank j's tokens
    got = got.permute(1, 2, 0, 3, 4)                     # [b, a/cp, cp, s/cp, d]: chunks in rank order
    return got.reshape(b, a // cp, cp * sc, d)           # [b, a/cp, s, d]


def _heads_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[b, a/cp, s, d]`` (my heads, all tokens) -> ``[b, a, s/cp, d]`` (all heads, my tokens)."""
    cp = group_size(group)
    b, ah, s, d = x.shape
    _check_seq(s, cp, "heads_to_sequence")
    blocks = x.reshape(b, ah, cp, s // cp, d)            # [b, a/cp, cp, s/cp, d]: token chunk j for rank j
    blocks = blocks.permute(2, 0, 1, 3, 4).contiguous()  # [cp, b, a/cp, s/cp, d]: dim 0 = destination
    got = _all_to_all(blocks, group)                     # [cp, b, a/cp, s/cp, d]: got[j] = rank j's heads
    got = got.movedim(0, 1)                              # [b, cp, a/cp, s/cp, d]: head blocks in rank order
    return got.reshape(b, cp * ah, s // cp, d)           # [b, a, s/cp, d]


# ---- the conjugate pair as autograd functions --------------------------------------------------------------


class _SequenceToHeads(torch.autograd.Function):
    """All-to-all sequence shards -> head shards forward; the inverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _heads_to_sequence(dy, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    """All-to-all head shards -> sequence shards forward; the inverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _sequence_to_heads(dy, ctx.group), None


# ---- the public functions ----------------------------------------------------------------------------------


def sequence_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Ulysses' first all-to-all (Jacobs et al. 2023): ``[b, a, s/cp, d] -> [b, a/cp, s, d]``.

    ``y[:, h, j s/cp + t] = x_j[:, r a/cp + h, t]`` on rank ``r``: my ``a/cp`` heads, the token chunks of
    ranks ``0..cp-1`` concatenated in rank order. Backward: ``heads_to_sequence`` of the gradient. The
    heads ``a`` must divide by ``cp``; a group of one returns ``x`` itself.
    """
    _check_4d(x, "sequence_to_heads")
    cp = group_size(group)
    _check_heads(x.shape[1], cp, "sequence_to_heads")
    if cp == 1:
        return x
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Ulysses' second all-to-all, the inverse of ``sequence_to_heads``: ``[b, a/cp, s, d] -> [b, a,
    s/cp, d]``.

    ``y[:, j a/cp + h, t] = x_j[:, h, r s/cp + t]`` on rank ``r``: all heads (rank ``j``'s block at ``j``) of
    my token chunk. Backward: ``sequence_to_heads`` of the gradient. The sequence ``s`` must divide by
    ``cp``; a group of one returns ``x`` itself.
    """
    _check_4d(x, "heads_to_sequence")
    cp = group_size(group)
    _check_seq(x.shape[2], cp, "heads_to_sequence")
    if cp == 1:
        return x
    return _HeadsToSequence.apply(x, group)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group: Group,
                      causal: bool) -> torch.Tensor:
    """Attention over the whole sequence from each rank's chunk of it (DeepSpeed-Ulysses, chapter 07).

    ``q, k, v``: ``[b, a, s/cp, d]``, rank ``r``'s tokens ``[r s/cp, (r+1) s/cp)`` (all heads). Returns
    ``[b, a, s/cp, d]``, the rows of ``softmax(Q K^T / sqrt(d) + M) V`` of those tokens, with ``M`` the causal
    mask of the **whole** sequence when ``causal``. Four all-to-alls forward (q, k, v, output), four backward;
    ``a`` must divide by ``cp``. Grouped-query attention: k and v ``[b, g, s/cp, d]`` travel at their own
    ``g`` heads (``g`` must divide by ``cp`` too); rank ``r``'s ``a/cp`` query heads then meet exactly its
    ``g/cp`` key/value heads (head ``i`` reads ``i // (a/g)``). A group of one is plain
    ``scaled_dot_product_attention``.
    """
    _check_4d(q, "ulysses_attention")
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"ulysses_attention: q [b, a, s/cp, d] and k, v [b, g, s/cp, d] with g dividing a, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    cp = group_size(cp_group)
    _check_heads(q.shape[1], cp, "ulysses_attention")
    _check_heads(k.shape[1], cp, "ulysses_attention (key/value heads)")
    gqa = k.shape[1] != q.shape[1]
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    qh, kh, vh = (sequence_to_heads(t, cp_group) for t in (q, k, v))  # [b, a/cp, s, d], k, v [b, g/cp, s, d]
    oh = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=gqa)  # [b, a/cp, s, d]
    return heads_to_sequence(oh, cp_group)                             # [b, a, s/cp, d]


__all__ = ["heads_to_sequence", "sequence_to_heads", "ulysses_attention"]
