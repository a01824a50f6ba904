"""The column-parallel matmul under sequence parallelism that saves only ``s/t`` of its input (chapter 06).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.2.2:
under sequence parallelism the input of a column-parallel linear arrives split along the sequence,
``X_r: [b, s/t, h]``, and is all-gathered to ``X: [b, s, h]`` for ``Y_r = X A_r^T + b_r``. Autograd would save
the gathered ``X`` for the weight gradient ``dA_r = dY_r^T X``, ``t`` times what the rank holds, which undoes
sequence parallelism's saving (the ``34/t`` of the paper's ``sbh(34/t + 5as/(ht))`` counts ``X`` as ``s/t``
tokens). So, as Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` does, this function
saves ``X_r`` only and all-gathers it again in backward:

* forward: ``X = all_gather_seq(X_r)`` (one all-gather), ``Y_r = X A_r^T + b_r``;
* backward: ``X = all_gather_seq(X_r)`` again (one more all-gather), ``dX = dY_r A_r`` (a partial sum over
  the ranks' output blocks), ``dX_r = reduce_scatter_seq(dX)`` (one reduce-scatter),
  ``dA_r = dY_r^T X``, ``db_r = sum dY_r``.

The extra all-gather moves ``(t-1)/t b s h`` elements per rank per backward: activation memory traded for
communication (Megatron overlaps it with the ``dX`` matmul; gloo on CPU cannot show that). Under autocast
the forward matmul runs in the autocast dtype; backward computes in the dtype of ``dY`` and returns the
parameters' gradients in their own dtype, as autocast's own ``linear`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refimpl.parallel.tensor_parallel.tp_communications import (
    SEQUENCE_DIM,
    Group,
    _all_gather,
    _reduce_scatter,
    group_size,
)

__all__ = ["linear_with_sequence_parallel_gather"]


class _LinearWithSequenceParallelGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: Group) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x_local, weight)                        # [b, s/t, in]: not the gathered X
        x = _all_gather(x_local, SEQUENCE_DIM, group)                 # [b, s, in]
        return F.linear(x, weight, bias)                              # [b, s, out/t]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_local, weight = ctx.saved_tensors
        x = _all_gather(x_local, SEQUENCE_DIM, ctx.group).to(dy.dtype)  # [b, s, in], gathered again
        dx = dy.matmul(weight.to(dy.dtype))                           # [b, s, in], a partial sum over ranks
        dx_local = _reduce_scatter(dx, SEQUENCE_DIM, ctx.group)       # [b, s/t, in]
        dy2 = dy.reshape(-1, dy.shape[-1])                            # [b*s, out/t]
        dw = dy2.t().matmul(x.reshape(-1, x.shape[-1])).to(weight.dtype)  # [out/t, in]
        db = dy2.sum(0).to(weight.dtype) if ctx.has_bias else None   # [out/t]
        return dx_local.to(x_local.dtype), dw, db, None


def linear_with_sequence_parallel_gather(x_local: torch.Tensor, weight: torch.Tensor,
                                         bias: torch.Tensor | None, group: Group) -> torch.Tensor:
    """``all_gather_seq(x_local) @ weight.T + bias`` saving only ``x_local`` (module docstring);
    ``[b, s/t, in] -> [b, s, out/t]``. A group of one is ``F.linear``."""
    if group_size(group) == 1:
        return F.linear(x_local, weight, bias)
    if x_local.dim() < 2:
        raise ValueError("sequence-parallel linear: needs [batch, seq, ...] input, got shape "
                         f"{tuple(x_local.shape)}")
    if torch.is_autocast_enabled(x_local.device.type):  # the forward matmul in the autocast dtype
        dtype = torch.get_autocast_dtype(x_local.device.type)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        x_local = x_local.to(dtype)
    return _LinearWithSequenceParallelGather.apply(x_local, weight, bias, group)
