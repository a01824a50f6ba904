"""Tensor and sequence parallelism, Megatron-style, from scratch (chapter 06).

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism"; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(sequence parallelism). One concept per file:

* ``refimpl.parallel.tensor_parallel.tp_communications``: the conjugate autograd collectives (``f``,
  ``g``, scatter / gather along the last dim, and along the sequence for sequence parallelism);
* ``refimpl.parallel.tensor_parallel.layers``: ``ColumnParallelLinear``, ``RowParallelLinear``
  (each with ``from_linear`` and ``local_shards``) and ``allreduce_sequence_parallel_grads``;
* ``refimpl.parallel.tensor_parallel.collective_matmul``: ``all_gather_matmul`` and
  ``matmul_reduce_scatter``, sequence parallelism's collectives as rings hidden behind the chunks' matmuls
  (Wang et al. 2023; the layers' ``tp_comm_overlap``, the trainer's ``--tp-comm-overlap``);
* ``refimpl.parallel.tensor_parallel.vocab_parallel``: ``VocabParallelEmbedding`` (with its tied
  head ``lm_logits``) and ``vocab_parallel_cross_entropy``, which never builds the full logits.

* ``refimpl.parallel.tensor_parallel.styles``: the styles a plan maps module names to
  (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``VocabParallel``,
  ``TiedVocabParallelOutput``), torch's semantics with local tensors;
* ``refimpl.parallel.tensor_parallel.apply``: ``apply_tensor_parallel`` applies a plan (the
  model's declared one by default) to any module, ``tp_lm_loss``, ``full_state_dict``,
  ``fused_qkv_per_head`` (nanoGPT's fused qkv rows in the per-head order);
* ``refimpl.parallel.tensor_parallel.grad_norm``: the gradient norm that counts each element once.
"""

from __future__ import annotations

from refimpl.parallel.tensor_parallel.apply import (
    apply_tensor_parallel,
    full_state_dict,
    fused_qkv_per_head,
    match_plan,
    param_split,
    tp_lm_loss,
)
from refimpl.parallel.tensor_parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from refimpl.parallel.tensor_parallel.grad_norm import (
    clip_grad_norm_tensor_parallel_,
    tensor_parallel_sharded,
)
from refimpl.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    allreduce_sequence_parallel_grads,
    sequence_parallel_names,
)
from refimpl.parallel.tensor_parallel.styles import (
    ColwiseParallel,
    ParallelStyle,
    ParamSplit,
    RowwiseParallel,
    SequenceParallel,
    TiedVocabParallelOutput,
    VocabParallel,
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
    TiedVocabParallelHead,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "ColwiseParallel",
    "ParallelStyle",
    "ParamSplit",
    "RowParallelLinear",
    "RowwiseParallel",
    "SequenceParallel",
    "SequenceParallelLayerNorm",
    "TiedVocabParallelHead",
    "TiedVocabParallelOutput",
    "VocabParallel",
    "VocabParallelEmbedding",
    "all_gather_matmul",
    "allreduce_sequence_parallel_grads",
    "apply_tensor_parallel",
    "clip_grad_norm_tensor_parallel_",
    "copy_to_tensor_parallel_region",
    "full_state_dict",
    "fused_qkv_per_head",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "match_plan",
    "matmul_reduce_scatter",
    "param_split",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "sequence_parallel_names",
    "tensor_parallel_sharded",
    "tp_lm_loss",
    "vocab_parallel_cross_entropy",
]
