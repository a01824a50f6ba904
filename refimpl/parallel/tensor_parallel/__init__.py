"""Tensor and sequence parallelism, Megatron-style, from scratch (chapter 06).

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism"; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(sequence parallelism). One concept per file:

* :mod:`~refimpl.parallel.tensor_parallel.tp_communications`: the conjugate autograd collectives (``f``,
  ``g``, scatter / gather along the last dim, and along the sequence for sequence parallelism);
* :mod:`~refimpl.parallel.tensor_parallel.layers`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`
  (each with ``from_linear`` and ``local_shards``) and :func:`allreduce_sequence_parallel_grads`;
* :mod:`~refimpl.parallel.tensor_parallel.vocab_parallel`: :class:`VocabParallelEmbedding` (with its tied
  head ``lm_logits``) and :func:`vocab_parallel_cross_entropy`, which never builds the full logits.

Still to come for chapter 06 (issue 12): attention with the heads split, the parallel MLP,
``apply_tensor_parallel`` for refimpl's GPT, the trainer's ``--tp``, the chapter, exercises and benchmark.
"""

from __future__ import annotations

from refimpl.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
)
from refimpl.parallel.tensor_parallel.tp_communications import (
    SEQUENCE_DIM,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from refimpl.parallel.tensor_parallel.vocab_parallel import (
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "vocab_parallel_cross_entropy",
]
