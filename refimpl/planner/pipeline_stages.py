"""Pipeline parallelism in the planner: the stages' cut and the parameters each stage holds (chapter 08).

The model is cut into ``S = p v`` stages as the runtime cuts it
(``refimpl.parallel.pipeline_parallel.split_blocks``, by blocks or by parameters), here on the
parameters of ``refimpl.planner.param_table.param_table`` (a meta-device model read by name, the
tensor-parallel shards of ``t`` ranks; no model built); stage ``s`` lives on rank ``s mod p``. A stage holds
its blocks' parameters (``layers.{i}.*``), the first also the embedding's, the last the final LayerNorm's
and the output layer's; a tied embedding's copy there too (its own tensor, another rank holds the
original; under tp a vocab-parallel shard, ``ceil(V/t)`` rows). The weights a stage multiplies (autocast's
16-bit copies) are its blocks' linear weights and, on the last stage, the output layer's. Under ZB-H1 a
stage's ``B`` leaves its linears' weight-gradient operands to its ``W`` (``stage_deferred_bytes``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import cast

import torch

from refimpl.config import ModelConfig
from refimpl.measure.state import StateMemory
from refimpl.parallel.pipeline_parallel import Balance, split_blocks, stage_rank
from refimpl.planner.param_table import ParamSpec, param_table
from refimpl.planner.zero_state import zero_memory

__all__ = ["block_of", "pipeline_state_memory", "rank_param_shapes", "stage_deferred_bytes", "stage_layers",
           "stage_matmul_weights", "stage_params"]


def _numel(specs: tuple[ParamSpec, ...]) -> int:
    return sum(p.numel for p in specs)


def stage_layers(config: ModelConfig, *, num_stages: int, balance: str = "layers",
                 tp: int = 1) -> list[range]:
    """The blocks of each stage, by the runtime's rule (``split_blocks``, ``balance`` ``"layers"`` or
    ``"parameters"``, on the tensor-parallel shards' sizes: the embedding counts towards the first stage,
    the final LayerNorm and the head, tied or not, towards the last)."""
    table = param_table(config, tp=tp)
    return split_blocks([_numel(block) for block in table.blocks], num_stages,
                        balance=cast(Balance, balance),  # split_blocks refuses another value
                        first_extra=_numel(table.embedding),
                        last_extra=_numel(table.final_layernorm) + table.head.numel)


def stage_params(config: ModelConfig, *, stage: int, num_stages: int, blocks: range,
                 tp: int = 1) -> list[ParamSpec]:
    """The parameters stage ``stage`` of ``num_stages`` holds (with ``blocks``) on one of ``tp``
    tensor-parallel ranks: its blocks', the embedding's on the first, the final LayerNorm's and the output
    layer's on the last (a tied embedding: the last stage's own copy when ``num_stages > 1``)."""
    table = param_table(config, tp=tp)
    out = list(table.embedding) if stage == 0 else []
    for i in blocks:
        out += table.blocks[i]
    if stage == num_stages - 1:
        out += table.final_layernorm
        out += table.output_layer or ((table.head,) if num_stages > 1 else ())
    return out


def stage_matmul_weights(config: ModelConfig, *, stage: int, num_stages: int, blocks: range,
                         tp: int = 1) -> int:
    """Elements of the weights stage ``stage`` multiplies: its blocks' linear layers' and, on the last
    stage, the output layer's (tied: the embedding shard; the first stage only looks it up)."""
    table = param_table(config, tp=tp)
    head = table.head.numel if stage == num_stages - 1 else 0
    return head + sum(p.numel for i in blocks for p in table.blocks[i] if p.matmul)


def rank_param_shapes(config: ModelConfig, *, pp: int, rank: int, ranges: list[range],
                      tp: int = 1) -> list[tuple[int, ...]]:
    """The parameter shapes of pipeline rank ``rank``'s stages (``ranges``: every stage's blocks), in the
    model's order (``refimpl.planner.params_flops.param_shapes``)."""
    return [q.shape for st in range(len(ranges)) if stage_rank(st, pp_size=pp) == rank
            for q in stage_params(config, stage=st, num_stages=len(ranges), blocks=ranges[st], tp=tp)]


def pipeline_state_memory(config: ModelConfig, *, pp: int, pp_rank: int, virtual_stages: int = 1,
                          balance: str = "layers", tp: int = 1, zero_stage: int = 0, zero_shards: int = 1,
                          dp_rank: int = 0) -> StateMemory:
    """fp32 weights, gradients and AdamW state(two moments, a ``step`` per tensor) of the parameters of
    pipeline rank ``pp_rank``'s stages (``rank_param_shapes``, the tensor-parallel shards of ``tp``
    ranks), whole, or with ``zero_stage`` 1 (Rajbhandari et al. 2020; the runtime's ShardedOptimizer over the
    stages; 2: the gradients too; 3: the weights too, at rest) the AdamW state sharded over the
    ``zero_shards`` (``dp x cp``) ranks, dim 0 of each tensor, as held by the group's rank ``dp_rank``
    (``refimpl.planner.zero_state.zero_memory``)."""
    ranges = stage_layers(config, num_stages=pp * virtual_stages, balance=balance, tp=tp)
    shapes = rank_param_shapes(config, pp=pp, rank=pp_rank, ranges=ranges, tp=tp)
    return zero_memory(shapes, zero_shards, zero_stage, rank=dp_rank)


def block_of(name: str) -> int | None:
    """The block index of a parameter name of the plain GPT (``layers.5.mlp...`` -> 5), None outside."""
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def stage_deferred_bytes(config: ModelConfig, *, stage: int, num_stages: int, blocks: range, micro_batch: int,
                         seq_len: int, compute_dtype: torch.dtype = torch.float32,
                         fp8_layers: Collection[str] = (), tp: int = 1) -> int:
    """What a ``B`` of ZB-H1 leaves for its ``W`` in stage ``stage``
    (``refimpl.parallel.pipeline_parallel.defer_weight_gradients``): every linear layer's input ``X``
    and output gradient ``dY`` for ``dW = dY^T X``, in the compute dtype (``p`` bytes, measured: also the
    inputs that come from a float32 LayerNorm under autocast): per block ``p s b (8 h + 2 f)`` (QKV ``h``
    in, ``3 h`` out; the projection ``h``, ``h``; the MLP ``h``, ``f`` and ``f``, ``h``), on the last stage
    the output layer's ``p s b (h + V)``. A tensorwise fp8 layer (its weight named in ``fp8_layers``,
    ``--precision fp8``) keeps the two fp8 operands of its weight-gradient GEMM instead, one byte per
    element, and their two fp32 scales (``refimpl.precision.fp8.Float8Matmul``'s ``weight_grad``).
    Under tensor parallelism (``tp`` ranks, without sequence parallelism) each rank's layers are its
    shards: the column layers' outputs (QKV's ``3h/t``, the MLP's ``f/t``, an untied head's ``V/t``) and the
    row layers' inputs (``h/t``, ``f/t``) split over tp, the rest whole; a tied vocab-parallel head
    (``refimpl.parallel.tensor_parallel.TiedVocabParallelHead``, not a seam layer) computes its weight
    gradient in ``B`` and leaves nothing (measured)."""
    p, h, f = compute_dtype.itemsize, config.hidden_size, config.ffn_size
    v = -(-config.vocab_size // tp)
    qkv = (config.num_attention_heads + 2 * config.query_groups) * config.head_dim  # 3h without GQA
    up = (2 if config.activation == "swiglu" else 1) * f  # SwiGLU's gate and up rows
    linears = (("self_attention.query_key_value", h, qkv // tp), ("self_attention.dense", h // tp, h),
               ("mlp.dense_h_to_4h", h, up // tp), ("mlp.dense_4h_to_h", f // tp, h))  # (name, in, out)
    tokens = seq_len * micro_batch
    total = 0
    for i in blocks:
        for name, d_in, d_out in linears:
            fp8 = f"layers.{i}.{name}.weight" in fp8_layers
            total += (1 if fp8 else p) * tokens * (d_in + d_out) + (2 * 4 if fp8 else 0)
    if stage == num_stages - 1 and (tp == 1 or not config.tie_word_embeddings):
        total += p * tokens * (h + v)  # the output layer (kept in bf16 under fp8)
    return total
