"""ZeRO from scratch: a sharded optimizer (stages 1 and 2) and a fully sharded module (stage 3) (chapter 04).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"; the
fully sharded module follows FSDP (Zhao et al. 2023) and its second version, ``fully_shard``.

Data parallelism keeps a full copy of the parameters, the gradients and the optimizer state on every rank.
ZeRO removes the copies one kind at a time, without changing the arithmetic:

* **stage 1** (``ShardedOptimizer``, ``zero_stage=1``): each rank keeps optimizer state for its shard
  only. After backward the gradients are *reduce-scattered* (each rank receives the mean of its shard),
  the rank steps its shard, and the updated shards are *all-gathered* into every rank's full parameters.
  Reduce-scatter + all-gather move exactly what one all-reduce moves: no extra traffic.
* **stage 2** (``zero_stage=2``): the same, but each gradient is reduce-scattered as soon as backward produced
  it (in buckets) and the full gradient is freed: a rank keeps only its shard of the gradients.
* **stage 3** (``FullyShardedDataParallel``): parameters are sharded too. The module is cut into
  *units* (a transformer block each, the rest in the root unit); a unit is all-gathered just before its
  forward, freed after it, all-gathered again before its backward, and its gradients reduce-scattered.
  One extra all-gather per unit: 1.5x the traffic of data parallelism. ``install_unit_hooks`` is the
  same schedule in its simplest form (synchronous, no reduction), the lesson and exercise 04.4-04.5.

**How a tensor is split.** Every parameter is split along dim 0 into chunks of ``ceil(rows / N)`` rows,
rank ``r`` owning chunk ``r`` (FSDP2's ``Shard(0)``; the last ranks may own fewer rows or none). A
collective over several tensors packs them side by side: the input of a reduce-scatter is an ``[N, S]``
matrix whose row ``r`` holds chunk ``r`` of every tensor, each padded to ``ceil(rows / N)`` rows, so one
collective serves many tensors of uneven sizes (``pack_for_reduce_scatter``,
``pack_for_all_gather``, ``copy_out_all_gather``). The padding lives only in these transient
buffers: what a rank keeps is its exact shard, and ``refimpl.planner.zero_state`` predicts its bytes.

Gradients are averaged over the ranks (sum, then divide by N), as ``DistributedDataParallel`` does, so a
loss that is the mean over the rank's tokens gives the mean over the global batch. Every communication
goes through ``refimpl.comm.ops``, so ``refimpl.comm.tracer.CommTracer`` sees it.

One concept per file, imports one way (sharding -> zero_communications, clip_grad -> the rest):

* ``refimpl.parallel.zero.sharding``: ``ShardSpec`` (the rows a rank owns) and the packing of
  many tensors into one collective's buffer;
* ``refimpl.parallel.zero.zero_communications``: ``reduce_scatter_mean``, ``all_gather_into``,
  ``fp16_divide_factors``, stage 0's ``allreduce_gradients``;
* ``refimpl.parallel.zero.clip_grad``: ``clip_sharded_grad_norm_``, the global norm from shards;
* ``refimpl.parallel.zero.sharded_step`` (the lesson) beside
  ``refimpl.parallel.zero.sharded_optimizer`` (stages 1 and 2);
* ``refimpl.parallel.zero.unit_hooks`` (the lesson) beside ``refimpl.parallel.zero.fsdp_unit``,
  ``refimpl.parallel.zero.fsdp_communications`` (a unit's sharding, all-gather and reduce-scatter) and
  ``refimpl.parallel.zero.fully_sharded_data_parallel`` (stage 3: the schedule around them);
* ``refimpl.parallel.zero.fsdp_float8``: under ``--precision fp8`` the fp8 linears' weights all-gathered
  in fp8, one agreed scale per tensor (``enable_float8_all_gather``, chapter 10).

Assumption, as for DDP without ``find_unused_parameters``: every rank uses the same parameters in a step
(collectives are issued in the order gradients arrive, which must be the same everywhere).
"""

from __future__ import annotations

from refimpl.parallel.zero.clip_grad import clip_sharded_grad_norm_  # noqa: F401 - importable here, as before
from refimpl.parallel.zero.fsdp_float8 import Float8Gather, enable_float8_all_gather
from refimpl.parallel.zero.fsdp_unit import FSDPUnit  # noqa: F401 - importable here, as before
from refimpl.parallel.zero.fully_sharded_data_parallel import FullyShardedDataParallel
from refimpl.parallel.zero.sharded_optimizer import ShardedOptimizer, ShardGroup
from refimpl.parallel.zero.sharded_step import sharded_step
from refimpl.parallel.zero.sharding import (
    ShardSpec,
    copy_out_all_gather,
    pack_for_all_gather,
    pack_for_reduce_scatter,
    shard_of,
    unpack_reduce_scatter,
)
from refimpl.parallel.zero.unit_hooks import install_unit_hooks, reshard_, unshard_
from refimpl.parallel.zero.zero_communications import (  # noqa: F401 - importable here, as before (ch04 checks)
    all_gather_into,
    allreduce_gradients,
    fp16_divide_factors,
    reduce_scatter_mean,
)

__all__ = [
    "Float8Gather",
    "FullyShardedDataParallel",
    "ShardGroup",
    "ShardSpec",
    "ShardedOptimizer",
    "allreduce_gradients",
    "copy_out_all_gather",
    "enable_float8_all_gather",
    "fp16_divide_factors",
    "install_unit_hooks",
    "pack_for_all_gather",
    "pack_for_reduce_scatter",
    "reshard_",
    "shard_of",
    "sharded_step",
    "unpack_reduce_scatter",
    "unshard_",
]
