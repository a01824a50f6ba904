"""Data parallelism in its simplest form (chapter 03): equal start, then one all-reduce per gradient.

The naive version, kept beside the bucketed one
(``refimpl.parallel.data_parallel.data_parallel.DataParallelBucket``) because the step between them is
the lesson: one blocking collective per parameter tensor, after backward has ended, pays ``P`` latencies
for ``P`` tensors and overlaps nothing (Li et al. 2020, "PyTorch Distributed", the naive solution).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from refimpl.distributed.placement import LocalShard, module_shards
from refimpl.parallel.data_parallel.data_parallel_communications import (
    _group_size,
    all_reduce_mean_,
    broadcast_module,
)

__all__ = ["DataParallelNaive", "sync_gradients_naive"]


@torch.no_grad()
def sync_gradients_naive(module: nn.Module, group: Any = None, *, average: bool = True) -> None:
    """One blocking all-reduce per trainable parameter: ``.grad`` becomes the mean (or sum) over ranks.

    A parameter without a gradient contributes zeros (and gets one): every rank must issue the same
    collectives in the same order, whatever its own backward used.
    """
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        all_reduce_mean_(p.grad, group, average=average).wait()  # p.grad <- sum_r p.grad_r / W


class DataParallelNaive(nn.Module):
    """Data parallelism in its simplest form: equal start, then one all-reduce per gradient (chapter 03).

    At construction rank 0's parameters and buffers are broadcast. After ``loss.backward()`` call
    ``finish_gradient_synchronization``: every trainable parameter's gradient (zeros where a parameter
    got none, so that every rank issues the same collectives) is divided by the world size and summed over
    the ranks, one blocking all-reduce per tensor. Nothing overlaps: communication starts when backward
    has ended, and a model of ``P`` tensors pays ``P`` collective latencies per step.
    """

    def __init__(self, module: nn.Module, group: Any = None, *, average_gradients: bool = True):
        super().__init__()
        self.module = module
        self.group = group
        self.average_gradients = average_gradients
        self.world_size = _group_size(group)
        broadcast_module(module, group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def local_shards(self) -> dict[str, LocalShard]:
        """What this rank holds (the checkpoint reads it, chapter 11): the wrapped module's tensors, every
        one whole (a replica), by their names in the wrapped module: the wrapper adds no name."""
        return module_shards(self.module)

    def finish_gradient_synchronization(self) -> None:
        """After ``loss.backward()``: each gradient becomes the rank mean (``sync_gradients_naive``)."""
        sync_gradients_naive(self.module, self.group, average=self.average_gradients)

