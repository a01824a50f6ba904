"""Parallelism strategies built from scratch, one file each.

* :mod:`refimpl.parallel.data_parallel`: ``DataParallelNaive`` and ``DataParallelBucket`` (chapter 03);
* :mod:`refimpl.parallel.zero`: ZeRO-1/2 ``ShardedOptimizer`` and ZeRO-3 ``FullyShardedDataParallel``, with
  :mod:`~refimpl.parallel.zero_planner` (the memory formulas) and :mod:`~refimpl.parallel.memory` (bytes
  counted from the tensors) (chapter 04).

Import from the submodules, e.g. ``from refimpl.parallel.data_parallel import DataParallelBucket``.
"""
