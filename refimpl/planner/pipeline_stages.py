"""What each pipeline stage holds: its blocks, their parameters and the rank's model state (chapter 08;
Huang et al. 2019, GPipe; Narayanan et al. 2021).

The model is cut into ``S = p v`` stages as the runtime cuts it (``stage_layers``:
``refimpl.parallel.pipeline_parallel.split_blocks``, by blocks or by parameters, on the tensor-parallel
shards of ``refimpl.planner.param_table.param_table``; no model built); stage ``s`` lives on rank
``s mod p``. A stage holds its blocks' parameters (``layers.{i}.*``), the first also the embedding's, the
last the final LayerNorm's and the output layer's; a tied embedding's copy there too (its own tensor,
another rank holds the original; under tp a vocab-parallel shard, ``ceil(V/t)`` rows). The weights a stage
multiplies (autocast's 16-bit copies) are its blocks' linear weights and, on the last stage, the output
layer's.

Inside the other axes (chapter 12): ZeRO-1 (a ShardedOptimizer over the stages; Rajbhandari et al. 2020)
shards the AdamW state over the ``dp x cp`` ranks (``pipeline_state_memory``), ZeRO-2 the gradients too,
ZeRO-3 the weights too, at rest, with its gathered stages on top at the peak (``_zero3_gathered``: the whole
stages kept through the step by default, one unit at a time with ``zero3_reshard_per_microbatch``).
The activations a pipeline rank holds over the schedule: ``refimpl.planner.pipeline_memory``.
"""

from __future__ import annotations

import math
from typing import cast

from refimpl.config import ModelConfig
from refimpl.measure.state import StateMemory
from refimpl.parallel.pipeline_parallel import Balance, split_blocks, stage_rank
from refimpl.planner.fp8 import fp8_weights
from refimpl.planner.param_table import ParamSpec, Shape, param_table
from refimpl.planner.zero_state import zero3_peak_gathered_bytes, zero_memory
from refimpl.precision.policy import compute_dtype_of

__all__ = ["block_of", "pipeline_state_memory", "rank_param_shapes", "rank_state_terms", "stage_layers",
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
    """The parameters a stage holds on one of ``tp`` ranks: its blocks', the embedding's on the first, the
    final LayerNorm's and the output layer's on the last (a tied embedding: the last stage's own copy when
    ``num_stages > 1``)."""
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
    """Elements of the weights a stage multiplies: its blocks' linear layers' and, on the last stage, the
    output layer's (tied: the embedding shard; the first stage only looks it up)."""
    table = param_table(config, tp=tp)
    head = table.head.numel if stage == num_stages - 1 else 0
    return head + sum(p.numel for i in blocks for p in table.blocks[i] if p.matmul)


def rank_param_shapes(config: ModelConfig, *, pp: int, rank: int, ranges: list[range],
                      tp: int = 1) -> list[Shape]:
    """The parameter shapes of pipeline rank ``rank``'s stages (``ranges``: every stage's blocks), in the
    model's order (``refimpl.planner.params_flops.param_shapes``)."""
    return [q.shape for st in range(len(ranges)) if stage_rank(st, pp_size=pp) == rank
            for q in stage_params(config, stage=st, num_stages=len(ranges), blocks=ranges[st], tp=tp)]


def pipeline_state_memory(config: ModelConfig, *, pp: int, pp_rank: int, virtual_stages: int = 1,
                          balance: str = "layers", tp: int = 1, zero_stage: int = 0, zero_shards: int = 1,
                          dp_rank: int = 0) -> StateMemory:
    """fp32 weights, gradients and AdamW state (two moments, a ``step`` per tensor) of pipeline rank
    ``pp_rank``'s tensor-parallel shards, whole or sharded by ZeRO ``zero_stage`` over the ``zero_shards``
    (``dp x cp``) ranks, dim 0 of each tensor, as group rank ``dp_rank`` holds them
    (``refimpl.planner.zero_state.zero_memory``)."""
    ranges = stage_layers(config, num_stages=pp * virtual_stages, balance=balance, tp=tp)
    shapes = rank_param_shapes(config, pp=pp, rank=pp_rank, ranges=ranges, tp=tp)
    return zero_memory(shapes, zero_shards, zero_stage, rank=dp_rank)


def block_of(name: str) -> int | None:
    """The block index of a parameter name of the plain GPT (``layers.5.mlp...`` -> 5), None outside."""
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def _zero3_gathered(config: ModelConfig, *, mine: list[int], ranges: list[range], shapes: list[Shape],
                    tp: int, p: int, shards: int, per_microbatch: bool) -> dict[str, int]:
    """ZeRO-3's full tensors a pipeline rank holds at its peak during a step: a peak on top of the sharded
    state, for the memory preflight (``refimpl.planner.memory.run_memory_per_rank``), not the state where
    the trainer steps. By default the rank's stages gathered with their full gradients, ``2 p numel``,
    reached once the last backward has accumulated them, before ``finish_gradient_sync``; per micro-batch
    the stage's root unit beside its largest block, within a block's forward or backward.
    tests/planner/ranks/test_planner_zero3.py measures the full tensors between the schedule's actions: the
    first term to the byte; per micro-batch the root alone (the block is gathered within an action). By the
    optimizer step every full tensor is freed: ``refimpl.planner.run_prediction.predict_run``'s state is the
    shards alone."""
    numel = sum(math.prod(s) for s in shapes)
    if not per_microbatch:  # the stages gathered once and kept, their gradients accumulated whole
        return {"ZeRO-3 gathered stages and their full gradients (kept through the step)": 2 * p * numel}
    table = param_table(config, tp=tp)
    blocks = [[q.shape for q in table.blocks[i]] for st in mine for i in ranges[st]]
    root_numel = numel - sum(math.prod(s) for unit in blocks for s in unit)  # embedding, head: the root unit
    gathered = zero3_peak_gathered_bytes([[(root_numel,)], *blocks], shards, bytes_per_element=p)
    return {"ZeRO-3 gathered units (per micro-batch)": gathered.weights}


def rank_state_terms(config: ModelConfig, *, mine: list[int], ranges: list[range], shapes: list[Shape],
                     tp: int, precision: str, zero_stage: int, zero_shards: int, dp_rank: int,
                     zero3_reshard_per_microbatch: bool) -> dict[str, int]:
    """The model state of a pipeline rank holding stages ``mine`` (their parameters' ``shapes``), by term:
    weights, gradients and AdamW state under ZeRO (``pipeline_state_memory``), ZeRO-3's gathered tensors,
    autocast's 16-bit weight copies (fp8: but the fp8 layers', and their transient cast)."""
    p, num_stages = compute_dtype_of(precision).itemsize, len(ranges)
    zero = zero_memory(shapes, zero_shards, zero_stage, rank=dp_rank)
    state = {"weights": zero.weights, "grads": zero.grads, "AdamW state": zero.optimizer}
    if zero_stage == 3 and zero_shards > 1:
        state.update(_zero3_gathered(config, mine=mine, ranges=ranges, shapes=shapes, tp=tp, p=p,
                                     shards=zero_shards, per_microbatch=zero3_reshard_per_microbatch))
    if p != 4:  # fp8: no bf16 copy of an fp8 weight, a transient 1-byte cast (refimpl/planner/fp8.py)
        fp8 = [q for q in fp8_weights(config, tp=tp) if block_of(q.name) in
               {i for st in mine for i in ranges[st]}] if precision == "fp8" else []
        state["autocast weight copies"] = p * (sum(
            stage_matmul_weights(config, stage=st, num_stages=num_stages, blocks=ranges[st], tp=tp)
            for st in mine) - sum(q.numel for q in fp8))
        if fp8:
            state["fp8 weight cast (transient, largest layer)"] = max(q.numel for q in fp8)
    return state
