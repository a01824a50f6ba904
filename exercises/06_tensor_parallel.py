"""Exercises of chapter 06: tensor parallelism, Megatron-style (Shoeybi et al. 2019).

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=06`` (or
``python -m exercises.grade 06``) to see your score per task. Every task is graded on a world of 4 ranks
split into two tensor-parallel groups of ``t = 2`` (ranks {0, 1} and {2, 3}, each pair with its own
data), each rank loading this file again: use the ``group`` you are handed, its rank and its size, never
the world's.

1. ``copy_to_tensor_parallel_region`` (Megatron's ``f``) and
2. ``reduce_from_tensor_parallel_region`` (``g``), two autograd functions conjugate to each other;
3. ``ColumnParallelLinear`` and 4. ``RowParallelLinear``, each built from a full ``nn.Linear``;
5. ``vocab_parallel_cross_entropy``, the loss computed from vocabulary-sharded logits;
6. ``scatter_to_sequence_parallel_region``, 7. ``gather_from_sequence_parallel_region`` and
8. ``reduce_scatter_to_sequence_parallel_region``, sequence parallelism's conjugates (Korthikanti et al.
   2022) along the sequence, dim 1 of ``[batch, seq, hidden]``;
9. ``shard_fused_qkv``, this rank's shard of a fused query/key/value projection saved in nanoGPT's order.

The grader compares outputs and gradients with the full, one-device layer or ``F.cross_entropy`` (bit for
bit on integer-valued tensors where the arithmetic allows it, within a tolerance measured in the same run
for the loss), and counts your collectives with a tracer: make every collective through
``refimpl.comm.ops`` (same signatures as ``torch.distributed``), or the grader cannot see it.

You may use ``torch``, ``torch.nn.functional`` and ``refimpl.comm.ops``; do not import
``refimpl.parallel.tensor_parallel`` (that is the answer). Chapter 06 explains each piece.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it: get_world_size, get_rank)
import torch.nn.functional as F  # noqa: F401  (you will need it)
from torch import nn

from refimpl.comm import ops  # noqa: F401  (you will need it)

Group = dist.ProcessGroup | None
"""A tensor-parallel process group; ``None`` is the default group. Pass it to every collective, and take
the rank and the size from it (``dist.get_rank(group)``, ``dist.get_world_size(group)``)."""


# ---- 1 and 2: the conjugate pair ---------------------------------------------------------------------------


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """``f``: forward ``y = x``; backward ``dx = sum_r dy_r`` over the ranks of ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        raise NotImplementedError("f forward: the input is already whole on every rank")

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        raise NotImplementedError("f backward: sum the gradient over the group (one gradient per input)")


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``f`` (Megatron-LM's ``copy_to_tensor_model_parallel_region``): identity forward, all-reduce (sum)
    of the gradient backward, over the ranks of ``group``.

    Contract: ``y`` has ``x``'s values bit for bit and no collective runs in forward; in backward
    ``x.grad = sum_r dy_r``, exactly one ``ops.all_reduce`` of ``x``'s size; ``x`` is never modified.
    On a group of one rank both directions are the identity. ``group`` is the only group you may use
    (the grader also hands you a group that holds just your own rank).
    """
    return _CopyToTensorParallelRegion.apply(x, group)


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """``g``: forward ``y = sum_r x_r`` over the ranks of ``group``; backward ``dx = dy``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        raise NotImplementedError("g forward: sum the partial results over the group")

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        raise NotImplementedError("g backward: what is the gradient of a sum with respect to one term?")


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``g`` (Megatron-LM's ``reduce_from_tensor_model_parallel_region``): all-reduce (sum) forward,
    identity backward, over the ranks of ``group``.

    Contract: ``y = sum_r x_r`` bit for bit (on integer-valued tensors), exactly one ``ops.all_reduce``
    of ``x``'s size in forward, none in backward, ``x.grad = dy``. ``x`` itself is left untouched:
    autograd may have saved it (reduce a copy). On a group of one rank both directions are the identity.
    """
    return _ReduceFromTensorParallelRegion.apply(x, group)


# ---- 3 and 4: the parallel linears -------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """This rank's share of ``linear`` (``Y = X A^T + b``, ``A`` of shape ``[out, in]``) split by its
    **output** features across the ``t`` ranks of ``group``.

    ``__init__`` copies rank ``r``'s contiguous block of rows, ``A[r*out/t : (r+1)*out/t]``, into
    ``self.weight`` (an ``nn.Parameter`` of shape ``[out/t, in]``) and the same block of ``linear.bias``
    into ``self.bias`` (``[out/t]``; ``None`` when ``linear`` has no bias). The layer holds nothing else
    (no parameter or buffer with the full weight). ``out`` that does not divide by ``t``: ``ValueError``.

    ``forward(x)``: ``x`` ``[..., in]`` is whole, the same on every rank; returns this rank's block of
    the output features, ``[..., out/t]``, equal to ``linear(x)[..., r*out/t : (r+1)*out/t]``. In
    backward, ``x.grad`` must be the full layer's ``dL/dx``; the weight and bias gradients are the
    blocks of the full layer's. Use your ``copy_to_tensor_parallel_region`` (one all-reduce, in backward).
    """

    def __init__(self, linear: nn.Linear, *, group: Group) -> None:
        super().__init__()
        raise NotImplementedError("ColumnParallelLinear: keep this rank's block of the output features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("ColumnParallelLinear.forward: [..., in] -> [..., out/t]")


class RowParallelLinear(nn.Module):
    """This rank's share of ``linear`` (``Y = X A^T + b``, ``A`` of shape ``[out, in]``) split by its
    **input** features across the ``t`` ranks of ``group``.

    ``__init__`` copies rank ``r``'s contiguous block of columns, ``A[:, r*in/t : (r+1)*in/t]``, into
    ``self.weight`` (an ``nn.Parameter`` of shape ``[out, in/t]``) and the whole ``linear.bias`` into
    ``self.bias`` (``[out]``; ``None`` when ``linear`` has no bias). The layer holds nothing else.
    ``in`` that does not divide by ``t``: ``ValueError``.

    ``forward(x)``: ``x`` ``[..., in/t]`` is this rank's block of the input features (what a column-parallel
    layer before it returns); returns the whole output ``[..., out]``, equal to the full layer's on the whole
    input, on every rank. In backward, ``x.grad`` is this rank's block of the full layer's ``dL/dx``; the
    weight gradient is the block of the full layer's, the bias gradient the full layer's. Use your
    ``reduce_from_tensor_parallel_region`` (one all-reduce of the output, in forward).
    """

    def __init__(self, linear: nn.Linear, *, group: Group) -> None:
        super().__init__()
        raise NotImplementedError("RowParallelLinear: keep this rank's block of the input features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("RowParallelLinear.forward: [..., in/t] -> [..., out], whole")


# ---- 5: the loss on vocabulary-sharded logits --------------------------------------------------------------


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *,
                                 group: Group) -> torch.Tensor:
    """Per-token cross entropy from logits split by the vocabulary over the ``t`` ranks of ``group``.

    ``logits_shard`` ``[..., V/t]`` (float32, any leading dims) holds columns ``[r*V/t, (r+1)*V/t)`` of
    the full logits ``z`` ``[..., V]``; ``target`` ``[...]`` holds token ids in ``[0, V)``, the same on
    every rank. Return the loss ``[...]`` (float32, the same on every rank), equal to
    ``F.cross_entropy(z, target, reduction="none")`` (flattened as it needs), i.e. per token
    ``log sum_v exp(z_v) - z_target``, and its gradient with respect to ``logits_shard``: this rank's
    block of ``F.cross_entropy``'s.

    Contract:

    * never build the full logits: in forward the ranks exchange at most three tensors of the size of
      ``target`` in float32 (through ``refimpl.comm.ops``); backward exchanges nothing;
    * finite and right for logits of any size, ``+-200`` included (``exp(89)`` overflows float32);
    * ``logits_shard`` is not modified.

    Hints: a ``torch.autograd.Function`` whose forward saves what the backward needs; only one rank owns
    each target; ``ops.ReduceOp.MAX`` exists.
    """
    raise NotImplementedError("vocab_parallel_cross_entropy: max, target logit and sum-exp, across ranks")


# ---- 6, 7 and 8: sequence parallelism's conjugates along the sequence (dim 1) ------------------------------


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence parallelism (Korthikanti et al. 2022): keep this rank's chunk of the sequence.

    ``x`` ``[b, s, ...]`` is whole and the same on every rank of ``group`` (``t`` ranks, this one ``r``).
    Contract: returns ``x[:, r*s/t : (r+1)*s/t]`` (values bit for bit) with no collective in forward; in
    backward ``x.grad`` is ``[b, s, ...]``, the output gradients of the ``t`` ranks laid side by side along
    dim 1 in rank order, made with exactly one all-gather (``ops.all_gather_into_tensor`` or
    ``ops.all_gather``) of ``x``'s size. ``x`` is never modified. ``s`` that does not divide by ``t``:
    ``ValueError``. On a group of one rank both directions are the identity.
    """
    raise NotImplementedError("scatter_to_sequence_parallel_region: my chunk of dim 1; backward?")


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence parallelism's ``g-bar`` (Korthikanti et al. 2022, figure 5): gather the sequence.

    ``x`` ``[b, s/t, ...]`` is this rank's chunk of the sequence. Contract: returns ``[b, s, ...]``, the
    chunks of the ``t`` ranks of ``group`` side by side along dim 1 in rank order (bit for bit), made with
    exactly one all-gather of the output's size in forward; in backward ``x.grad`` is this rank's chunk
    along dim 1 of ``sum_k dy_k``, the output gradients summed over the ranks (every rank's branch used
    the whole sequence), made with exactly one ``ops.reduce_scatter_tensor`` of ``dy``'s size. ``x`` is
    never modified. On a group of one rank both directions are the identity.
    """
    raise NotImplementedError("gather_from_sequence_parallel_region: all-gather dim 1; backward?")


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence parallelism's ``g`` (Korthikanti et al. 2022): sum the partial results, keep my chunk.

    ``x`` ``[b, s, ...]`` is this rank's partial result (a row-parallel layer's). Contract: returns this
    rank's chunk along dim 1 of ``sum_k x_k`` over the ranks of ``group``, ``[b, s/t, ...]`` (bit for bit
    on integer-valued tensors), made with exactly one ``ops.reduce_scatter_tensor`` of ``x``'s size (not an
    all-reduce: twice the bytes); in backward ``x.grad`` is ``[b, s, ...]``, the output gradients of the
    ``t`` ranks side by side along dim 1 in rank order, made with exactly one all-gather of ``x``'s size.
    ``x`` is never modified. ``s`` that does not divide by ``t``: ``ValueError``. On a group of one rank
    both directions are the identity.
    """
    raise NotImplementedError("reduce_scatter_to_sequence_parallel_region: reduce-scatter dim 1; backward?")


# ---- 9: the fused query/key/value weight -------------------------------------------------------------------


def shard_fused_qkv(tensor: torch.Tensor, *, num_heads: int, group: Group) -> torch.Tensor:
    """This rank's column-parallel shard of a fused query/key/value projection, from nanoGPT's row order.

    ``tensor`` is the fused weight ``[3h, h]`` or bias ``[3h]`` (``h = a d``, ``a = num_heads``) with its rows
    in nanoGPT's order ``[3, a, d]``: all heads' queries, then all keys, then all values (``q, k, v =
    qkv.split(h, dim=-1)``). refimpl's attention (``refimpl.models.CausalSelfAttention``, chapter 06) reads
    its fused rows in Megatron's per-head order ``[a', 3, d]``: head ``i``'s q, k and v rows one after the
    other, for each of its ``a'`` heads.

    Contract: returns a new tensor of ``3h/t`` rows (``[3h/t, h]`` or ``[3h/t]``) that, as the
    ``query_key_value`` shard of refimpl's attention with ``a/t`` heads, makes this rank compute heads
    ``[r a/t, (r+1) a/t)`` of the one-device model (rank ``r`` of the ``t`` ranks of ``group``); ``tensor``
    is not modified; ``num_heads`` that does not divide by ``t``: ``ValueError``. No communication.
    """
    raise NotImplementedError("shard_fused_qkv: whole heads, in the order refimpl's attention reads them")
