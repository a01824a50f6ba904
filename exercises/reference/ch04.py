"""Chapter 04's reference answers: refimpl's own implementations, graded like a learner's file."""

from refimpl.distributed.placement import Box
from refimpl.parallel.zero import install_unit_hooks, reshard_, sharded_step, unshard_
from refimpl.planner import shard_rows

__all__ = ["install_unit_hooks", "reshard_", "rows_of_2d_shard", "shard_rows", "sharded_step", "unshard_"]


def rows_of_2d_shard(out_features: int, *, tp_rank: int, tp_size: int, dp_rank: int,
                     dp_size: int) -> tuple[int, int]:
    """The box ``FullyShardedDataParallel.local_shards`` declares for a tensor-parallel weight: the TP block
    (``Box.chunk`` along dim 0, what ``ColumnParallelLinear.local_shards`` holds), then ZeRO-3's rows of
    that block (``Box.chunk`` of the block's shape) placed inside it (``Box.within``)."""
    block = Box.chunk((out_features,), 0, tp_rank, tp_size)
    rows = block.within(Box.chunk(block.shape, 0, dp_rank, dp_size))
    return rows.offsets[0], rows.offsets[0] + rows.shape[0]
