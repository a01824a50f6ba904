"""Who the ranks are and how they are arranged (chapters 00 and 10).

- ``refimpl.distributed.env``: the process group from the torchrun environment, the device, seeding,
  teardown (chapter 00).
- ``refimpl.distributed.grid``: ``RankGrid``, the rank grid as data (named axes, row-major), its
  groups and a second factorization of the same ranks (``refactor``).
- ``refimpl.distributed.mesh``: ``ParallelDims``, the ``pp x dp x cp x tp`` layout of the ranks and
  one process group per axis and per view (``loss`` = ``dp x cp``) (chapter 12, used from chapter 06 on).
- ``refimpl.distributed.group_info``: ``group_rank_size``, a rank's index in a group and its size.
- ``refimpl.distributed.placement``: ``Box`` and ``LocalShard``, the one shard descriptor (an
  N-D box of a global tensor) that ZeRO, tensor parallelism and the checkpoint share; ``chunk_range``.

``from refimpl.distributed import init_distributed`` keeps working: env's public names are re-exported here.
"""

from refimpl.distributed.env import (
    DistributedContext,
    all_reduce_mean,
    choose_device,
    init_distributed,
    log0,
    seed_everything,
    teardown,
)
from refimpl.distributed.grid import RankGrid
from refimpl.distributed.group_info import group_rank_size
from refimpl.distributed.mesh import ParallelDims
from refimpl.distributed.placement import Box, LocalShard, chunk_range

__all__ = [
    "Box",
    "DistributedContext",
    "LocalShard",
    "ParallelDims",
    "RankGrid",
    "all_reduce_mean",
    "choose_device",
    "chunk_range",
    "group_rank_size",
    "init_distributed",
    "log0",
    "seed_everything",
    "teardown",
]
