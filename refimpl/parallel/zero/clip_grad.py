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
    sq = sum_of_squares(grads, device=device)
    if world_size > 1:
        ops.all_reduce(sq, group=group)
    return scale_to_max_norm_(grads, sq.sqrt(), max_norm)


def sum_of_squares(grads: list[torch.Tensor], *, device: torch.device) -> torch.Tensor:
    """``sum_i ||g_i||^2`` in float32 (a 0-dim tensor on ``device``)."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.float().pow(2).sum()
    return sq


def scale_to_max_norm_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s rule); return
    ``norm``."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm
