"""Buckets (chapter 03): which gradients travel together in one collective, and where each one sits.

**The rule**, one for all of refimpl (DDP's, Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training"): tensors in **reverse** registration order (the order backward
produces their gradients, so the first bucket is ready first), a bucket closed as soon as it holds ``cap``
elements. Data parallelism lays its gradients out in one flat buffer and may split a tensor across the
cut, so each bucket but the last holds exactly ``cap`` elements and there are ``ceil(gradient bytes / cap)``
of them (``num_buckets``), a formula of the cap alone; ZeRO packs whole tensors' shards
(``whole_tensors=True``): a tensor is never split, so a bucket overshoots the cap by less than one tensor,
as DDP's own buckets do. ``cut_into_buckets`` is the rule, ``assign_buckets`` its answer on sizes
(the exercise of chapter 03), ``build_buckets`` the buffers and pieces that
``refimpl.parallel.data_parallel.data_parallel.DataParallelBucket`` fills and reduces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from refimpl.parallel.data_parallel.data_parallel_communications import PendingReduce

__all__ = ["assign_buckets", "build_buckets", "cut_into_buckets", "num_buckets"]


@dataclass
class _Piece:
    """The part of parameter ``param`` (elements ``[param_offset, +length)``) that lives in a bucket."""

    param: int
    param_offset: int
    length: int
    bucket_offset: int


def cut_into_buckets(
    numels: Sequence[int], cap_numel: int, *, whole_tensors: bool = False
) -> list[list[_Piece]]:
    """The pieces of each bucket, buckets in launch order: **the** bucketing rule (module docstring).

    ``numels`` are in registration order; the tensors are laid out last first and a bucket closes once it
    holds ``cap_numel`` elements. A tensor across the cut is split (``_Piece`` per bucket) unless
    ``whole_tensors``, then it stays whole in the bucket it started: the buckets of DDP's own
    ``_compute_bucket_assignment_by_size`` fed the backward order (tested). Empty tensors hold no place in
    the flat buffer; with ``whole_tensors`` they join a bucket, as in DDP (ZeRO still steps them).
    """
    if cap_numel < 1:
        raise ValueError(f"the bucket cap must hold at least one element, got {cap_numel}")
    buckets: list[list[_Piece]] = []
    filled = cap_numel  # the (absent) current bucket is full: the first piece opens one
    for i in reversed(range(len(numels))):
        n, done = int(numels[i]), 0
        if n == 0 and whole_tensors:  # as DDP: an empty tensor takes a place in the bucket, no elements
            if filled >= cap_numel:
                buckets.append([])
                filled = 0
            buckets[-1].append(_Piece(param=i, param_offset=0, length=0, bucket_offset=filled))
        while done < n:
            if filled >= cap_numel:
                buckets.append([])
                filled = 0
            length = n - done if whole_tensors else min(n - done, cap_numel - filled)
            buckets[-1].append(_Piece(param=i, param_offset=done, length=length, bucket_offset=filled))
            filled += length
            done += length
    return buckets


def assign_buckets(numels: Sequence[int], cap_numel: int, *, whole_tensors: bool = False) -> list[list[int]]:
    """Which parameters each bucket holds (a part of), buckets in launch order (``cut_into_buckets``).

    The gradients are laid out in one flat buffer in **reverse** registration order (the last parameter
    first: backward produces it first) and the buffer is cut every ``cap_numel`` elements. A parameter that
    straddles a cut belongs to both buckets; one larger than the cap spans several. So there are exactly
    ``ceil(sum(numels) / cap_numel)`` buckets and each but the last holds exactly ``cap_numel`` elements.
    Returns, per bucket, the indices (into ``numels``) of the parameters it holds, in buffer order.

    >>> assign_buckets([3, 5, 2], cap_numel=4)   # flat buffer: p2 p2 p1 p1 | p1 p1 p1 p0 | p0 p0
    [[2, 1], [1, 0], [0]]
    >>> assign_buckets([3, 5, 2], cap_numel=4, whole_tensors=True)   # p2 p2 p1 p1 p1 p1 p1 | p0 p0 p0
    [[2, 1], [0]]

    DDP never splits a tensor (``whole_tensors=True``: its buckets close once they *reach* the cap, so a
    tensor larger than the cap gets a bucket of its own); with the exact cut the number of buckets, the
    bytes per bucket and hence the number of all-reduces per step are a formula of the cap alone.
    """
    return [[piece.param for piece in bucket] for bucket in cut_into_buckets(numels, cap_numel,
                                                                             whole_tensors=whole_tensors)]


def num_buckets(grad_bytes: int, cap_bytes: int) -> int:
    """The formula the bucketed wrapper follows: ``ceil(gradient bytes / cap)`` (one dtype)."""
    return math.ceil(grad_bytes / cap_bytes)


@dataclass
class _Bucket:
    buffer: torch.Tensor  # a slice of a flat gradient buffer
    pieces: list[_Piece]
    params: list[int]
    missing: int = 0  # gradients of this bucket not final yet in the current backward
    pending: PendingReduce | None = None


def build_buckets(params: Sequence[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """The buckets of ``params`` (registration order), in launch order: ``cut_into_buckets``'s cut.

    One flat zero buffer per run of consecutive (reverse-order) parameters of one dtype and device, cut
    every ``cap_bytes // element_size`` elements; each bucket's ``buffer`` is a slice of it, its
    ``pieces`` say which elements of which parameter land where, its ``params`` which parameters it holds.
    """
    runs: list[list[int]] = []  # consecutive parameters (reverse order) of one dtype and device
    for i in reversed(range(len(params))):
        key = (params[i].dtype, params[i].device)
        if runs and (params[runs[-1][0]].dtype, params[runs[-1][0]].device) == key:
            runs[-1].append(i)
        else:
            runs.append([i])
    buckets: list[_Bucket] = []
    for run in runs:
        first = params[run[0]]
        order = run[::-1]  # registration order, as cut_into_buckets takes it
        cut = cut_into_buckets([params[i].numel() for i in order], max(1, cap_bytes // first.element_size()))
        flat = torch.zeros(sum(params[i].numel() for i in run), dtype=first.dtype, device=first.device)
        start = 0
        for pieces in cut:
            size = sum(piece.length for piece in pieces)
            for piece in pieces:
                piece.param = order[piece.param]  # index into params
            names = list(dict.fromkeys(piece.param for piece in pieces))
            buckets.append(_Bucket(buffer=flat[start : start + size], pieces=pieces, params=names))
            start += size
    return buckets
