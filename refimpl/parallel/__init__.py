"""Parallelism strategies built from scratch, one file each.

* ``refimpl.parallel.data_parallel``: ``DataParallelNaive`` and ``DataParallelBucket`` (chapter 03);
* ``refimpl.parallel.zero``: ZeRO-1/2 ``ShardedOptimizer`` and ZeRO-3 ``FullyShardedDataParallel``, with
  its memory formulas in ``refimpl.planner.zero_state`` and its bytes, counted from the tensors, in
  ``refimpl.measure.state`` (chapter 04);
* ``refimpl.parallel.activation_checkpoint``: activation checkpointing of transformer blocks (chapter 05);
* ``refimpl.parallel.parallelize``: ``parallelize(model, groups, config)`` applies them all in one
  documented order, data parallel / ZeRO outermost (chapter 12; the trainer's setup).

Import from the submodules, e.g. ``from refimpl.parallel.data_parallel import DataParallelBucket``.
"""
