"""The collectives of expert parallelism, as autograd functions (chapter 09).

Lepikhin et al. 2020, "GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding"
(section 2.2 and figure 3): the ``E`` experts of a layer are spread over the ``N`` ranks of an
expert-parallel group, every rank routes its own tokens, and two **all-to-alls** move each token to the
rank of its expert and its output back. The number of rows a rank sends to each peer depends on the
routing, so the splits are **uneven** (zero included) and must be agreed first: every rank tells every
other how many rows it will send (``exchange_counts``, an all-to-all of ``N x E/N`` counts), then

* ``all_to_all_tokens`` ``(x, output_splits, input_splits)``: forward sends rows
  ``x[sum(input_splits[:q]) : sum(input_splits[:q+1])]`` to rank ``q`` and receives ``output_splits[q]`` rows
  from it; backward is the same collective with the splits swapped (the all-to-all is a permutation of
  rows across ranks, its adjoint the inverse permutation): the conjugate pair is the function itself;
* ``post_all_to_all_tokens``: the same all-to-all posted and not waited for (``PendingTokens.wait``
  joins its rows to the graph), so that work independent of the tokens runs while they travel
  (DeepSeek-V3's shared experts during the dispatch, ``refimpl.parallel.expert_parallel.MoE``).

gloo's ``all_to_all_single`` takes uneven and zero split sizes (torch 2.13); the list form
``dist.all_to_all`` refuses uneven ones. A rank sends its own block to itself too; only the other blocks go
on the wire. ``AllToAllTraffic`` records those bytes, forward and backward, measured from the tensors
handed to the collective.

Megatron-LM's default "allgather" token dispatcher (Korthikanti et al. 2022's sequence-parallel pair, along
the token dim 0) needs no counts: every rank gathers every rank's tokens and routing, computes its local
experts on the tokens routed to them, and the partial outputs are summed back to their owners:

* ``gather_tokens``: forward all-gathers dim 0 (rank order), backward reduce-scatters dim 0 (each
  rank's experts contributed to every token's gradient);
* ``reduce_scatter_tokens``: forward reduce-scatters dim 0, backward all-gathers dim 0.

It moves ``N - 1`` ranks' tokens to every rank whatever the routing (``(N-1) T h`` elements in, and as
many out) where the all-to-all moves only the ``~(N-1)/N k T h`` that leave the rank: simpler, and better
only when ``k`` is close to ``N``. All ranks must hold the same number of tokens (checked, one small
all-gather). A group of size 1 (or ``None`` without a process group) is the identity with no collective.
Every collective goes through ``refimpl.comm.ops``, so a ``refimpl.comm.CommTracer`` sees it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size

Group = dist.ProcessGroup | None


@dataclass(kw_only=True)
class AllToAllTraffic:
    """Token bytes this rank sent to **other** ranks in ``all_to_all_tokens`` calls: the rows handed to
    the collective minus the block addressed to itself, times the row's bytes. Forward and backward apart."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_calls: int = 0
    backward_calls: int = 0

    def add(self, sent_bytes: int, backward: bool) -> None:
        if backward:
            self.backward_bytes += sent_bytes
            self.backward_calls += 1
        else:
            self.forward_bytes += sent_bytes
            self.forward_calls += 1


# ---- the primitives: no autograd, one collective each --------------------------------------------------


def _all_to_all_uneven(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                       group: Group) -> torch.Tensor:
    """One ``all_to_all_single`` with uneven row splits (dim 0), traced as ``all_to_all``."""
    x = x.contiguous()
    if x.shape[0] != sum(input_splits):
        raise ValueError(f"all-to-all: {x.shape[0]} rows but input splits {list(input_splits)}")
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    ops.all_to_all_single(out, x, list(output_splits), list(input_splits), group=group)
    return out


def _sent_to_others(x: torch.Tensor, input_splits: Sequence[int], group: Group) -> int:
    rank = group_rank_size(group)[0]
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    return (x.shape[0] - input_splits[rank]) * row_bytes


def _all_gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order (one all-gather)."""
    n = group_rank_size(group)[1]
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    ops.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """My block of dim 0 of ``sum_r x_r`` (one reduce-scatter)."""
    n = group_rank_size(group)[1]
    if x.shape[0] % n:
        raise ValueError(f"reduce-scatter: {x.shape[0]} rows do not divide over {n} ranks")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    ops.reduce_scatter_tensor(out, x, group=group)
    return out


# ---- the autograd functions ----------------------------------------------------------------------------


class _AllToAllTokens(torch.autograd.Function):
    """Uneven all-to-all forward; the reverse all-to-all (splits swapped) backward."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, traffic):
        ctx.splits, ctx.group, ctx.traffic = (output_splits, input_splits), group, traffic
        if traffic is not None:
            traffic.add(_sent_to_others(x, input_splits, group), backward=False)
        return _all_to_all_uneven(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, dy):
        return _reverse_all_to_all(ctx, dy), None, None, None, None


def _reverse_all_to_all(ctx, dy: torch.Tensor) -> torch.Tensor:
    """The backward of an all-to-all of tokens: ``dy`` by the same collective, splits swapped (its bytes to
    other ranks booked as backward traffic)."""
    output_splits, input_splits = ctx.splits
    if ctx.traffic is not None:
        ctx.traffic.add(_sent_to_others(dy, output_splits, ctx.group), backward=True)
    return _all_to_all_uneven(dy, input_splits, output_splits, ctx.group)


class _ReceivedTokens(torch.autograd.Function):
    """The rows an all-to-all posted earlier received (``PendingTokens``), joined to the graph of the rows
    it sent: forward hands them on; backward, the reverse all-to-all, as ``_AllToAllTokens``'."""

    @staticmethod
    def forward(ctx, x, received, splits, group, traffic):  # splits: (output_splits, input_splits)
        ctx.splits, ctx.group, ctx.traffic = splits, group, traffic
        return received.view_as(received)

    @staticmethod
    def backward(ctx, dy):
        return _reverse_all_to_all(ctx, dy), None, None, None, None


@dataclass(kw_only=True, eq=False)
class PendingTokens:
    """An all-to-all of tokens in flight (``post_all_to_all_tokens``): ``wait()`` gives what
    ``all_to_all_tokens`` would have returned, in the graph of the rows sent (``x``), whose contiguous
    copy ``sent`` it keeps alive until then (NCCL reads it from its own stream)."""

    x: torch.Tensor
    sent: torch.Tensor
    received: torch.Tensor
    work: Any  # the async collective's handle
    splits: tuple[list[int], list[int]]  # (output_splits, input_splits)
    group: Group
    traffic: AllToAllTraffic | None

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return _ReceivedTokens.apply(self.x, self.received, self.splits, self.group, self.traffic)


def post_all_to_all_tokens(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                           group: Group, traffic: AllToAllTraffic | None = None) -> PendingTokens:
    """``all_to_all_tokens`` posted, not waited for: what runs before ``wait()`` overlaps the transfer
    (DeepSeek-V3's shared experts while the tokens travel, chapter 09). Several ranks only."""
    n = group_rank_size(group)[1]
    if len(output_splits) != n or len(input_splits) != n or n == 1:
        raise ValueError(f"a posted all-to-all needs several ranks and {n} split sizes each, got "
                         f"{list(output_splits)} and {list(input_splits)}")
    sent = x.detach().contiguous()
    if sent.shape[0] != sum(input_splits):
        raise ValueError(f"all-to-all: {sent.shape[0]} rows but input splits {list(input_splits)}")
    if traffic is not None:
        traffic.add(_sent_to_others(sent, input_splits, group), backward=False)
    received = sent.new_empty((sum(output_splits), *sent.shape[1:]))
    work = ops.all_to_all_single(received, sent, list(output_splits), list(input_splits), group=group,
                                 async_op=True)
    return PendingTokens(x=x, sent=sent, received=received, work=work,
                         splits=(list(output_splits), list(input_splits)), group=group, traffic=traffic)


class _GatherTokens(torch.autograd.Function):
    """All-gather dim 0 forward, reduce-scatter dim 0 backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_rows(dy, ctx.group), None


class _ReduceScatterTokens(torch.autograd.Function):
    """Reduce-scatter dim 0 forward, all-gather dim 0 backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_rows(dy, ctx.group), None


# ---- the wrappers: identity on a group of one ------------------------------------------------------------


def exchange_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """``counts [E]`` (my rows per expert, sorted by expert) -> ``recv [N, E/N]``: ``recv[q, j]`` rows that
    rank ``q`` will send me for my local expert ``j`` (one even all-to-all of ``E`` integers)."""
    n = group_rank_size(group)[1]
    if counts.numel() % n:
        raise ValueError(f"{counts.numel()} experts do not divide over {n} ranks")
    send = counts.reshape(n, -1).contiguous()
    if n == 1:
        return send.clone()
    recv = torch.empty_like(send)
    ops.all_to_all_single(recv, send, group=group)
    return recv


def all_to_all_tokens(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                      group: Group, traffic: AllToAllTraffic | None = None) -> torch.Tensor:
    """Rows ``x[in_off[q] : in_off[q] + input_splits[q]]`` go to rank ``q``; ``output_splits[q]`` rows come
    from it, in rank order (GShard's all-to-all). Backward: the reverse all-to-all. ``traffic`` (optional)
    records the bytes sent to other ranks."""
    n = group_rank_size(group)[1]
    if len(output_splits) != n or len(input_splits) != n:
        raise ValueError(f"all-to-all over {n} ranks needs {n} split sizes each, got {list(output_splits)} "
                         f"and {list(input_splits)}")
    if n == 1:
        if list(output_splits) != list(input_splits):
            raise ValueError(f"a group of one receives what it sends: {output_splits} != {input_splits}")
        return x
    return _AllToAllTokens.apply(x, list(output_splits), list(input_splits), group, traffic)


def gather_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``cat_r(x_r, dim=0)`` (one all-gather); backward: my block of ``sum_r dy_r`` (one reduce-scatter)."""
    if group_rank_size(group)[1] == 1:
        return x
    return _GatherTokens.apply(x, group)


def reduce_scatter_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    """My block of dim 0 of ``sum_r x_r`` (one reduce-scatter); backward ``cat_r(dy_r, dim=0)``."""
    if group_rank_size(group)[1] == 1:
        return x
    return _ReduceScatterTokens.apply(x, group)


def gather_no_grad(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``cat_r(x_r, dim=0)`` of a tensor without gradient (expert ids, keep masks)."""
    if group_rank_size(group)[1] == 1:
        return x
    return _all_gather_rows(x, group)


def check_equal_tokens(num_tokens: int, group: Group, device: torch.device) -> None:
    """The all-gather dispatcher needs the same token count on every rank: one all-gather of one integer
    (made on ``device`` by a fill, not copied from the host), read on the host before the tokens'
    all-gather, which would hang or mix rows on NCCL with unequal sizes: this dispatcher's second host
    sync, beside its counts'."""
    if group_rank_size(group)[1] == 1:
        return
    mine = torch.full((1,), num_tokens, dtype=torch.int64, device=device)
    counts = _all_gather_rows(mine, group).tolist()
    if len(set(counts)) != 1:
        raise ValueError(f"the allgather dispatcher needs equal token counts on every rank, got {counts}")


__all__ = [
    "AllToAllTraffic",
    "PendingTokens",
    "all_to_all_tokens",
    "check_equal_tokens",
    "exchange_counts",
    "gather_no_grad",
    "gather_tokens",
    "post_all_to_all_tokens",
    "reduce_scatter_tokens",
]
