"""Clipping by the global gradient norm when each rank holds a disjoint shard of the gradients (chapter 04).

Used by ZeRO-1/2 (:class:`~refimpl.parallel.zero.ShardedOptimizer`) and ZeRO-3
(:class:`~refimpl.parallel.zero.FullyShardedDataParallel`): the same rule as
``torch.nn.utils.clip_grad_norm_``, from the shards, with one all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.comm import ops


@torch.no_grad()
def clip_sharded_grad_norm_(grads: list[torch.Tensor], max_norm: float, *, device: torch.device,
                            group: dist.ProcessGroup | None, world_size: int) -> torch.Tensor:
    """Clip by the global norm when each rank holds a disjoint shard of the gradients.

    ||g||^2 = sum over ranks of the local sums of squares (one all-reduce); then every shard is scaled by
    min(1, max_norm / (||g|| + 1e-6)), the rule of ``torch.nn.utils.clip_grad_norm_``. Returns ||g||.
    """
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.float().pow(2).sum()
    if world_size > 1:
        ops.all_reduce(sq, group=group)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm
