"""Buckets (chapter 03): which gradients travel together in one all-reduce, and where each one sits.

The trainable gradients are laid out in **reverse** registration order (the order backward produces them)
in one flat buffer per dtype and device, and the buffer is cut every ``cap`` elements: exactly
``ceil(gradient bytes / cap)`` buckets (:func:`num_buckets`), each but the last of a buffer holding
exactly ``cap`` elements; a tensor across a cut has a :class:`_Piece` in each bucket.
:func:`assign_buckets` is the rule on sizes alone; :func:`build_buckets` builds the buffers and pieces
that :class:`~refimpl.parallel.data_parallel.data_parallel.DataParallelBucket` fills and reduces (gradient
bucketing, Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from refimpl.parallel.data_parallel.data_parallel_communications import PendingReduce

__all__ = ["assign_buckets", "build_buckets", "num_buckets"]


def assign_buckets(numels: Sequence[int], cap_numel: int) -> list[list[int]]:
    """Which parameters each bucket holds (a part of), buckets in launch order.

    The gradients are laid out in one flat buffer in **reverse** registration order (the last parameter
    first: backward produces it first) and the buffer is cut every ``cap_numel`` elements. A parameter that
    straddles a cut belongs to both buckets; one larger than the cap spans several. So there are exactly
    ``ceil(sum(numels) / cap_numel)`` buckets and each but the last holds exactly ``cap_numel`` elements.
    Returns, per bucket, the indices (into ``numels``) of the parameters it holds, in buffer order.

    >>> assign_buckets([3, 5, 2], cap_numel=4)   # flat buffer: p2 p2 p1 p1 | p1 p1 p1 p0 | p0 p0
    [[2, 1], [1, 0], [0]]

    Unlike DDP, which never splits a tensor (its buckets close once they *reach* the cap, so a tensor
    larger than the cap gets a bucket of its own), the cut is exact: the number of buckets, the bytes per
    bucket and hence the number of all-reduces per step are a formula of the cap alone.
    """
    if cap_numel < 1:
        raise ValueError(f"the bucket cap must hold at least one element, got {cap_numel}")
    buckets: list[list[int]] = []
    offset = 0
    for i in reversed(range(len(numels))):
        start, end = offset, offset + int(numels[i])
        offset = end
        if end == start:
            continue
        for b in range(start // cap_numel, (end - 1) // cap_numel + 1):
            while len(buckets) <= b:
                buckets.append([])
            buckets[b].append(i)
    return buckets


def num_buckets(grad_bytes: int, cap_bytes: int) -> int:
    """The formula the bucketed wrapper follows: ``ceil(gradient bytes / cap)`` (one dtype)."""
    return math.ceil(grad_bytes / cap_bytes)


@dataclass
class _Piece:
    """The part of parameter ``param`` (elements ``[param_offset, +length)``) that lives in a bucket."""

    param: int
    param_offset: int
    length: int
    bucket_offset: int


@dataclass
class _Bucket:
    buffer: torch.Tensor  # a slice of a flat gradient buffer
    pieces: list[_Piece]
    params: list[int]
    missing: int = 0  # gradients of this bucket not final yet in the current backward
    pending: PendingReduce | None = None


def build_buckets(params: Sequence[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """The buckets of ``params`` (registration order), in launch order: :func:`assign_buckets`'s cut.

    One flat zero buffer per run of consecutive (reverse-order) parameters of one dtype and device, cut
    every ``cap_bytes // element_size`` elements; each bucket's ``buffer`` is a slice of it, its
    ``pieces`` say which elements of which parameter land where, its ``params`` which parameters it holds.
    """
    order = list(reversed(range(len(params))))
    runs: list[list[int]] = []  # consecutive parameters (reverse order) of one dtype and device
    for i in order:
        key = (params[i].dtype, params[i].device)
        if runs and (params[runs[-1][0]].dtype, params[runs[-1][0]].device) == key:
            runs[-1].append(i)
        else:
            runs.append([i])
    buckets: list[_Bucket] = []
    for run in runs:
        first = params[run[0]]
        cap = max(1, cap_bytes // first.element_size())
        total = sum(params[i].numel() for i in run)
        flat = torch.zeros(total, dtype=first.dtype, device=first.device)
        local = [_Bucket(buffer=flat[s : min(s + cap, total)], pieces=[], params=[])
                 for s in range(0, total, cap)]
        offset = 0
        for i in run:
            n = params[i].numel()
            pos = offset
            while pos < offset + n:
                b = pos // cap
                end = min(offset + n, (b + 1) * cap)
                local[b].pieces.append(_Piece(param=i, param_offset=pos - offset, length=end - pos,
                                              bucket_offset=pos - b * cap))
                if not local[b].params or local[b].params[-1] != i:
                    local[b].params.append(i)
                pos = end
            offset += n
        buckets.extend(local)
    return buckets
