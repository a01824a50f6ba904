"""Exercises of chapter 06: tensor parallelism, Megatron-style (Shoeybi et al. 2019).

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=06`` (or
``python -m exercises.grade 06``) to see your score per task. Every task is graded on 2 ranks (a
tensor-parallel group of ``t = 2``), each rank loading this file again:

1. ``copy_to_tensor_parallel_region`` (Megatron's ``f``) and
2. ``reduce_from_tensor_parallel_region`` (``g``), two autograd functions conjugate to each other;
3. ``ColumnParallelLinear`` and 4. ``RowParallelLinear``, each built from a full ``nn.Linear``;
5. ``vocab_parallel_cross_entropy``, the loss computed from vocabulary-sharded logits.

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
"""A tensor-parallel process group; ``None`` is the default group. Pass it to every collective."""


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
