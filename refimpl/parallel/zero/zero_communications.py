"""ZeRO's collectives over packed shards: the mean reduce-scatter, the all-gather, stage 0's all-reduce.

One reduce-scatter (``reduce_scatter_mean``) or all-gather (``all_gather_into``) serves many
tensors at once, packed as ``refimpl.parallel.zero.sharding`` describes. Reduce-scatter + all-gather
move exactly what one all-reduce (``allreduce_gradients``, stage 0) moves (Rajbhandari et al. 2020).
Gradients are averaged over the ranks (sum, then divide by N), as ``DistributedDataParallel`` does; in
fp16 the division is split around the sum, as FSDP2 does (``fp16_divide_factors``). Every call goes
through ``refimpl.comm.ops``, so ``refimpl.comm.tracer.CommTracer`` sees it (chapter 04).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size
from refimpl.parallel.data_parallel.data_parallel_communications import sync_bucket
from refimpl.parallel.zero.sharding import (
    ShardSpec,
    copy_out_all_gather,
    pack_for_all_gather,
    pack_for_reduce_scatter,
    unpack_reduce_scatter,
)


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` when torch.distributed is not initialised."""
    return group_rank_size(group)


def fp16_divide_factors(world_size: int) -> tuple[int, int]:
    """``(pre, post)`` with ``pre * post = N``, ``pre`` the smallest power of two >= ``sqrt(N)``: FSDP2
    divides fp16 gradients by ``pre`` before the sum and by ``post`` after it, so neither the summands
    underflow nor the sum overflows fp16's range (``_get_gradient_divide_factors`` in torch)."""
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return pre, world_size // pre


def reduce_scatter_mean(
    grads: Sequence[torch.Tensor], specs: Sequence[ShardSpec], group: dist.ProcessGroup | None, *,
    divide_factor: int | None = None,
) -> list[torch.Tensor]:
    """Mean over the ranks of this rank's shard of each gradient: one reduce-scatter for all of them.

    The collective runs in the gradients' dtype: sum, then divide by N (exact at N = 2, 4 in fp32 and
    bf16). In fp16 the division is split around the sum (``fp16_divide_factors``), as FSDP2 does.
    ``divide_factor``: divide the sum by it instead of N (FSDP2's ``set_gradient_divide_factor``: expert
    gradients, summed over the expert-data-parallel group and divided by ``dp x cp``; chapter 09).
    """
    return unpack_reduce_scatter(reduce_scatter_mean_packed(grads, specs, group, divide_factor=divide_factor),
                                 specs)


def reduce_scatter_mean_packed(
    grads: Sequence[torch.Tensor], specs: Sequence[ShardSpec], group: dist.ProcessGroup | None, *,
    divide_factor: int | None = None,
) -> torch.Tensor:
    """``reduce_scatter_mean`` before unpacking: this rank's padded shard of all the gradients, flat
    ``[S]`` (what HSDP all-reduces over the replicas, padding included, as FSDP2 does)."""
    n = specs[0].world_size
    d = n if divide_factor is None else divide_factor
    packed = pack_for_reduce_scatter(grads, specs)  # [N, S]
    reduced = packed.new_empty(packed.shape[1])  # [S]
    if n > 1:
        pre, post = fp16_divide_factors(d) if packed.dtype == torch.float16 else (1, d)
        if pre != 1:
            packed.div_(pre)
        ops.reduce_scatter_tensor(reduced, packed.view(-1), group=group)
        if post != 1:
            reduced.div_(post)
    else:
        reduced.copy_(packed[0])
        if d != 1:
            reduced.div_(d)
    return reduced


def all_reduce_mean_(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Mean over the ranks of ``group``, in place, of a flat tensor (HSDP's second reduction: a padded
    gradient shard over its replicas, after the reduce-scatter, FSDP2's order). Sum, then divide by R
    (exact for R a power of two in fp32 and bf16); in fp16 the division is split around the sum as in
    ``reduce_scatter_mean``."""
    _, r = _world(group)
    pre, post = fp16_divide_factors(r) if flat.dtype == torch.float16 else (1, r)
    if pre != 1:
        flat.div_(pre)
    ops.all_reduce(flat, group=group)
    if post != 1:
        flat.div_(post)
    return flat


def all_gather_into(
    shards: Sequence[torch.Tensor], specs: Sequence[ShardSpec], fulls: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
) -> None:
    """Write every rank's shards into ``fulls``: one all-gather for all of them."""
    n = specs[0].world_size
    packed = pack_for_all_gather(shards, specs)  # [S]
    gathered = packed.new_empty(n * packed.numel())  # [N * S]
    if n > 1:
        ops.all_gather_into_tensor(gathered, packed, group=group)
    else:
        gathered.copy_(packed)
    copy_out_all_gather(gathered, specs, fulls)


def allreduce_gradients(
    params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> None:
    """Stage 0, plain data parallelism: average every ``.grad`` over the ranks with one flat all-reduce.

    Chapter 03's ``refimpl.parallel.data_parallel.sync_bucket`` over all gradients: divided by N
    before the sum, as DDP does (stages 1-3 divide after the reduce-scatter, as FSDP2; for N a power of two
    both orders give the same bits, since dividing by 2^k is exact).
    """
    grads = [p.grad for p in params if p.grad is not None]
    _, n = _world(group)
    if grads and n > 1:
        sync_bucket(grads, group)  # [Psi] flat
