"""The bookkeeping of token dispatch: sort by expert, counts to split sizes, permutations (chapter 09).

Pure index arithmetic, no communication (the collectives are in ``.expert_parallel_communications``).
The ``T k`` assignments of ``T`` tokens to their ``k`` experts are numbered ``a = t k + j`` (token ``t``'s
``j``-th choice). With ``E`` experts spread over the ``N`` ranks of an expert-parallel group, rank ``r``
owning experts ``[r E/N, (r+1) E/N)`` (contiguous blocks, as Megatron-LM and torchtitan place them):

1. ``sort_by_expert``: a stable sort of the kept assignments by expert id, giving ``order`` (the
   assignment at each sorted position) and ``counts[i]`` (assignments for expert ``i``). Sorted by expert,
   the rows bound for rank ``q`` are one contiguous block, so the all-to-all's **input split sizes** are
   ``rank_splits`` ``(counts)[q] = sum_{i owned by q} counts[i]``;
2. exchanging ``counts`` (an all-to-all of ``[N, E/N]``) tells every rank ``recv[q, j]``: how many rows rank
   ``q`` sends for its local expert ``j``; the **output split sizes** are ``recv.sum(1)``;
3. what arrives is **rank-major** (rank 0's rows for local experts 0, 1, ..., then rank 1's); the experts
   want **expert-major** (all of expert 0's rows from ranks 0, 1, ..., then expert 1's):
   ``expert_major_order`` is that permutation, ``inverse_permutation`` its inverse for the way back;
4. ``unpermute`` puts the expert outputs back at their assignments (dropped ones zero) and
   ``combine`` sums each token's ``k`` outputs weighted in fp32: ``y_t = sum_j w_{t,j} E_{I_tj}(x_t)``,
   always in the order ``j = 0 .. k-1`` whatever the sort, so a layout's rounding does not depend on it.

Stability makes the result reproducible: after the sort, an expert sees its tokens in token order, and after
the exchange in (source rank, token) order, which is exactly the order one device sees when it processes
the ranks' tokens concatenated. The matmuls then get identical operands, and the outputs agree bit for bit.

**Host syncs.** On a GPU the host waits for the device whenever it reads a value (``.tolist()``,
``int(t)``) or runs an operator whose output shape depends on the data (``bincount``, a boolean mask,
``repeat_interleave`` without ``output_size``). The shapes here depend on the routing, so the host must
learn the counts once per dispatch; everything else is sized from that one read: ``expert_counts``
(a ``scatter_add_``, not ``bincount``), ``split_sizes`` (input splits, output splits and local counts
in one ``.tolist()``), ``sort_by_expert(..., counts=, kept=)`` and ``expert_major_order(recv, total)``
(``refimpl.distributed.host_syncs`` counts them; the budget is in tests/ranks/test_expert_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SortPlan:
    """The kept assignments sorted by expert. ``order [A]``: assignment id ``t k + j`` at each sorted
    position; ``counts [E]``: kept assignments per expert (``A = counts.sum()``); ``top_k``;
    ``num_tokens``."""

    order: torch.Tensor
    counts: torch.Tensor
    top_k: int
    num_tokens: int

    @property
    def token_index(self) -> torch.Tensor:
        """``[A]``: the token of each sorted assignment."""
        return torch.div(self.order, self.top_k, rounding_mode="floor")


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64 on ``expert_ids``' device: the assignments per expert, ids of -1 left out. One
    ``scatter_add_`` into a fixed ``[E]``: ``torch.bincount`` counts the same but reads the ids' maximum
    on the host to size its output (a device-to-host sync on CUDA), and ``flat[flat >= 0]`` is a
    data-dependent shape (another)."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat.clamp(min=0), (flat >= 0).to(torch.int64))


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int, *, counts: torch.Tensor | None = None,
                   kept: int | None = None) -> SortPlan:
    """Stable sort of the assignments ``expert_ids [T, k]`` by expert; ids of -1 (dropped, or another
    rank's expert) are left out.

    Standalone, it checks the ids and reads how many are kept (two host syncs on a GPU). The layer, which
    already read the counts once (``split_sizes``), passes ``counts`` (``expert_counts``) and
    ``kept`` (their sum, a host int): then nothing waits for the device (an id >= ``num_experts`` fails
    ``expert_counts``' index check instead)."""
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [tokens, top_k], got shape {tuple(expert_ids.shape)}")
    flat = expert_ids.flatten()
    if kept is None:
        if bool((flat >= num_experts).any()):
            raise ValueError(f"an expert id is >= num_experts = {num_experts}")
        kept = int((flat >= 0).sum())
    key = torch.where(flat >= 0, flat, num_experts)  # dropped ones sort last
    order = torch.sort(key, stable=True).indices[:kept]
    counts = expert_counts(expert_ids, num_experts) if counts is None else counts
    return SortPlan(order=order, counts=counts, top_k=expert_ids.shape[1], num_tokens=expert_ids.shape[0])


def permute(x: torch.Tensor, plan: SortPlan) -> torch.Tensor:
    """``[T, h] -> [A, h]``: each sorted assignment's token (a gather; backward sums each token's rows)."""
    return x.index_select(0, plan.token_index)


def unpermute(y: torch.Tensor, plan: SortPlan) -> torch.Tensor:
    """``[A, h] -> [T, k, h]``: sorted rows back at their assignments, dropped assignments zero."""
    out = y.new_zeros(plan.num_tokens * plan.top_k, y.shape[-1])
    return out.index_copy(0, plan.order, y).view(plan.num_tokens, plan.top_k, y.shape[-1])


def combine(y: torch.Tensor, weights: torch.Tensor, plan: SortPlan) -> torch.Tensor:
    """``[A, h]`` expert outputs -> ``[T, h]`` in fp32 (fp64 for fp64 outputs): ``sum_j w_{t,j} y_{t,j}``
    (``weights [T, k]``)."""
    dt = torch.promote_types(y.dtype, torch.float32)
    return (unpermute(y, plan).to(dt) * weights.to(dt).unsqueeze(-1)).sum(1)


def rank_splits(counts: torch.Tensor, num_ranks: int) -> list[int]:
    """Rows of an expert-sorted tensor bound for each rank: ``counts [E]`` summed per block of ``E/N``."""
    if counts.numel() % num_ranks:
        raise ValueError(f"{counts.numel()} experts do not divide over {num_ranks} ranks")
    return counts.view(num_ranks, -1).sum(1).tolist()


def _exclusive_cumsum(c: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(c, 0) - c


def split_sizes(counts: torch.Tensor, recv: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """What the host must know to run the uneven all-to-all and the experts, read in **one** transfer:
    the input splits (``rank_splits`` of my ``counts [E]``), the output splits ``recv.sum(1)`` and the
    rows per local expert ``recv.sum(0)`` (``recv [N, L]``, ``.exchange_counts``). Three ``.tolist()``
    would be three device-to-host syncs; ``all_to_all_single`` needs its split sizes as Python ints, so
    one is inherent (torchtitan's dispatcher pays it too: its output splits' blocking copy, "this would
    incur a device-to-host sync", torchtitan/models/common/token_dispatcher.py)."""
    n = recv.shape[0]
    if counts.numel() % n:
        raise ValueError(f"{counts.numel()} experts do not divide over {n} ranks")
    sizes = torch.cat([counts.view(n, -1).sum(1), recv.sum(1), recv.sum(0)]).tolist()
    return sizes[:n], sizes[n:2 * n], sizes[2 * n:]


def expert_major_order(recv: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``recv [N, L]`` (rows from rank ``q`` for local expert ``j``) -> ``idx [R]`` with
    ``expert_major = rank_major[idx]``: rank-major blocks ``(q, j)`` reordered to ``(j, q)``. ``total``:
    ``R`` when the host knows it (``split_sizes``); otherwise it is read from the device, and each
    ``repeat_interleave`` without ``output_size`` would read it again."""
    n, local = recv.shape
    starts = _exclusive_cumsum(recv.flatten()).view(n, local)  # where block (q, j) starts, rank-major
    c = recv.t().flatten()                                     # block sizes in expert-major order
    s = starts.t().flatten()
    total = int(c.sum()) if total is None else total
    block_start = torch.repeat_interleave(_exclusive_cumsum(c), c, output_size=total)
    within = torch.arange(total, device=recv.device) - block_start
    return torch.repeat_interleave(s, c, output_size=total) + within


def inverse_permutation(idx: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[idx[p]] = p``: ``y[idx][inv] == y``."""
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    return inv


__all__ = [
    "SortPlan",
    "combine",
    "expert_counts",
    "expert_major_order",
    "inverse_permutation",
    "permute",
    "rank_splits",
    "sort_by_expert",
    "split_sizes",
    "unpermute",
]
