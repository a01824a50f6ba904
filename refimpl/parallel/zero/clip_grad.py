"""Clipping by the global gradient norm when each rank holds a disjoint shard of the gradients (chapter 04).

Used by ZeRO-1/2 (``refimpl.parallel.zero.ShardedOptimizer``) and ZeRO-3
(``refimpl.parallel.zero.FullyShardedDataParallel``): the same rule as
``torch.nn.utils.clip_grad_norm_``, from the shards, with one all-reduce. It is the one norm of refimpl
(``refimpl.parallel.placements.clip_grad_norm_``) with every shard placed over one axis, the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.distributed.placement import Box
from refimpl.parallel.placements import (
    DP,
    HeldGradient,
    Placement,
    clip_grad_norm_,
    scale_to_max_norm_,
    sum_of_squares,
)

__all__ = ["clip_sharded_grad_norm_", "scale_to_max_norm_", "sum_of_squares"]


def clip_sharded_grad_norm_(grads: list[torch.Tensor], max_norm: float, *, device: torch.device,
                            group: dist.ProcessGroup | None, world_size: int) -> torch.Tensor:
    """Clip by the global norm when each rank holds a disjoint shard of the gradients.

    ||g||^2 = sum over ranks of the local sums of squares (one all-reduce); then every shard is scaled by
    min(1, max_norm / (||g|| + 1e-6)), the rule of ``torch.nn.utils.clip_grad_norm_``. Returns ||g||.
    """
    held = [HeldGradient(str(i), g, Placement(box=Box.full(g.shape), sharded_over=(DP,)))
            for i, g in enumerate(grads)]
    if not held:  # nothing held here; the other ranks' shards still need this rank's zero in the sum
        held = [HeldGradient("", torch.zeros((), device=device), Placement(box=Box.full(()),
                                                                            sharded_over=(DP,)))]
    if world_size > 1 and group is None:
        group = dist.group.WORLD  # torch's default group (a placement's None is an axis of one rank)
    return clip_grad_norm_(held, max_norm, groups={DP: group if world_size > 1 else None},
                           device=device)
