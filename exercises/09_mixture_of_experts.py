"""Exercises of chapter 09: mixture of experts, from the router to the dispatch and the experts' gradients.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=09`` (or
``python -m exercises.grade 09``) to see your score per task:

1. ``load_balancing_loss``: Switch Transformer's ``alpha E sum_i f_i P_i`` (Fedus et al. 2021, eq. 4),
   its value and its gradient;
2. ``expert_capacity`` and ``capacity_keep``: GShard's capacity, ``C = ceil(k T / E * cf)`` slots per
   expert, and which assignments an overfull expert drops;
3. ``sort_by_expert`` and ``combine``: the assignments sorted by expert (what the experts and the
   all-to-all read), and the experts' outputs back at their tokens, weighted and summed in fp32;
4. ``rank_splits`` and ``expert_major_order``: the split sizes of the uneven all-to-all and the
   permutation that regroups what a rank receives (rank-major) by expert (expert-major);
5. ``route`` and ``update_expert_bias``: the top-k router (softmax or sigmoid scores, the combine weights
   renormalised or not, DeepSeek-V3's expert bias on the choice only) and the bias's update;
6. ``exchange_counts`` and ``all_to_all_tokens``: the count exchange and the uneven all-to-all with its
   backward, GShard's dispatch, on real ranks;
7. ``reduce_expert_gradients``: an expert's gradient summed over its expert-data-parallel group and
   divided by ``dp x cp``, on real ranks.

Tasks 1-5 run in one process (task 4 simulates an expert-parallel group of 2, 3 and 4 ranks by slicing the
rows each rank would send to each other). Tasks 6 and 7 run on 4 ranks (``refimpl.launch.run_ranks``;
each rank loads this file by path), in groups that are not the world. Every result is compared with an
answer the grader computes on its own (by loops, in float64, or with Python's ``sorted``): integers,
orders and exact data exactly, floating-point results within a stated factor of a spread measured in the
same run.

Notation: ``T`` tokens, ``E`` experts, each token picks ``k`` of them; the ``T k`` **assignments** are
numbered ``a = t k + j`` (token ``t``'s ``j``-th choice). ``expert_ids [T, k]`` (int64) holds each
assignment's expert, ``-1`` for an assignment that was dropped (by capacity) or belongs to no expert here.
``scores [T, E]`` are the router's fp32 scores (softmax, or sigmoid for DeepSeek-V3's router).

You may use ``torch``, ``math``, ``torch.distributed`` (ranks and groups), ``refimpl.comm.ops`` (the
collectives, as refimpl makes them) and the record ``SortPlan`` below; do not import
``refimpl.parallel.expert_parallel``'s router, dispatch and communication functions, nor
``refimpl.parallel.expert_parallel_gpt`` (that is the answer). Chapter 09 explains each piece.
"""

from __future__ import annotations

import math  # noqa: F401  (you may need it)

import torch
import torch.distributed as dist  # noqa: F401  (you may need it)
from torch import nn

from refimpl.comm import ops  # noqa: F401  (you may need it)
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

    Traps: the first ``capacity`` tokens to arrive are not the best ones; a sort that is not stable
    (``torch.sort`` and ``torch.argsort`` by default) may order equal scores any way it likes (on the CPU
    it does, beyond 16 keys), so ties need ``stable=True`` or an explicit tie-break.
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


# ---- 5: the router -----------------------------------------------------------------------------------------


def route(x: torch.Tensor, gate: nn.Linear, top_k: int, *, score_func: str,
          normalize_topk: bool | None = None, expert_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k router: ``(expert_ids [T, k] int64, weights [T, k], scores [T, E])`` for ``x [T, h]``.

    ``gate``: an ``nn.Linear(h, E)`` (with or without a bias), the router's parameters; ``x`` of any float
    dtype. Then, with ``dt`` fp32 (fp64 for an fp64 ``x``):

    * the logits ``z = gate(x)`` computed in ``dt`` (x, the weight and the bias taken to ``dt`` first),
      whatever ``x``'s dtype: a bf16 router rounds its scores to 3 significant digits, and near-ties pick
      the wrong expert;
    * ``scores``: ``softmax`` over the experts (Switch, Mixtral), or ``sigmoid`` of each logit
      (DeepSeek-V3), ``[T, E]`` in ``dt``;
    * ``expert_ids``: each token's ``k`` experts of the highest **selection score** ``scores + b``
      (``expert_bias``: ``b [E]`` fp32, or None for zero), in decreasing order of that score (as
      ``torch.topk`` gives them);
    * ``weights``: the chosen experts' **scores** ``w_tj = scores[t, expert_ids[t, j]]`` (never the bias),
      divided by their sum over ``j`` when renormalising. ``normalize_topk``: True or False forces it;
      ``None`` (the default, ``ModelConfig.moe_normalize_topk``) renormalises when ``top_k > 1`` only.

    ``weights`` and ``scores`` are in the autograd graph of ``gate``'s parameters (and of ``x``); the ids
    are integers (no gradient), and the bias gets none.

    Traps: at ``k = 1`` a renormalised weight is ``s / s = 1`` whatever the logits, so the task's loss
    gives the router **no gradient** (Switch multiplies the expert's output by the raw probability: that
    is why ``None`` renormalises only above ``k = 1``); the bias steers the choice only: added to the
    weights, it would scale the experts' outputs and be trained by the task's loss.
    """
    raise NotImplementedError("route: fp32 logits, scores, top-k of scores + bias, the weights renormalised?")


def update_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free update, once per optimizer step: ``[E]`` fp32, the new bias

        b_i  +  rate * sign(mean_j load_j - load_i).

    ``bias [E]`` fp32; ``load [E]``: the tokens routed to each expert in the step (int64 counts, or floats);
    ``rate >= 0`` (DeepSeek-V3's gamma). An expert above the mean load gets less attractive (its bias goes
    down), one below it more attractive; one exactly at the mean does not move (sign 0); the step is the
    same however large the imbalance. Return the new bias (``bias`` updated in place and returned, or a new
    tensor: the grader reads what you return).

    Trap: the sign. ``rate * sign(load_i - mean)`` sends still more tokens to the busiest expert.
    """
    raise NotImplementedError("update_expert_bias: b + rate * sign(mean(load) - load)")


# ---- 6: the count exchange and the uneven all-to-all (on ranks) --------------------------------------------


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """What every rank of ``group`` will send this rank: ``recv [N, E/N]`` int64 from ``counts [E]`` int64.

    ``counts[i]``: this rank's rows for expert ``i`` (its rows are sorted by expert); rank ``q`` of the
    group (``N`` ranks, ``dist.get_world_size(group)``) owns experts ``[q E/N, (q+1) E/N)``. Return
    ``recv`` with ``recv[q, j]``: the rows rank ``q`` will send this rank for its local expert ``j``. The
    routing is each rank's own, so this is not ``counts`` reshaped: one ``all_to_all_single`` of the ``E``
    counts (rank ``q`` gets the block of counts of its experts). ``E`` that does not divide by ``N``:
    ``ValueError``. A group of one rank: ``counts`` as ``[1, E]``.

    ``group`` is a process group that is not the world (its rank 0 is not global rank 0): pass it to every
    collective.
    """
    raise NotImplementedError("exchange_counts: one all-to-all of the counts, [N, E/N] per source rank")


def all_to_all_tokens(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                      group) -> torch.Tensor:
    """GShard's uneven all-to-all over ``group``, differentiable: ``[sum(output_splits), *x.shape[1:]]``.

    Forward: the rows ``x[off_q : off_q + input_splits[q]]`` (``off_q = sum(input_splits[:q])``) go to rank
    ``q`` of the group, ``output_splits[q]`` rows come from rank ``q``, concatenated in rank order
    (``all_to_all_single`` with uneven split sizes; sizes may be zero, ``x`` may have no row). Backward:
    the gradient of each received row goes back to the row it came from, the **reverse** all-to-all: the
    same collective on ``dy`` with the splits swapped. Write it as a ``torch.autograd.Function``. Lists of
    ``N`` ints; a group of one rank: ``x`` itself. ``x`` is not modified.

    Traps: a plain ``all_to_all_single`` into a fresh tensor cuts the autograd graph (the router and
    everything before the dispatch learn nothing); the forward's splits used again on the gradient send
    its rows to the wrong ranks.
    """
    raise NotImplementedError("all_to_all_tokens: uneven all-to-all forward, the splits swapped backward")


# ---- 7: the experts' gradients -----------------------------------------------------------------------------


def reduce_expert_gradients(grads: list[torch.Tensor], *, edp_group, ep_group) -> None:
    """This rank's experts' gradients made the gradients of the global loss, **in place**.

    The ``N = dp x cp`` ranks that see different tokens are also ``edp x ep`` (expert-data-parallel x
    expert-parallel; ``ep_group`` holds this rank's expert-parallel peers, ``edp_group`` the ranks that
    hold copies of the same experts). After backward each tensor of ``grads`` holds
    ``sum over the ep group of dL_q/dW`` (the all-to-all's backward brought every token's share home;
    ``L_q`` is rank ``q``'s loss, a mean over its tokens). The global loss is ``1/N sum_q L_q``, so

        grad  <-  (sum over edp_group of grad) / N,        N = |edp_group| x |ep_group|  (= dp x cp)

    a sum over ``edp`` divided by ``dp x cp``, as the dense weights' gradients are divided by it. Ranks of
    tensor or pipeline parallelism in the world hold copies of the same tokens or other layers: they are
    in neither group and take no part. A group of one rank: nothing to sum.

    Traps: the mean over ``edp`` (``1/edp = ep/N``) gives gradients ``ep`` times too large
    (pytorch/pytorch#160285; AdamW hides it, the loss curve barely shows it); the world size counts the
    tensor- and pipeline-parallel ranks too.
    """
    raise NotImplementedError("reduce_expert_gradients: sum over edp, divide by edp x ep")
