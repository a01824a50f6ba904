"""The collectives of data parallelism (chapter 03): equal start, the gradient average, communication hooks.

* ``broadcast_module`` makes every replica equal to the first rank's at construction;
  ``_check_same_parameters`` fails loudly, not with a hang, when the ranks wrap different models.
* ``all_reduce_mean_``: **the** average over ranks, ``x <- sum_r (x_r / W)``, divided by ``W`` before
  the sum as DDP does (the values on the wire keep the size of one gradient, so fp16 does not overflow; for
  ``W`` a power of two the division is exact and dividing before or after gives the same bits). Every
  gradient average in refimpl calls it: the naive sync per tensor, ``sync_bucket`` on a flat buffer
  (ZeRO stage 0's ``allreduce_gradients``, ``reduce_gradients_``), each bucket of
  ``refimpl.parallel.data_parallel.data_parallel.DataParallelBucket``, ``ddp_comm_hook``.
* ``PendingReduce`` and ``CommHook``: the asynchronous reduction a bucket launches from a gradient
  hook, and the hook that replaces the all-reduce (DDP's ``register_comm_hook``). Two behaviours in low
  precision: ``low_precision_hook`` casts to fp16/bf16 and all-reduces in it (the additions too, like
  DDP's ``bf16_compress_hook``); ``fp32_accumulating_comm_hook`` sends 16 bits but adds in fp32
  (``start_low_precision_all_reduce_``: all-to-all, fp32 sum, one rounding, all-gather; chapter 05).
  ``ddp_comm_hook`` runs the latter inside torch's ``DistributedDataParallel``.

Every collective goes through ``refimpl.comm.ops``, so a ``refimpl.comm.tracer.CommTracer`` sees
the traffic. Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training";
Micikevicius et al. 2018, "Mixed Precision Training".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops

if TYPE_CHECKING:
    from refimpl.precision import MixedPrecisionPolicy

__all__ = [
    "CommHook",
    "PendingReduce",
    "all_reduce_mean_",
    "allreduce_hook",
    "broadcast_module",
    "ddp_comm_hook",
    "fp32_accumulating_comm_hook",
    "low_precision_all_reduce_",
    "low_precision_hook",
    "reduce_gradients_",
    "start_low_precision_all_reduce_",
    "sync_bucket",
]


def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


def _global_rank_of_first(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


@torch.no_grad()
def broadcast_module(module: nn.Module, group: Any = None, *, exclude: Iterable[str] = ()) -> None:
    """Copy the first rank's parameters and buffers to every rank of ``group`` (all replicas equal).

    Frozen parameters are copied too: the replicas must be identical, not only their trainable part.
    ``exclude``: names of tensors that are not replicas over ``group`` (an expert-parallel rank's experts).
    """
    src = _global_rank_of_first(group)
    skip = set(exclude)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if name not in skip:
            ops.broadcast(t.data, src=src, group=group)


def _check_same_parameters(params: Sequence[nn.Parameter], names: Sequence[str], group: Any) -> None:
    """Fail loudly, not with a hang, when ranks wrap different models (their buckets would not match)."""
    device = params[0].device if params else torch.device("cpu")
    sig = torch.tensor([len(params), sum(p.numel() for p in params)], dtype=torch.int64, device=device)
    world = _group_size(group)
    gathered = [torch.empty_like(sig) for _ in range(world)]
    ops.all_gather(gathered, sig, group=group)
    seen = [tuple(int(v) for v in g.tolist()) for g in gathered]
    if len(set(seen)) > 1:
        table = ", ".join(f"rank {r}: {n} tensors / {e:,} elements" for r, (n, e) in enumerate(seen))
        raise ValueError(f"the ranks wrap different trainable parameters ({table}); every rank must build "
                         f"the same model and freeze the same parameters (first names: {list(names)[:3]})")


# ------------------------------------------------------------------------------------ the pending reduction
@dataclass
class PendingReduce:
    """An in-flight reduction: ``wait()`` returns when the tensor handed to the hook holds the result.

    ``work`` is the collective in flight (a ``torch.distributed.Work``, refimpl's ``TracedWork``, or None
    when nothing had to be sent); ``finish`` what runs after it, e.g. copy the 16-bit wire tensor back into
    the fp32 buffer, or add the received chunks in fp32 and all-gather them.
    """

    work: Any = None
    finish: Callable[[], Any] | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.finish is not None:
            self.finish()


CommHook = Callable[[torch.Tensor, Any], PendingReduce]
"""``hook(buffer, group) -> PendingReduce``: launch the *sum* over ranks of a buffer (already divided by
the world size when averaging, by ``all_reduce_mean_``), asynchronously; the result must end up in
``buffer``. The counterpart of DDP's ``register_comm_hook``."""


def allreduce_hook(buffer: torch.Tensor, group: Any) -> PendingReduce:
    """The default: an async sum all-reduce of the buffer in its own dtype."""
    return PendingReduce(ops.all_reduce(buffer, group=group, async_op=True))


# ------------------------------------------------------------------------------------ the average
def all_reduce_mean_(
    tensor: torch.Tensor, group: Any = None, *, average: bool = True, comm_hook: CommHook = allreduce_hook
) -> PendingReduce:
    """Launch ``tensor <- sum_r tensor_r / W`` over the ``W`` ranks of ``group`` (``average=False``: the sum).

    The division comes first, in the tensor's dtype (DDP's order; see the module docstring), then
    ``comm_hook`` sums; ``.wait()`` on the result finishes. Every gradient average in refimpl is this call.
    """
    if average:
        tensor.div_(_group_size(group))
    return comm_hook(tensor, group)


@torch.no_grad()
def sync_bucket(
    tensors: Sequence[torch.Tensor], group: Any = None, *, average: bool = True,
    comm_hook: CommHook = allreduce_hook, dtype: torch.dtype | None = None,
) -> None:
    """Average (or sum) ``tensors`` over the ranks with **one** reduction: flatten, reduce, copy back.

    The step from the naive sync to buckets: one collective of ``sum(sizes)`` elements instead of one per
    tensor, so the latency is paid once (all tensors share a device). ``dtype``: the flat buffer's dtype
    (default the tensors' own; float32 sums 16-bit gradients in fp32); ``comm_hook`` as in DDP.
    """
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])  # [sum of numels]
    if dtype is not None:
        flat = flat.to(dtype)
    all_reduce_mean_(flat, group, average=average, comm_hook=comm_hook).wait()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


# ------------------------------------------------------------------------------------ low precision
def low_precision_hook(dtype: torch.dtype = torch.bfloat16) -> CommHook:
    """All-reduce a copy of the bucket cast to ``dtype`` (fp16 or bf16): half the bytes of fp32 on the wire.

    The gradients themselves stay fp32: they are accumulated in fp32 (over micro-batches, in ``.grad``),
    divided by the world size in fp32 *before* the cast (so fp16 does not overflow), and the reduced result
    is written back into the fp32 buffer. Only the values on the wire, and the additions the collective
    does between hops, are in ``dtype``: each rounding costs a relative error of at most ``2^-p`` for
    ``p`` significant bits (bf16: p = 8, 0.4 %; fp16: p = 11, 0.05 %), about ``W`` roundings per value, the
    same trade as DDP's ``bf16_compress_hook`` / ``fp16_compress_hook``.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_precision_hook takes torch.float16 or torch.bfloat16, got {dtype}")

    def hook(buffer: torch.Tensor, group: Any) -> PendingReduce:
        wire = buffer.to(dtype)
        work = ops.all_reduce(wire, group=group, async_op=True)
        return PendingReduce(work, functools.partial(buffer.copy_, wire))

    hook.__name__ = hook.__qualname__ = f"low_precision_hook({str(dtype).removeprefix('torch.')})"
    return hook


def start_low_precision_all_reduce_(
    tensor: torch.Tensor, *, comm_dtype: torch.dtype = torch.bfloat16, group: Any = None
) -> PendingReduce:
    """Launch the sum over ranks of ``tensor`` with ``comm_dtype`` on the wire but fp32 additions.

    A plain all-reduce of a bf16 tensor rounds to bf16 after every addition of the ring. Here each rank cuts
    the tensor into ``n`` chunks and sends chunk ``j`` (cast to ``comm_dtype``) to rank ``j`` (all-to-all,
    asynchronous); ``wait()`` then adds the ``n`` contributions in fp32 in rank order, rounds once to
    ``comm_dtype``, all-gathers (blocking) and writes the result into ``tensor``: ``round(sum_r round(x_r))``,
    the same on every rank. Bytes per rank: ``2 (n-1)/n`` x the 16-bit size, as a ring all-reduce in 16
    bits (half of fp32's). ``tensor`` must be contiguous.
    """
    if not tensor.is_contiguous():
        raise ValueError("low_precision_all_reduce_ needs a contiguous tensor")
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    if n == 1:
        return PendingReduce()
    flat = tensor.view(-1)
    chunk = -(-flat.numel() // n)  # ceil
    send = torch.zeros(n * chunk, dtype=comm_dtype, device=flat.device)
    send[: flat.numel()].copy_(flat)  # [n * chunk], rank j's chunk is send[j*chunk:(j+1)*chunk]
    recv = torch.empty_like(send)  # [n * chunk], row r = rank r's contribution to my chunk
    work = ops.all_to_all_single(recv, send, group=group, async_op=True)

    def finish() -> None:
        mine = recv.view(n, chunk).float().sum(dim=0)  # [chunk] fp32 sum, in rank order
        gathered = torch.empty_like(send)  # [n * chunk]
        ops.all_gather_into_tensor(gathered, mine.to(comm_dtype), group=group)
        flat.copy_(gathered[: flat.numel()])

    return PendingReduce(work, finish)


def fp32_accumulating_comm_hook(comm_dtype: torch.dtype = torch.bfloat16) -> CommHook:
    """A ``CommHook``, 16 bits on the wire, fp32 additions (``start_low_precision_all_reduce_``).

    ``DataParallelBucket(model, comm_hook=fp32_accumulating_comm_hook(torch.bfloat16))``: each bucket,
    already divided by the world size, is summed over the ranks; the all-to-all overlaps backward, the rest
    runs when the bucket is waited on. Against ``low_precision_hook``: one rounding instead of ``~W``.
    """

    def hook(buffer: torch.Tensor, group: Any) -> PendingReduce:
        return start_low_precision_all_reduce_(buffer, comm_dtype=comm_dtype, group=group)

    name = str(comm_dtype).removeprefix("torch.")
    hook.__name__ = hook.__qualname__ = f"fp32_accumulating_comm_hook({name})"
    return hook


def low_precision_all_reduce_(
    tensor: torch.Tensor, *, comm_dtype: torch.dtype = torch.bfloat16, group: Any = None, average: bool = True
) -> torch.Tensor:
    """All-reduce ``tensor`` in place, ``comm_dtype`` on the wire, fp32 additions (chapter 05).

    ``all_reduce_mean_`` with ``fp32_accumulating_comm_hook``: ``round(sum_r round(x_r / n))``
    (``average=False``: ``round(sum_r round(x_r))``); the error is one rounding of the inputs and one of
    the sum, against about ``n`` roundings for a plain all-reduce in 16 bits.
    """
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        hook = fp32_accumulating_comm_hook(comm_dtype)
        all_reduce_mean_(tensor, group, average=average, comm_hook=hook).wait()
    return tensor


def ddp_comm_hook(comm_dtype: torch.dtype) -> Callable[[Any, Any], torch.futures.Future]:
    """A torch ``DistributedDataParallel`` comm hook running ``low_precision_all_reduce_`` on each bucket.

    ``ddp.register_comm_hook(state=group_or_None, hook=ddp_comm_hook(torch.bfloat16))``; the hook averages
    (DDP hands a comm hook the undivided bucket).
    """

    def fp32_accumulating_hook(group, bucket):  # no annotations: DDP checks them against dist.GradBucket
        buffer = bucket.buffer()
        low_precision_all_reduce_(buffer, comm_dtype=comm_dtype, group=group)
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    return fp32_accumulating_hook


def reduce_gradients_(
    params: Iterable[torch.Tensor], policy: MixedPrecisionPolicy, *, group: Any = None
) -> None:
    """Average the gradients of ``params`` over ``group`` in ``policy.reduce_dtype``, one fp32 flat buffer.

    fp32: ``sync_bucket``; 16 bits: the same with ``fp32_accumulating_comm_hook`` (chapter 05).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    low = policy.reduce_dtype != torch.float32
    hook = fp32_accumulating_comm_hook(policy.reduce_dtype) if low else allreduce_hook
    sync_bucket(grads, group, comm_hook=hook, dtype=torch.float32)
