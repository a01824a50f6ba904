"""The collectives of data parallelism (chapter 03): equal start, gradient reductions, communication hooks.

* :func:`broadcast_module` makes every replica equal to the first rank's at construction;
  :func:`_check_same_parameters` fails loudly, not with a hang, when the ranks wrap different models.
* :func:`sync_bucket`: one all-reduce of several tensors flattened together, the step from one collective
  per tensor (:func:`~refimpl.parallel.data_parallel.data_parallel_naive.sync_gradients_naive`) to buckets.
* :class:`PendingReduce` and :data:`CommHook`: the asynchronous all-reduce a bucket launches from a gradient
  hook, and the hook that replaces it (DDP's ``register_comm_hook``): :func:`allreduce_hook` (the default)
  and :func:`low_precision_hook` (fp16/bf16 on the wire, like DDP's ``bf16_compress_hook``).

Every collective goes through :mod:`refimpl.comm.ops`, so a :class:`~refimpl.comm.tracer.CommTracer` sees
the traffic. Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops

__all__ = [
    "CommHook",
    "PendingReduce",
    "allreduce_hook",
    "broadcast_module",
    "low_precision_hook",
    "sync_bucket",
]


def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


def _global_rank_of_first(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


@torch.no_grad()
def broadcast_module(module: nn.Module, group: Any = None) -> None:
    """Copy the first rank's parameters and buffers to every rank of ``group`` (all replicas equal).

    Frozen parameters are copied too: the replicas must be identical, not only their trainable part.
    """
    src = _global_rank_of_first(group)
    for t in [*module.parameters(), *module.buffers()]:
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


@torch.no_grad()
def sync_bucket(tensors: Sequence[torch.Tensor], group: Any = None, *, average: bool = True) -> None:
    """Average (or sum) ``tensors`` over the ranks with **one** all-reduce: flatten, reduce, copy back.

    The step from the naive sync to buckets: one collective of ``sum(sizes)`` elements instead of one per
    tensor, so the latency is paid once (all tensors must share a dtype and device).
    """
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if average:
        flat.div_(_group_size(group))
    ops.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


# ------------------------------------------------------------------------------------ communication hooks
@dataclass
class PendingReduce:
    """An in-flight reduction of a bucket: ``wait()`` returns when the bucket's buffer holds the result."""

    work: Any  # a torch.distributed.Work or refimpl's TracedWork
    finish: Callable[[], Any] | None = None  # e.g. decompress the wire tensor back into the fp32 buffer

    def wait(self) -> None:
        self.work.wait()
        if self.finish is not None:
            self.finish()


CommHook = Callable[[torch.Tensor, Any], PendingReduce]
"""``hook(buffer, group) -> PendingReduce``: launch the *sum* over ranks of a bucket's buffer
(already divided by the world size when averaging), asynchronously; the result must end up in ``buffer``.
The counterpart of DDP's ``register_comm_hook``."""


def allreduce_hook(buffer: torch.Tensor, group: Any) -> PendingReduce:
    """The default: an async sum all-reduce of the bucket in its own dtype."""
    return PendingReduce(ops.all_reduce(buffer, group=group, async_op=True))


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

