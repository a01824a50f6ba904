"""The memory of a training run per rank, before anything runs (chapters 01, 04, 05, 06, 07 and 10):
``state_memory`` (one unsharded replica; Kingma & Ba 2015 for Adam's two moments),
``state_memory_per_rank`` (a layout's tensor-parallel shards, Shoeybi et al. 2019, sharded by ZeRO over
the ``dp x cp`` ranks that replicate them, Rajbhandari et al. 2020) and ``run_memory_per_rank`` (state
plus one micro-batch's activations, Korthikanti et al. 2022, term by term: what the trainer's preflight
compares with the machine's memory). Every per-rank function takes the layout ``dims``
(``refimpl.planner.layout``); the ``refimpl.measure.state.StateMemory`` returned is the one
``refimpl.measure.state_bytes`` measures.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from refimpl.config import ModelConfig, ParallelConfig
from refimpl.distributed.mesh import ParallelDims
from refimpl.measure.state import StateMemory
from refimpl.planner.activations import BlockSplit, activation_bytes, outside_block_bytes
from refimpl.planner.experts import (
    ExpertLoad,
    autocast_weight_elements,
    check_moe_plan,
    expert_parallel_degree,
    is_expert_tensor,
    moe_activation_bytes,
    moe_state_memory_per_rank,
)
from refimpl.planner.fp8 import fp8_extra_saved_bytes, fp8_weights
from refimpl.planner.layout import (
    Layout,
    context_parallel_degree,
    pipeline_parallel_degree,
    tensor_parallel_degree,
    zero_shard_degree,
)
from refimpl.planner.param_table import param_table
from refimpl.planner.params_flops import num_param_tensors, param_count, param_shapes
from refimpl.planner.pipeline_memory import pipeline_memory_per_rank
from refimpl.planner.pipeline_stages import pipeline_state_memory
from refimpl.planner.run_memory import RunMemory
from refimpl.planner.zero_state import zero3_peak_gathered_bytes, zero_memory
from refimpl.precision.policy import compute_dtype_of
from refimpl.support import check_modelled, check_supported

__all__ = ["RunMemory", "run_memory_of", "run_memory_per_rank", "state_memory",
           "state_memory_per_rank"]


class _ActivationArgs(BlockSplit):
    """The keyword arguments ``activation_bytes`` and ``outside_block_bytes`` share: one micro-batch on a
    rank split as ``BlockSplit`` says."""

    micro_batch: int
    seq_len: int
    compute_dtype: torch.dtype


def unmodelled_attention(config: ModelConfig) -> list[str]:
    """What of ``config``'s attention the exact terms do not count (empty: modelled): multi-head latent
    attention (the DeepSeek-V3 form, ``refimpl.models.mla``), whose latents, norms and rotated parts save
    other tensors than the activation terms here (``refimpl.support.NOT_MODELLED_TABLE``'s row ``mla``);
    its parameters and FLOPs are counted (``refimpl.planner.params_flops.param_count``), its layouts
    estimated (``python -m refimpl.plan``)."""
    return ["multi-head latent attention"] if config.attention_type == "mla" else []


def state_memory(
    config: ModelConfig,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer: str = "adamw",
    state_bytes: int = 4,
) -> StateMemory:
    """Weights, gradients and optimizer state of a single, unsharded replica.

    Adam/AdamW (Kingma & Ba 2015): two moments of ``state_bytes`` per parameter plus PyTorch's ``step``
    counter, a float32 scalar tensor per parameter tensor. SGD without momentum keeps nothing.
    """
    n = param_count(config).total
    if optimizer in ("adam", "adamw"):
        opt = 2 * state_bytes * n + 4 * num_param_tensors(config)
    elif optimizer == "sgd":
        opt = 0
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected 'adamw', 'adam' or 'sgd'")
    return StateMemory(weights=param_bytes * n, grads=grad_bytes * n, optimizer=opt)


def state_memory_per_rank(config: ModelConfig, dims: Layout, *, zero_stage: int = 0, dp_rank: int = 0,
                          pp_rank: int = 0, virtual_stages: int = 1,
                          pp_balance: str = "layers") -> StateMemory:
    """Weights, gradients and AdamW state held at rest by rank ``dp_rank`` of the ``dp x cp`` group of
    layout ``dims``: fp32 weights and gradients, two fp32 moments and a ``step`` scalar per tensor of the
    rank's tensor-parallel shards (chapter 06, ``refimpl.planner.params_flops.param_shapes``), sharded over
    the ``dp x cp`` ranks that replicate them by ZeRO ``zero_stage`` with the runtime's rule, dim 0 of each
    local tensor (``refimpl.planner.zero_state.zero_memory``; ``dp_rank = dp_i cp + cp_i``). An MoE model
    (chapter 09): ``refimpl.planner.experts.moe_state_memory_per_rank``; pipeline parallelism (chapter 08):
    the parameters of pipeline rank ``pp_rank``'s stages
    (``refimpl.planner.pipeline_stages.pipeline_state_memory``).
    """
    shards, tp, pp = zero_shard_degree(dims), tensor_parallel_degree(dims), pipeline_parallel_degree(dims)
    if config.num_experts:  # experts split over ep, their state sharded over edp (refimpl/planner/experts.py)
        check_moe_plan(config, what="state_memory_per_rank", pp=pp, zero_stage=zero_stage)
        return moe_state_memory_per_rank(config, dims, zero_stage=zero_stage, dp_rank=dp_rank)
    if pp > 1:
        return pipeline_state_memory(config, pp=pp, pp_rank=pp_rank, virtual_stages=virtual_stages,
                                     balance=pp_balance, tp=tp, zero_stage=zero_stage, zero_shards=shards,
                                     dp_rank=dp_rank)
    return zero_memory(param_shapes(config, tp=tp), shards, zero_stage, rank=dp_rank)


def run_memory_per_rank(config: ModelConfig, dims: Layout, *, micro_batch: int, seq_len: int,
                        zero_stage: int = 0, precision: str = "fp32",
                        checkpointed_blocks: set[int] | list[int] | tuple[int, ...] = (),
                        sequence_parallel: bool = False, cp_method: str = "ring",
                        cp_layout: str | None = None, pp_schedule: str = "1f1b", virtual_stages: int = 1,
                        num_microbatches: int | None = None, pp_balance: str = "layers",
                        zero3_reshard_per_microbatch: bool = False,
                        expert_loads: Sequence[ExpertLoad] | None = None) -> RunMemory:
    """The peak bytes one rank of a training run laid out as ``dims`` needs, before anything runs (chapters
    01, 04 and 05; the trainer's preflight), by term.

    State (``state_memory_per_rank``, Rajbhandari et al. 2020): fp32 weights, gradients and AdamW's two
    moments of the rank's tensor-parallel shards, sharded over ``dp x cp`` by ZeRO ``zero_stage``; ZeRO-3
    adds the gathered root unit and the largest block (``refimpl.planner.zero_state.
    zero3_peak_gathered_bytes``); bf16 adds autocast's 16-bit copies of the matmul weights, fp8 the terms of
    ``refimpl.planner.fp8``. Activations: one micro-batch's saved tensors at the rank's ``s/cp`` tokens
    (Korthikanti et al. 2022 as ``refimpl.planner.activations`` counts our block exactly: what
    ``refimpl.measure.activations.SavedTensorMeter`` measures; a checkpointed block keeps its input), the
    tensors saved outside the blocks, and on top the transient logits and their float32 gradient,
    ``(p + 4) (s/cp) b V_t`` (an estimate). MoE blocks (chapter 09): the experts' state over the
    expert-data-parallel group and each block's saved tensors for ``expert_loads``
    (``refimpl.planner.experts``). Pipeline parallelism (``dims.pp > 1``, chapter 08): the worst pipeline
    rank's figures under ``pp_schedule`` (``refimpl.planner.pipeline_memory.pipeline_memory_per_rank``;
    ``num_microbatches`` default ``pp``); ``RunMemory.describe`` names the rank.
    """
    check_moe_plan(config, what="run_memory_per_rank", pp=pipeline_parallel_degree(dims),
                   cp=context_parallel_degree(dims), zero_stage=zero_stage,
                   sequence_parallel=sequence_parallel, precision=precision)
    compute_dtype_of(precision)  # an unknown name: ValueError
    shards, tp, cp = zero_shard_degree(dims), tensor_parallel_degree(dims), context_parallel_degree(dims)
    pp = pipeline_parallel_degree(dims)
    if pp > 1:
        ranks = pipeline_memory_per_rank(config, pp=pp, num_microbatches=num_microbatches or pp,
                                         schedule=pp_schedule, virtual_stages=virtual_stages,
                                         micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                                         checkpointed_blocks=checkpointed_blocks, balance=pp_balance, tp=tp,
                                         sequence_parallel=sequence_parallel, cp=cp, cp_method=cp_method,
                                         cp_layout=cp_layout, zero_stage=zero_stage, zero_shards=shards,
                                         zero3_reshard_per_microbatch=zero3_reshard_per_microbatch)
        return max((r.memory for r in ranks), key=lambda mem: mem.total)
    state = _state_terms(config, dims, zero_stage=zero_stage, precision=precision)
    split = BlockSplit(tp=tp, sequence_parallel=sequence_parallel, cp=cp, cp_method=cp_method,
                       cp_layout=cp_layout)
    activations = _activation_terms(config, dims, micro_batch=micro_batch, seq_len=seq_len,
                                    precision=precision, checkpointed_blocks=checkpointed_blocks,
                                    expert_loads=expert_loads, split=split)
    return RunMemory(state=state, activations=activations)


def _state_terms(config: ModelConfig, dims: Layout, *, zero_stage: int, precision: str) -> dict[str, int]:
    """``run_memory_per_rank``'s model state of one rank at pp = 1, by term: the weights, gradients and
    AdamW state of ZeRO ``zero_stage``, ZeRO-3's gathered units, autocast's 16-bit weight copies (fp8: but
    the fp8 layers', and their transient cast)."""
    p = compute_dtype_of(precision).itemsize  # fp8: bf16 autocast around the fp8 linears
    tp, ep = tensor_parallel_degree(dims), expert_parallel_degree(dims)
    shards = zero_shard_degree(dims)
    zero = state_memory_per_rank(config, dims, zero_stage=zero_stage)
    state = {"weights": zero.weights, "grads": zero.grads, "AdamW state": zero.optimizer}
    if zero_stage == 3:  # FSDP's units: each block, and the root (embedding, final LayerNorm, output layer)
        table = param_table(config, tp=tp)  # under tp the rank's blocks of them, gathered over dp x cp
        # an MoE block's experts: a unit of their own inside the block's, gathered while the block is: its
        # rank's E/ep experts (gathered over edp) beside the block's other tensors
        blocks = [[(q.shape[0] // ep, *q.shape[1:]) if is_expert_tensor(q.name) else q.shape for q in block]
                  for block in table.blocks]
        root = [q.shape for q in table.embedding + table.final_layernorm + table.output_layer]
        state["ZeRO-3 gathered units"] = zero3_peak_gathered_bytes([root, *blocks], shards).weights
    if p != 4:  # fp8: no bf16 copy of an fp8 layer's weight, a transient 1-byte cast (refimpl/planner/fp8.py)
        fp8 = fp8_weights(config, tp=tp) if precision == "fp8" else ()
        bf16_weights = autocast_weight_elements(config, tp=tp, ep=ep) - sum(q.numel for q in fp8)
        state["autocast weight copies"] = p * bf16_weights
        if fp8:
            state["fp8 weight cast (transient, largest layer)"] = max(q.numel for q in fp8)
    return state


def _activation_terms(config: ModelConfig, dims: Layout, *, micro_batch: int, seq_len: int, precision: str,
                      checkpointed_blocks: set[int] | list[int] | tuple[int, ...],
                      expert_loads: Sequence[ExpertLoad] | None, split: BlockSplit) -> dict[str, int]:
    """``run_memory_per_rank``'s activations of one rank at pp = 1, by term: the blocks' saved tensors
    (MoE blocks': for the routed rows; fp8: and the fp8 layers' float32 inputs), the recomputed block's in
    backward, what the model saves outside the blocks, the logits and their gradient."""
    compute = compute_dtype_of(precision)  # fp8: bf16 autocast around the fp8 linears
    p, b, v, ep = compute.itemsize, micro_batch, config.vocab_size, expert_parallel_degree(dims)
    tp, cp = split["tp"], split["cp"]
    chosen = set(checkpointed_blocks)
    kw = _ActivationArgs(micro_batch=b, seq_len=seq_len, compute_dtype=compute, **split)
    if config.num_experts:  # MoE blocks: their saved tensors for the routed rows (refimpl/planner/experts.py)
        moe = functools.partial(moe_activation_bytes, config, micro_batch=b, seq_len=seq_len,
                                compute_dtype=compute, tp=tp, ep=ep, loads=expert_loads)
        saved, full = moe(checkpointed_blocks=chosen), moe()
    else:
        saved = activation_bytes(config, checkpointed_blocks=chosen, **kw)
        full = activation_bytes(config, **kw)
    if precision == "fp8":  # fp8 layers save their fp32 LayerNorm-fed inputs (refimpl/planner/fp8.py)
        extra = fp8_extra_saved_bytes(config, micro_batch=b, tokens=seq_len // cp, tp=tp,
                                      sequence_parallel=split["sequence_parallel"])
        saved = [n + (0 if i in chosen else e) for i, (n, e) in enumerate(zip(saved, extra, strict=True))]
        full = [n + e for n, e in zip(full, extra, strict=True)]
    return {
        "block activations": sum(saved),
        "recomputed block (backward)": max(full) if chosen and full else 0,
        **outside_block_bytes(config, **kw),
        "logits + their gradient (transient)": (p + 4) * (seq_len // cp) * b * -(-v // tp),
    }


def run_memory_of(config: ModelConfig, parallel: ParallelConfig, *, world_size: int, micro_batch: int,
                  seq_len: int, num_microbatches: int | None = None) -> RunMemory:
    """``run_memory_per_rank`` at the layout and options of one ``refimpl.config.ParallelConfig``
    (what the trainer's memory preflight plans: ``RunOptions.parallel``): ``world_size`` gives ``dp`` when
    ``parallel.dp`` is None; the checkpointed blocks are ``parallel.checkpointed_blocks``; under pipeline
    parallelism ``num_microbatches`` (default ``parallel.microbatches``, else ``pp``) micro-batches of
    ``micro_batch`` sequences per step."""
    # what the trainer refuses is not planned, nor what the terms do not count
    check_supported(dataclasses.replace(parallel, dp=None), moe=bool(config.num_experts))
    check_modelled(config, parallel, what="run_memory_of", memory=True)
    dims = ParallelDims.from_world(world_size, **parallel.degrees)
    return run_memory_per_rank(config, dims, micro_batch=micro_batch, seq_len=seq_len,
                               zero_stage=parallel.zero_stage, precision=parallel.precision,
                               checkpointed_blocks=parallel.checkpointed_blocks(config.num_layers),
                               sequence_parallel=parallel.sequence_parallel, cp_method=parallel.cp_method,
                               cp_layout=parallel.cp_layout, pp_schedule=parallel.pp_schedule,
                               virtual_stages=parallel.virtual_stages, pp_balance=parallel.pp_balance,
                               num_microbatches=num_microbatches or parallel.microbatches,
                               zero3_reshard_per_microbatch=parallel.zero3_reshard_per_microbatch)
