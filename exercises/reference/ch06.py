"""refimpl's answers to the exercises of chapter 06, under the exercise's names and signatures.

The layers are built with refimpl's ``from_linear`` (``ColumnParallelLinear(linear, group=...)`` here is a
function returning refimpl's layer). The grader's self-test grades this module and expects full marks
(tests/course/cli/test_exercises.py).
"""

from __future__ import annotations

import torch
from torch import nn

from refimpl.parallel.tensor_parallel import fused_qkv_per_head, layers, vocab_parallel
from refimpl.parallel.tensor_parallel.tp_communications import (
    Group,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)


def ColumnParallelLinear(linear: nn.Linear, *, group: Group) -> nn.Module:  # noqa: N802 - the exercise's name
    """This rank's block of ``linear``'s output features (refimpl's layer, sharded from ``linear``)."""
    return layers.ColumnParallelLinear.from_linear(linear, tp_group=group)


def RowParallelLinear(linear: nn.Linear, *, group: Group) -> nn.Module:  # noqa: N802 - the exercise's name
    """This rank's block of ``linear``'s input features, the bias whole (refimpl's layer)."""
    return layers.RowParallelLinear.from_linear(linear, tp_group=group)


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *,
                                 group: Group) -> torch.Tensor:
    """Per-token cross entropy from vocabulary-sharded logits (refimpl's, three forward all-reduces)."""
    return vocab_parallel.vocab_parallel_cross_entropy(logits_shard, target, tp_group=group)


def shard_fused_qkv(tensor: torch.Tensor, *, num_heads: int, group: Group) -> torch.Tensor:
    """nanoGPT's ``[3, a, d]`` rows to the per-head order (refimpl's), then this rank's ``3h/t`` rows."""
    t, r = group_size(group), group_rank(group)
    if num_heads % t:
        raise ValueError(f"num_heads={num_heads} does not divide by the tensor-parallel size {t}")
    return fused_qkv_per_head(tensor, num_heads).chunk(t, dim=0)[r].clone()


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "shard_fused_qkv",
    "vocab_parallel_cross_entropy",
]
