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

Which parameters are sharded the modules say themselves: a box (``local_shards()``) that is not the whole
tensor. The norm is refimpl's one norm over placements (``refimpl.parallel.placements.clip_grad_norm_``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from refimpl.distributed.placement import Box, module_shards
from refimpl.parallel.placements import DP, HeldGradient, Placement, clip_grad_norm_
from refimpl.parallel.tensor_parallel.tp_communications import Group, group_size

__all__ = ["clip_grad_norm_tensor_parallel_", "tensor_parallel_sharded"]


def tensor_parallel_sharded(model: nn.Module) -> set[str]:
    """The names of the parameters that the TP ranks hold in disjoint blocks (the weights of column, row
    and vocab-parallel layers and the column layers' biases: their declared box is not the whole tensor);
    every other parameter is replicated."""
    return {name for name, s in module_shards(model).items() if not s.box.is_full}


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
    dp = () if dp_group is None or group_size(dp_group) == 1 else (DP,)
    held = [HeldGradient(str(i), g, Placement(box=Box.full(g.shape), sharded_over=(("tp",) if s else ()) + dp,
                                              replicated_over=() if s else ("tp",)))
            for i, (g, s) in enumerate(zip(grads, sharded, strict=True))]
    tp_axis = HeldGradient("", torch.zeros((), device=device),  # the sum goes over tp even if no shard here
                           Placement(box=Box.full(()), sharded_over=("tp",)))
    return clip_grad_norm_([*held, tp_axis], max_norm, groups={"tp": tp_group, DP: dp_group},
                           device=device)
