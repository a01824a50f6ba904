"""Data parallelism: every rank holds the whole model, trains on its own shard of the global batch, and
the gradients are averaged across ranks before the optimizer step (chapter 03).

**Why averaging is exact.** Let the global batch of ``N`` tokens be cut into ``W`` equal shards ``S_r``, and
let rank ``r`` compute the mean loss over its shard, ``L_r = (W/N) sum_{t in S_r} l_t``. The loss of the
global batch is ``L = (1/N) sum_t l_t = (1/W) sum_r L_r``, and the gradient is linear, so

    grad L = (1/W) sum_r grad L_r            (the mean of the per-rank gradients).

One all-reduce of the gradients followed by a division by ``W`` therefore gives every rank the gradient of
the whole global batch, and identical replicas that apply identical updates stay identical. With shards
of *unequal* token counts the per-rank means must not be averaged; normalise each rank's summed loss by the
global token count ``N`` instead (``refimpl.models.lm_loss(num_tokens=N)``) and sum the gradients
(``average_gradients=False``). Gradient accumulation is the same sum over ``A`` micro-batches in time:
global batch = micro-batch x ``A`` x ``W``, each micro-batch loss divided by ``A``.

**Sum or mean.** Both wrappers *average* by default, like ``torch.nn.parallel.DistributedDataParallel``
(so a loop written for DDP keeps its loss normalisation), and, like DDP, divide each gradient by ``W``
*before* the sum: the values on the wire keep the magnitude of one gradient, which matters for the fp16
hook. For ``W`` a power of two the division is exact, so dividing before or after gives the same bits.

**Cost.** A ring all-reduce of ``G`` bytes sends ``2 (W-1)/W * G`` bytes per rank; a step of data
parallelism all-reduces every gradient once: ``G = 4 x parameters`` bytes in fp32.

Two implementations, the naive one beside the real one (Li et al. 2020, "PyTorch Distributed: Experiences
on Accelerating Data Parallel Training", VLDB):

* ``DataParallelNaive``: after ``backward()`` one blocking all-reduce per parameter tensor. Correct,
  but it pays the latency of one collective per tensor and communicates only once compute has stopped.
* ``DataParallelBucket``: gradients are packed into buckets of about ``bucket_cap_mb``, in reverse
  order of registration (the order backward produces them), and each bucket's all-reduce is launched
  asynchronously by a gradient hook as soon as its last gradient is final, so communication overlaps the
  rest of backward. ``finish_gradient_synchronization()`` waits for them before ``optimizer.step()``.

Every collective goes through ``refimpl.comm.ops``, so a ``refimpl.comm.tracer.CommTracer``
sees the traffic, and every synchronised backward leaves a ``SyncTimeline`` to draw the overlap.

The files, one concept each: ``.data_parallel_naive`` (the naive wrapper and its sync),
``.data_parallel`` (the bucketed wrapper: hooks, overlap, ``no_sync``), ``.bucket`` (the cut into
buckets), ``.data_parallel_communications`` (equal start, the one average ``all_reduce_mean_`` and
``sync_bucket``, the async reduction and the communication hooks: fp16/bf16 on the wire, and 16 bits on the
wire summed in fp32 as chapter 05 does), ``.timeline`` (``SyncTimeline``).
"""

from refimpl.parallel.data_parallel.bucket import assign_buckets, num_buckets
from refimpl.parallel.data_parallel.data_parallel import DataParallelBucket
from refimpl.parallel.data_parallel.data_parallel_communications import (
    CommHook,
    PendingReduce,
    all_reduce_mean_,
    allreduce_hook,
    broadcast_module,
    ddp_comm_hook,
    fp32_accumulating_comm_hook,
    low_precision_all_reduce_,
    low_precision_hook,
    reduce_gradients_,
    start_low_precision_all_reduce_,
    sync_bucket,
)
from refimpl.parallel.data_parallel.data_parallel_naive import DataParallelNaive, sync_gradients_naive
from refimpl.parallel.data_parallel.timeline import SyncTimeline

__all__ = [
    "CommHook",
    "DataParallelBucket",
    "DataParallelNaive",
    "PendingReduce",
    "SyncTimeline",
    "all_reduce_mean_",
    "allreduce_hook",
    "assign_buckets",
    "broadcast_module",
    "ddp_comm_hook",
    "fp32_accumulating_comm_hook",
    "low_precision_all_reduce_",
    "low_precision_hook",
    "num_buckets",
    "reduce_gradients_",
    "start_low_precision_all_reduce_",
    "sync_bucket",
    "sync_gradients_naive",
]
