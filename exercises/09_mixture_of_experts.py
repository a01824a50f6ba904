"""Exercises of chapter 09: mixture of experts, the router's bookkeeping and the token dispatch.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=09`` (or
``python -m exercises.grade 09``) to see your score per task:

1. ``load_balancing_loss``: Switch Transformer's ``alpha E sum_i f_i P_i`` (Fedus et al. 2021, eq. 4),
   its value and its gradient;
2. ``expert_capacity`` and ``capacity_keep``: GShard's capacity, ``C = ceil(k T / E * cf)`` slots per
   expert, and which assignments an overfull expert drops;
3. ``sort_by_expert`` and ``combine``: the assignments sorted by expert (what the experts and the
   all-to-all read), and the experts' outputs back at their tokens, weighted and summed in fp32;
4. ``rank_splits`` and ``expert_major_order``: the split sizes of the uneven all-to-all and the
   permutation that regroups what a rank receives (rank-major) by expert (expert-major).

Everything runs in one process: the grader simulates an expert-parallel group of 2, 3 and 4 ranks by
slicing the rows each rank would send to each other (the count exchange and the all-to-all), and compares
every result with an answer it computes on its own (by loops, in float64, or with Python's ``sorted``):
integers and orders exactly, floating-point results within a stated factor of a spread measured in the
same run.

Notation: ``T`` tokens, ``E`` experts, each token picks ``k`` of them; the ``T k`` **assignments** are
numbered ``a = t k + j`` (token ``t``'s ``j``-th choice). ``expert_ids [T, k]`` (int64) holds each
assignment's expert, ``-1`` for an assignment that was dropped (by capacity) or belongs to no expert here.
``scores [T, E]`` are the router's fp32 scores (softmax, or sigmoid for DeepSeek-V3's router).

You may use ``torch`` and ``math``, and the record ``SortPlan`` below; do not import
``refimpl.parallel.expert_parallel``'s router and dispatch functions (that is the answer).
Chapter 09 explains each piece.
"""

from __future__ import annotations

import math  # noqa: F401  (you may need it)

import torch

from refimpl.parallel.expert_parallel.dispatch import SortPlan

# ---- 1: the load-balancing loss ----------------------------------------------------------------------------


def load_balancing_loss(scores: torch.Tensor, expert_ids: torch.Tensor, coeff: float,
                        score_func: str) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``coeff * E * sum_i f_i P_i``, a 0-d tensor of ``scores``' dtype.

    ``scores [T, E]`` (in the autograd graph), ``expert_ids [T, k]`` (every entry a valid expert),
    ``score_func``: ``"softmax"`` or ``"sigmoid"``.

    * ``f_i``: the fraction of the ``T k`` assignments routed to expert ``i`` (a count: no gradient);
    * ``P_i``: the mean over the ``T`` tokens of expert ``i``'s probability. Softmax scores are
      probabilities already; sigmoid scores are first divided by their sum over the experts, per token
      (DeepSeek-V3 eq. 18-20).

    A perfectly uniform router gives ``coeff`` exactly. The gradient flows into ``scores`` through ``P``
    alone. ``coeff == 0`` or no token (``T == 0``) gives a zero (not a NaN).

    Traps: the factor ``E`` (without it the loss shrinks as experts are added); ``f`` counts
    assignments, ``T k`` of them, not tokens.
    """
    raise NotImplementedError("load_balancing_loss: alpha E sum_i f_i P_i")


# ---- 2: capacity -------------------------------------------------------------------------------------------


def expert_capacity(num_tokens: int, top_k: int, num_experts: int,
                    capacity_factor: float | None) -> int | None:
    """The slots per expert, ``C = ceil(k T / E * cf)`` (an ``int``), or ``None`` (dropless) when
    ``capacity_factor`` is ``None``.

    Trap: rounding down leaves too few slots even for a perfectly balanced router when ``k T / E`` is not
    an integer.
    """
    raise NotImplementedError("expert_capacity: ceil(k T / E * cf), None when dropless")


def capacity_keep(expert_ids: torch.Tensor, scores: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """``[T, k]`` bool: True for the assignments that fit in their expert's ``capacity`` slots.

    ``expert_ids [T, k]`` (valid experts), ``scores [T, E]`` (fp32, possibly in the autograd graph: do not
    change it), ``capacity``: an int, or ``None`` (every assignment fits).

    An expert chosen by at most ``capacity`` assignments keeps them all; one chosen by more keeps the
    ``capacity`` of them with the highest score ``scores[t, i]`` and drops the rest; among equal scores the
    earlier token wins. Each expert is judged on its own.

    Trap: the first ``capacity`` tokens to arrive are not the best ones.
    """
    raise NotImplementedError("capacity_keep: each expert keeps its highest-scored assignments")


# ---- 3: sort by expert, and combine ------------------------------------------------------------------------


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> SortPlan:
    """The assignments of ``expert_ids [T, k]`` sorted by expert: a ``SortPlan`` with

    * ``order [A]`` (int64): the assignment ids ``t k + j`` in expert order; among the assignments of one
      expert, in increasing assignment id (a stable sort). Assignments of id ``-1`` are left out, so
      ``A`` is the number of the others;
    * ``counts [E]`` (int64): the assignments of each expert (``counts.sum() == A``; zero for an expert
      nobody chose);
    * ``top_k = k``, ``num_tokens = T``.

    An id ``>= num_experts``: ``ValueError``. The stable order is what makes expert parallelism equal one
    device bit for bit: every expert sees its tokens in token order.
    """
    raise NotImplementedError("sort_by_expert: a stable sort of the kept assignments by expert id")


def combine(y: torch.Tensor, weights: torch.Tensor, plan: SortPlan) -> torch.Tensor:
    """The layer's output ``[T, h]``: ``out_t = sum_j weights[t, j] * (row of y for assignment t k + j)``.

    ``y [A, h]``: one output row per sorted assignment, in ``plan.order``'s order (row ``p`` belongs to
    assignment ``plan.order[p]``); ``weights [T, k]``: the combine weights (fp32, in the autograd graph);
    an assignment missing from the plan (dropped) contributes zero. The products and the sum are computed
    in fp32 (in fp64 for fp64 ``y``) and returned in that dtype, whatever ``y``'s dtype (bf16 experts
    too). Differentiable with respect to ``y`` and ``weights``.

    Trap: ``plan.order[p]`` says where row ``p`` goes, not which row comes to ``p``.
    """
    raise NotImplementedError("combine: rows back to their assignments, weighted sum over k in fp32")


# ---- 4: the all-to-all's splits and the expert-major order -------------------------------------------------


def rank_splits(counts: torch.Tensor, num_ranks: int) -> list[int]:
    """The rows of an expert-sorted tensor bound for each rank, a list of ``num_ranks`` ints.

    ``counts [E]``: rows per expert; rank ``r`` of the expert-parallel group owns the contiguous block of
    experts ``[r E/N, (r+1) E/N)``. ``E`` that does not divide by ``N``: ``ValueError``. These are the
    input split sizes of the dispatch all-to-all.
    """
    raise NotImplementedError("rank_splits: counts summed per rank's block of experts")


def expert_major_order(recv: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups a rank's received rows by local expert.

    ``recv [N, L]`` (int64, from the count exchange): ``recv[q, j]`` rows came from rank ``q`` for this
    rank's local expert ``j``. The rows arrived **rank-major**: rank 0's rows for local expert 0, then
    rank 0's for expert 1, ..., then rank 1's for expert 0, and so on (each block in the order its sender
    sorted it). Return ``idx [R]`` (int64, ``R = recv.sum()``) such that ``received[idx]`` is
    **expert-major**: all of local expert 0's rows (rank 0's block, then rank 1's, ...), then expert 1's,
    and so on. Blocks may be empty.
    """
    raise NotImplementedError("expert_major_order: blocks (q, j) in rank-major order, read as (j, q)")
