"""Chapter 03 exercises: data parallelism from one all-reduce per tensor to buckets.

Grade with ``make grade CH=03`` (or ``python -m exercises.grade 03``). Five tasks:

1. ``sync_gradients_naive``: after ``backward()``, every rank's gradients become the mean over ranks.
2. ``assign_buckets``: cut the gradients, in reverse registration order, into buckets of a fixed size.
3. ``sync_bucket``: average a list of tensors with a single all-reduce.
4. ``DataParallelBucket``, its buckets: all-reduces launched by gradient hooks while backward runs.
5. ``DataParallelBucket.no_sync``: gradient accumulation without communication, then one synchronisation.

Make every collective through ``refimpl.comm.ops`` (same signatures as ``torch.distributed``), so that the
grader's tracer can count them. Chapter 03 explains each piece; ``refimpl/parallel/data_parallel/`` is the
solution, do not peek before trying.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)
from torch import nn

from refimpl.comm import ops  # noqa: F401  (you will need it)


def sync_gradients_naive(module: nn.Module, group: Any = None) -> None:
    """Average the gradients of ``module`` over the ranks of ``group``, in place.

    * one ``ops.all_reduce`` (a sum) per **trainable** parameter (``requires_grad``), in the order of
      ``module.parameters()``; frozen parameters are left alone;
    * divide by the world size (``dist.get_world_size(group)``) to turn the sum into a mean;
    * a trainable parameter whose ``.grad`` is ``None`` contributes zeros and receives the mean: every rank
      must issue the same collectives, or they wait for each other forever.
    """
    raise NotImplementedError("exercise 03.1: sync_gradients_naive")


def assign_buckets(numels: Sequence[int], cap_numel: int) -> list[list[int]]:
    """Which parameters each bucket holds, buckets in the order they are sent.

    Lay the parameters out in one flat buffer in **reverse** order (parameter ``len(numels) - 1`` first,
    because backward produces the last layer's gradients first), then cut the buffer every ``cap_numel``
    elements. A parameter that straddles a cut belongs to both buckets; one longer than the cap spans
    several; a parameter with 0 elements belongs to none. Return, for each bucket, the indices of the
    parameters it holds (a part of), in buffer order. Raise ``ValueError`` if ``cap_numel < 1``.

    >>> assign_buckets([3, 5, 2], cap_numel=4)   # buffer: p2 p2 p1 p1 | p1 p1 p1 p0 | p0 p0
    [[2, 1], [1, 0], [0]]
    """
    raise NotImplementedError("exercise 03.2: assign_buckets")


def sync_bucket(tensors: Sequence[torch.Tensor], group: Any = None) -> None:
    """Average ``tensors`` (one dtype and device) over the ranks with exactly **one** ``ops.all_reduce``.

    Flatten them into one buffer (``torch.cat`` of ``t.reshape(-1)``), divide by the world size, all-reduce
    the buffer, and copy each slice back into its tensor (in place: the caller keeps its references).
    """
    raise NotImplementedError("exercise 03.3: sync_bucket")


class DataParallelBucket(nn.Module):
    """Data parallelism whose bucket all-reduces overlap backward, with gradient accumulation (tasks 4, 5).

    ``DataParallelBucket(module, bucket_cap_mb=25, group=None)``; calling it runs ``module``. The
    grader's models give every trainable parameter a gradient in every backward; frozen ones are ignored.

    **Task 4, the buckets.** The trainable gradients, in reverse registration order, are cut every
    ``bucket_cap_mb`` megabytes (2**20 bytes) as in task 2: a synchronised backward makes exactly
    ``ceil(gradient bytes / cap)`` calls of ``ops.all_reduce(..., async_op=True)``, one per bucket. Each
    is launched *during* backward, as soon as every gradient its bucket holds is final, and nothing waits
    for it there: backward goes on computing while the bucket is on the wire. After ``loss.backward()``,
    ``finish_gradient_synchronization()`` waits for every handle and leaves the mean over the ranks in
    each ``.grad``. The same object is used for many steps.

    **Task 5, ``no_sync()``.** A context manager: the backward of a forward run inside it accumulates into
    ``.grad`` locally and communicates nothing; the next synchronised backward reduces the accumulated sum.
    As in torch DDP, it is the **forward** that decides whether the coming backward synchronises, not the
    place where ``backward()`` is called. ``finish_gradient_synchronization()`` after a backward that did
    not synchronise does nothing (no collective, ``.grad`` stays local).

    Traps: ``Tensor.register_hook`` runs *before* the gradient is added into ``.grad``; collectives are
    matched by their order, so every rank must launch the same buckets in the same order; a handle never
    waited for leaves the buffer half-reduced; hooks outlive a step, so per-backward bookkeeping must be
    reset; a tensor is not final until every use in the graph has contributed to it.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group: Any = None) -> None:
        super().__init__()
        raise NotImplementedError("exercise 03.4: DataParallelBucket")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("exercise 03.4: DataParallelBucket.forward")

    def no_sync(self):
        """A context manager: forwards run inside it do not synchronise their backward (task 5)."""
        raise NotImplementedError("exercise 03.5: DataParallelBucket.no_sync")

    def finish_gradient_synchronization(self) -> None:
        """Wait for the buckets of the last synchronised backward; each ``.grad`` becomes the rank mean."""
        raise NotImplementedError("exercise 03.4: DataParallelBucket.finish_gradient_synchronization")
