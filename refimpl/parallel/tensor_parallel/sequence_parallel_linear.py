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
parameters' gradients in their own dtype, as autocast's own ``linear`` does. The autograd function is the
one linear seam, ``refimpl.nn.linear.linear_with_grad``; this module names its group.
"""

from __future__ import annotations

import functools

import torch

from refimpl.nn.linear import Matmul, SequenceGather, WeightGradQueue, linear_with_grad
from refimpl.parallel.tensor_parallel.tp_communications import (
    SEQUENCE_DIM,
    Group,
    _all_gather,
    _reduce_scatter,
    group_size,
)

__all__ = ["linear_with_sequence_parallel_gather", "sequence_gather"]


def sequence_gather(group: Group) -> SequenceGather:
    """The all-gather / reduce-scatter pair along the sequence (dim 1) over ``group``."""
    return SequenceGather(all_gather=functools.partial(_all_gather, dim=SEQUENCE_DIM, group=group),
                          reduce_scatter=functools.partial(_reduce_scatter, dim=SEQUENCE_DIM, group=group))


def linear_with_sequence_parallel_gather(x_local: torch.Tensor, weight: torch.Tensor,
                                         bias: torch.Tensor | None, group: Group, *,
                                         weight_grad_store: WeightGradQueue | None = None,
                                         matmul: Matmul | None = None) -> torch.Tensor:
    """``all_gather_seq(x_local) @ weight.T + bias`` saving only ``x_local`` (module docstring);
    ``[b, s/t, in] -> [b, s, out/t]``. A group of one is the plain linear. ``weight_grad_store``: ``dW``
    queued there (zero-bubble's ``W``), not returned; ``matmul``: the seam's product (fp8's
    ``refimpl.precision.fp8.Float8Matmul`` computes the backward GEMMs too)."""
    if group_size(group) == 1:
        return linear_with_grad(x_local, weight, bias, weight_grad_store=weight_grad_store, matmul=matmul)
    return linear_with_grad(x_local, weight, bias, sequence_gather=sequence_gather(group),
                            weight_grad_store=weight_grad_store, matmul=matmul)
