"""The global gradient norm when tensor-parallel ranks hold shards of some parameters (chapter 06).

``||g||^2`` is the sum of the squares of every element of the *model's* gradient, each counted once. Under
tensor parallelism a sharded parameter's gradient is split over the ``t`` ranks of the group (each element
on one rank), a replicated one (layer norms, position embeddings, row-parallel biases) is whole on every
rank: summing everything over the group would count the replicated ones ``t`` times, and clipping by each
rank's own norm would scale the replicas differently, so they would drift apart. Megatron-LM
(``get_grad_norm_fp32``) counts a replicated parameter on TP rank 0 only and all-reduces the sum; so do we.
Under ZeRO-1/2 the rank's gradients are also row shards over the data-parallel group: one more all-reduce
over that group (the shards are disjoint there too). Then every gradient is scaled by
``min(1, max_norm / (||g|| + 1e-6))``, ``torch.nn.utils.clip_grad_norm_``'s rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from refimpl.comm import ops
from refimpl.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from refimpl.parallel.tensor_parallel.tp_communications import Group, group_rank, group_size
from refimpl.parallel.tensor_parallel.vocab_parallel import VocabParallelEmbedding
from refimpl.parallel.zero.clip_grad import scale_to_max_norm_, sum_of_squares

__all__ = ["clip_grad_norm_tensor_parallel_", "tensor_parallel_sharded"]


def tensor_parallel_sharded(model: nn.Module) -> set[int]:
    """``id`` of every parameter that the TP ranks hold in disjoint blocks (the weights of column, row and
    vocab-parallel layers and the column layers' biases); every other parameter is replicated."""
    out: set[int] = set()
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)) and m.tp_size > 1:
            out.update(id(p) for p in m.parameters(recurse=False))
        elif isinstance(m, RowParallelLinear) and m.tp_size > 1:
            out.add(id(m.weight))
    return out


@torch.no_grad()
def clip_grad_norm_tensor_parallel_(grads: Sequence[torch.Tensor], sharded: Sequence[bool], max_norm: float,
                                    *, tp_group: Group, dp_group: Group = None,
                                    device: torch.device) -> torch.Tensor:
    """Clip ``grads`` (this rank's) by the norm of the whole model's gradient; return that norm.

    ``sharded[i]``: ``grads[i]`` belongs to a TP-sharded parameter (counted on every rank), else to a
    replicated one (counted on TP rank 0). ``dp_group``: the group over which ``grads`` are disjoint row
    shards too (ZeRO-1/2), None when they are whole over data parallelism.
    """
    if len(grads) != len(sharded):
        raise ValueError(f"{len(grads)} gradients but {len(sharded)} sharded flags")
    first = group_rank(tp_group) == 0
    counted = [g for g, is_sharded in zip(grads, sharded, strict=True) if is_sharded or first]
    sq = sum_of_squares(counted, device=device)
    if group_size(tp_group) > 1:
        ops.all_reduce(sq, group=tp_group)
    if dp_group is not None and group_size(dp_group) > 1:
        ops.all_reduce(sq, group=dp_group)
    return scale_to_max_norm_(list(grads), sq.sqrt(), max_norm)
