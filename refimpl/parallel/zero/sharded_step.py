"""One ZeRO step tensor by tensor: the lesson (exercise 04.2) that ``ShardedOptimizer`` does in buckets.

The naive version, kept beside ``refimpl.parallel.zero.sharded_optimizer``: the step between them
(buckets, a hook during backward for stage 2, consolidated state dicts) is chapter 04's lesson.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from refimpl.parallel.zero.sharding import ShardSpec
from refimpl.parallel.zero.zero_communications import _world, all_gather_into, reduce_scatter_mean


def sharded_step(
    params: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None = None,
) -> None:
    """One ZeRO step, tensor by tensor: the lesson that ``ShardedOptimizer`` does in buckets.

    ``shards[i]`` is this rank's rows of ``params[i]`` (a view, see ``shard_of``) and ``optimizer``
    steps the shards. Each local gradient ``params[i].grad`` is reduce-scattered: the shard receives the
    mean over ranks of its rows. The optimizer steps the shards, and each parameter's rows are all-gathered
    back into the full parameter on every rank. Parameters without a gradient are skipped.
    """
    rank, n = _world(group)
    stepped = []
    for p, shard in zip(params, shards, strict=True):
        if p.grad is None:
            continue
        spec = ShardSpec(p.shape, rank, n)
        shard.grad = reduce_scatter_mean([p.grad], [spec], group)[0].clone()
        stepped.append((p, shard, spec))
    optimizer.step()
    with torch.no_grad():
        for p, shard, spec in stepped:
            all_gather_into([shard], [spec], [p.detach()], group)
            shard.grad = None
