"""Exercises of chapter 07: context parallelism, the pieces of ring attention.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=07`` (or
``python -m exercises.grade 07``) to see your score per task:

1. ``merge_partial_attention``: two partial attentions of the same queries (over two sets of keys) into
   the attention over both, by their log-sum-exp (the online softmax; Liu et al. 2023, FlashAttention);
2. ``zigzag_split``: this rank's part of a sequence cut into ``2 cp`` chunks, the causal load balance of
   Megatron-LM's context parallelism and Llama 3 (the "zig-zag" or load-balanced ring; not Striped
   Attention, which deals the tokens out round-robin);
3. ``ring_attention_step``: what a rank of the ring does with one K/V block it holds: attend its queries
   to it under the causal mask, and merge the result into what it has so far;
4. ``ring_attention_forward``: the ring itself, on real ranks: the K/V blocks travel round the group,
   every rank ends with its rows of attention over the whole sequence;
5. ``ring_attention_backward``: the backward ring: this rank's dQ, dK, dV of that attention;
6. ``sequence_to_heads`` and ``heads_to_sequence``: DeepSpeed-Ulysses' all-to-all (Jacobs et al. 2023),
   sequence shards to head shards and back.

Tasks 1-3 run in one process: the grader simulates a ring of ``cp`` = 2 and 4 ranks by looping over the
blocks each rank would receive. Tasks 4-6 run on 3 ranks (``refimpl.launch.run_ranks``; each rank loads
this file by path). Attention is compared with ``scaled_dot_product_attention`` on the whole sequence (in
float64, its autograd for the gradients), within a stated factor of SDPA's own float32 error measured in
the same run; the all-to-alls bit for bit.

Notation: ``q, k, v`` are ``[b, a, c, d]`` (batch, heads, tokens of a chunk, head dim); the scores of a
block are ``S = q k^T * scale`` (``[b, a, c_q, c_k]``); a partial attention over a set of keys is the pair
``(o, lse)`` with ``o = softmax(S) v`` (``[b, a, c, d]``) and ``lse = log sum_k exp(S_k)`` per query row
(``[b, a, c]``). The empty partial (no keys yet) is ``o = 0``, ``lse = -inf``.

You may use ``torch``, ``torch.nn.functional``, ``torch.distributed`` (for ranks and groups) and
``refimpl.comm.ops`` (every transfer goes through it, so that the grader's tracer sees it); do not import
``refimpl.parallel.context_parallel`` (that is the answer). Chapter 07 explains each piece.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401  (you may need it)

# ---- 1: the log-sum-exp merge ------------------------------------------------------------------------------


def merge_partial_attention(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                            lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two disjoint sets of keys, from the partial attention over each.

    ``out1, out2``: ``[b, a, c, d]``; ``lse1, lse2``: ``[b, a, c]`` (float32). Return ``(out, lse)`` of the
    same shapes and dtype with

        lse = log(e^lse1 + e^lse2),    out = e^(lse1 - lse) out1 + e^(lse2 - lse) out2,

    for every query row. Contract: right (within the grader's tolerance) for scores of any size, where
    ``e^lse`` overflows float32 (``lse`` of several hundred) and where one ``lse`` is far larger than the
    other; the empty partial (``out = 0``, ``lse = -inf``) merged with a partial gives that partial; the
    merge is symmetric and associative, so merging three blocks in any order gives the attention over all
    three. The inputs are not modified.
    """
    raise NotImplementedError("merge_partial_attention: weigh each partial output by its share of exp(lse)")


# ---- 2: the zig-zag split ----------------------------------------------------------------------------------


def zigzag_split(x: torch.Tensor, *, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Rank ``cp_rank``'s part of the sequence dim ``dim`` of ``x`` under the zig-zag layout.

    Cut ``dim`` (length ``s``; negative ``dim`` counts from the end) into ``2 cp_size`` equal chunks of
    ``s / (2 cp_size)`` tokens, numbered ``0 .. 2 cp_size - 1`` in sequence order; rank ``i`` holds chunks
    ``i`` and ``2 cp_size - 1 - i``, in that order, concatenated along ``dim``. The other dims are kept.
    ``s`` that does not divide by ``2 cp_size``: ``ValueError``. ``x`` is not modified.
    """
    raise NotImplementedError("zigzag_split: chunks cp_rank and 2 cp_size - 1 - cp_rank of 2 cp_size")


# ---- 3: one block of a ring step ---------------------------------------------------------------------------


def ring_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, *, position: str,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend the queries ``q`` to the K/V block ``k, v`` and merge the result into the running ``(out,
    lse)``; return the new ``(out, lse)``.

    ``q``: a chunk of this rank's queries, ``[b, a, c, d]``; ``k, v``: one chunk of keys and values of the
    same length ``c``, the one this rank holds at this step of the ring; ``out, lse``: ``[b, a, c, d]``
    and ``[b, a, c]``, the partial attention of ``q`` over the chunks merged so far (the empty partial
    before the first). All float32. Scores are ``q k^T * scale``.

    ``position`` says where the key chunk lies relative to the query chunk in the whole sequence, for a
    causal mask (query ``i`` sees key ``j`` only if ``j <= i`` in global positions):

    * ``"diagonal"``: the same chunk, so query ``t`` of the chunk sees keys ``0..t`` of it;
    * ``"past"``: a chunk wholly before the queries (or attention without a mask): every key is seen;
    * ``"future"``: a chunk wholly after the queries: no key is seen, the running state is unchanged.

    Anything else: ``ValueError``. Looping over the chunks of a sequence (in any order) from the empty
    partial must give the rows of ``scaled_dot_product_attention`` of the whole sequence (``is_causal``)
    and their ``logsumexp`` of the masked scores. ``q``, ``k`` and ``v`` are not modified.
    """
    raise NotImplementedError("ring_attention_step: the block's masked attention and lse, then merge them")


# ---- 4: the ring, forward ----------------------------------------------------------------------------------


def ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group,
                           causal: bool) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, the sequence split across ``group``.

    ``group``: a ``torch.distributed`` process group of ``n`` ranks (the graded one need not be the world:
    address peers by global rank). Rank ``r`` of the group holds the tokens ``[r c, (r + 1) c)`` of the
    sequence: ``q, k, v`` are its ``[b, a, c, d]`` float32 blocks. Return ``[b, a, c, d]``: the rows of
    ``scaled_dot_product_attention(Q, K, V, is_causal=causal)`` of the whole sequence that belong to this
    rank's queries.

    Contract: every rank sees every other rank's K and V only through a ring: the ranks send K/V blocks to
    the next rank of the group (``r + 1`` mod ``n``) and receive from the previous one, with point-to-point
    calls of ``refimpl.comm.ops``; the grader's tracer must see each rank hand exactly ``n - 1`` K blocks and
    ``n - 1`` V blocks (of ``k``'s size) to ``isend``/``send``, to the next rank, and no collective. Right
    for scores of any size; ``q, k, v`` are not modified.
    """
    raise NotImplementedError("ring_attention_forward: pass the K/V blocks round the ring")


# ---- 5: the ring, backward ---------------------------------------------------------------------------------


def ring_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, *, group,
                            causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of this rank's blocks under the attention of ``ring_attention_forward``.

    ``q, k, v, group, causal``: as in ``ring_attention_forward``; ``out, lse``: this rank's forward
    result and the ``logsumexp`` of its rows' (masked) scores ``q k^T / sqrt(d)`` (``[b, a, c, d]``,
    ``[b, a, c]``), ``do``: the gradient of the loss with respect to ``out``.
    Return ``(dq, dk, dv)``, each the shape of its block: the gradients of the whole sequence's SDPA (with
    ``is_causal=causal``) with respect to this rank's rows of Q, K and V, given the whole ``dO``. The K
    of rank ``j`` is used by the queries of every rank, so ``dk`` and ``dv`` sum every rank's share.

    Contract: as in forward, every transfer is a point-to-point call of ``refimpl.comm.ops`` between ring
    neighbours (no collective); nothing else is given (no whole-sequence tensors). The inputs are not
    modified.
    """
    raise NotImplementedError("ring_attention_backward: dQ where it is, dK and dV home round the ring")


# ---- 6: Ulysses' all-to-all --------------------------------------------------------------------------------


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, a, c, d]`` (all heads of this rank's tokens) -> ``[b, a/n, n c, d]`` (its heads, every token).

    The ``n`` ranks of ``group`` each hold ``c`` consecutive tokens (rank ``r`` the tokens ``[r c, (r+1) c)``)
    of all ``a`` heads. Return, on rank ``r``, the heads ``[r a/n, (r + 1) a/n)`` of the whole sequence, its
    tokens in sequence order: ``y[:, h, j c + t] = x_j[:, r a/n + h, t]`` (``x_j``: rank ``j``'s ``x``).
    Contract: one ``all_to_all_single`` of ``refimpl.comm.ops`` with the whole of ``x``'s bytes as its
    payload, no other transfer; bit for bit; ``a`` that does not divide by ``n``: ``ValueError``.
    """
    raise NotImplementedError("sequence_to_heads: one all-to-all, my heads of every rank's tokens")


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``sequence_to_heads``: ``[b, a/n, s, d]`` -> ``[b, a, s/n, d]``.

    Rank ``r`` holds heads ``[r a/n, (r + 1) a/n)`` of all ``s`` tokens; return all heads of its tokens
    ``[r s/n, (r + 1) s/n)``: ``y[:, j a/n + h, t] = x_j[:, h, r s/n + t]``. Contract: one
    ``all_to_all_single`` of ``refimpl.comm.ops`` with ``x``'s bytes as payload; bit for bit;
    ``heads_to_sequence(sequence_to_heads(x, g), g)`` is ``x``; ``s`` that does not divide by ``n``:
    ``ValueError``.
    """
    raise NotImplementedError("heads_to_sequence: the inverse all-to-all")
