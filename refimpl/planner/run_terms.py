"""The formulas the techniques' declared terms read (``refimpl.planner.step_bytes``; chapters 04-08 and
10), each read from the runtime's code and proven against the trainer to the byte
(tests/planner/ranks/test_planner_zero3.py, tests/planner/ranks/test_planner_3d.py):

* ``data_parallel_bytes``: ZeRO 0-3 and HSDP's gradients and parameters (its docstring);
* ``tp_stage_payloads`` and ``recompute_tp_payloads``: a stage's tensor-parallel collectives, and those a
  checkpointed block's recomputed forward repeats (``torch.utils.checkpoint``'s non-reentrant early stop
  ends it at the second MLP linear's input: the attention's row layer reduces again, the MLP's does not);
* ``sixteen_bit_weight_activations``: ZeRO-3 in bf16 computes in the gathered 16-bit weights (FSDP2's
  ``MixedPrecisionPolicy``), so the residual stream and the norms' inputs are 16-bit too;
* ``shard_group_rank``: a rank's index in the group ZeRO shards over.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from refimpl.comm.tracer import wire_bytes
from refimpl.config import ConfigError, ModelConfig
from refimpl.distributed.mesh import ParallelDims, group_name
from refimpl.planner.activations import activation_bytes, local_tokens
from refimpl.planner.communication import shared_qkv_elements, tp_stage_collectives, zero_collectives
from refimpl.planner.zero_state import Shape, padded_numel, sharded_numel
from refimpl.support import not_modelled

__all__ = ["DP_KEY", "REPLICA_KEY", "SHARD_KEY", "add_wire_bytes", "data_parallel_bytes", "final_norm_16",
           "recompute_tp_payloads", "shard_group_rank",
           "sixteen_bit_weight_activations", "sp_gradient_payload", "stage_zero3_units", "tp_stage_payloads"]

# metrics.jsonl's group keys, named as the mesh and the placements name the groups
DP_KEY, SHARD_KEY = group_name("dp", "cp"), group_name("dp_shard", "cp")
REPLICA_KEY = group_name("dp_replicate")


def add_wire_bytes(out: dict[str, float], key: str, op: str, payload: float, n: int) -> None:
    """Add to ``out[key]`` the wire bytes of ``op`` on ``payload`` bytes over ``n`` ranks (none at one)."""
    if n > 1 and payload:
        out[key] = out.get(key, 0.0) + wire_bytes(op, payload, n)


def shard_group_rank(dims: ParallelDims, rank: int) -> int:
    """``rank``'s index in the group ZeRO shards over, ranks ascending: ``dp_i cp + cp_i`` in ``dp x cp``;
    under HSDP (``dims.dp_replicate`` > 1) ``dp_shard_i cp + cp_i`` in its shard group (the refactored
    grid, ``refimpl.distributed.mesh.ParallelDims.hsdp_grid``)."""
    c = dims.coordinates(rank)
    if dims.dp_replicate == 1:
        return c.dp * dims.cp + c.cp
    return dims.hsdp_grid.coordinates(rank)["dp_shard"] * dims.cp + c.cp


def data_parallel_bytes(unit_shapes: Sequence[Sequence[Shape]], *, zero_stage: int, dp_cp: int,
                        replicas: int = 1, microbatches: int = 1, gather_bytes: int = 4,
                        zero3_kept: bool = False,
                        fp8: Sequence[Sequence[bool]] | None = None) -> dict[str, float]:
    """Wire bytes one rank sends per step for data parallelism's gradients and parameters, by group key;
    not the loss's or the norm's scalars. ZeRO-0: one all-reduce over ``dp x cp`` per step; ZeRO-1: one
    reduce-scatter of the padded gradients and one all-gather of the stepped parameters; ZeRO-2: the
    reduce-scatter in every backward (``m`` per step), the all-gather once. ZeRO-3 per micro-batch: every
    unit all-gathered for forward and all but the root again before backward (the root is kept; a
    checkpointed block's recomputation gathers nothing), one reduce-scatter per unit
    (``refimpl.planner.communication.zero_collectives``), gathers in ``param_dtype``, reductions in fp32;
    HSDP (``replicas`` R > 1): the same over the shard group, each unit's reduced shard all-reduced over
    the R replicas. Under pp (``zero3_kept``) each unit of a stage gathered once per step and its
    accumulated gradients reduced once (``finish_gradient_sync``). ``unit_shapes``: the rank's parameter
    shapes (its tensor-parallel blocks; pp: its stages' tensors), cut into ZeRO-3's units, the root first
    (stages 0-2 use only their union; ZeRO-3 under pp: one stage's units, its root first, called per
    stage); ``dp_cp``: the ``dp x cp`` ranks; ``replicas``: HSDP's R (ZeRO-3); ``microbatches``: backwards
    per step; ``gather_bytes``: ZeRO-3's ``param_dtype`` size; ``fp8`` (ZeRO-3 at pp = 1 under
    ``--precision fp8``): per unit, which tensors are gathered as e4m3, one byte per element beside the
    others' ``gather_bytes``, each gather preceded by the MAX all-reduce of the unit's fp32 amaxes
    (``refimpl.parallel.zero.fsdp_float8``)."""
    out: dict[str, float] = {}
    shapes = [s for unit in unit_shapes for s in unit]
    m, n = microbatches, dp_cp
    if zero_stage == 0:
        add_wire_bytes(out, DP_KEY, "all_reduce", 4 * sum(math.prod(s) for s in shapes), n)
    elif zero_stage in (1, 2):
        grads = 4 * padded_numel(shapes, n)
        add_wire_bytes(out, DP_KEY, "reduce_scatter", (m if zero_stage == 2 else 1) * grads, n)
        add_wire_bytes(out, DP_KEY, "all_gather", grads, n)
    else:
        shard = n // replicas
        key = DP_KEY if replicas == 1 else SHARD_KEY
        if fp8 is not None:  # per tensor: e4m3 bytes or gather_bytes; the root once, the blocks twice
            if zero3_kept:
                raise ConfigError(not_modelled("fp8-pp-zero3"))  # refimpl/support.py
            times = [1 if u == 0 else 2 for u in range(len(unit_shapes))]
            gathered = sum(t * sum(padded_numel([s], shard) * (1 if f else gather_bytes)
                                   for s, f in zip(unit, flags, strict=True))
                           for t, unit, flags in zip(times, unit_shapes, fp8, strict=True) if unit)
            add_wire_bytes(out, key, "all_gather", m * gathered, shard)
            amaxes = sum(t * 4 * sum(flags) for t, flags in zip(times, fp8, strict=True))
            if amaxes:
                add_wire_bytes(out, key, "all_reduce", m * amaxes, shard)
        elif zero3_kept:  # each unit gathered once per step (padded rows), every unit with a root's count
            gathered = gather_bytes * sum(padded_numel(unit, shard) for unit in unit_shapes)
            add_wire_bytes(out, key, "all_gather", gathered, shard)
        else:
            gathers = zero_collectives(unit_shapes, shard, 3, bytes_per_element=gather_bytes)
            if "all_gather" in gathers:
                add_wire_bytes(out, key, "all_gather", m * gathers["all_gather"][1], shard)
        reductions = 1 if zero3_kept else m  # the accumulated full gradients once, or every backward's
        for op, (_, payload) in zero_collectives(unit_shapes, shard, 3, replicas=replicas).items():
            if op == "reduce_scatter":
                add_wire_bytes(out, key, op, reductions * payload, shard)
            elif op == "all_reduce":  # HSDP: each unit's reduced shard over the replicas
                add_wire_bytes(out, REPLICA_KEY, op, reductions * payload, replicas)
    return out


def sp_gradient_payload(shapes: Sequence[Shape], *, zero_stage: int, n: int, group_rank: int) -> int:
    """Float32 bytes of the sequence-parallel gradients (``shapes``: the replicated parameters that saw
    ``s/t`` tokens) a rank all-reduces over tp once per step, after the data-parallel reduction
    (``OptimizerSetup.finish_gradients``): whole at ZeRO-0, else the rank's row shards of them (ZeRO-1/2:
    the optimizer's shards' gradients; ZeRO-3: the wrapper's), ``sharded_numel`` of ``n`` ranks."""
    if zero_stage == 0:
        return 4 * sum(math.prod(s) for s in shapes)
    return 4 * sharded_numel(shapes, group_rank, n)


def recompute_tp_payloads(*, checkpointed: int, x: int, sequence_parallel: bool,
                          shared_qkv: int = 0) -> dict[str, int]:
    """Float32 payloads (bytes) of the tensor-parallel collectives the recomputed forwards of
    ``checkpointed`` blocks repeat in one micro-batch's backward, ``x = b s_c h`` (module docstring);
    ``shared_qkv``: the elements of a block's qkv output all-gathered when fewer key/value heads than
    ranks share them (``shared_qkv_elements``), gathered again too."""
    gather = {"all_gather": 4 * checkpointed * shared_qkv} if shared_qkv else {}
    if not sequence_parallel:
        return {"all_reduce": 4 * checkpointed * x} | gather
    return {"all_gather": 4 * checkpointed * (2 * x + shared_qkv), "reduce_scatter": 4 * checkpointed * x}


def sixteen_bit_weight_activations(config: ModelConfig, *, checkpointed_blocks: Sequence[int],
                                   compute_dtype: torch.dtype, micro_batch: int, seq_len: int,
                                   cp: int = 1, cp_method: str = "ring",
                                   cp_layout: str | None = None) -> dict[str, int]:
    """The activation terms that differ when the model computes in 16-bit weights (ZeRO-3's mixed
    precision, ``tp = 1``): ``"block activations"`` with a 16-bit residual stream, and ``"final layernorm
    + output layer inputs"`` (input and mean/rstd of the final LayerNorm and the head's input, all in
    ``compute_dtype``), for the rank's ``s/cp`` tokens; the other outside terms are
    ``refimpl.planner.activations.outside_block_bytes``' (the float32 log-softmax, the ids)."""
    kw = {"micro_batch": micro_batch, "seq_len": seq_len, "compute_dtype": compute_dtype,
          "residual_dtype": compute_dtype, "cp": cp, "cp_method": cp_method, "cp_layout": cp_layout}
    blocks = sum(activation_bytes(config, checkpointed_blocks=set(checkpointed_blocks), **kw))
    p = compute_dtype.itemsize
    tokens = micro_batch * local_tokens(config, seq_len=seq_len, cp=cp, cp_method=cp_method,
                                        cp_layout=cp_layout, tp=1)
    return {"block activations": blocks,
            "final layernorm + output layer inputs": final_norm_16(config, p, tokens)}


def final_norm_16(config: ModelConfig, p: int, tokens: int) -> int:
    """The final norm's saved tensors and the head's input (``p`` bytes) in a 16-bit model: LayerNorm's
    input, mean and rstd in ``p`` bytes; RMSNorm computes in float32, keeping its input's float32 copy,
    rstd and ``x * rstd``."""
    h = config.hidden_size
    if config.normalization == "rmsnorm":
        return 8 * tokens * h + 4 * tokens + p * tokens * h
    return 2 * p * tokens * h + 2 * p * tokens


def tp_stage_payloads(config: ModelConfig, *, layers: int, first: bool, last: bool, x: int, tokens: int,
                      sequence_parallel: bool, tp: int = 1) -> dict[str, int]:
    """One micro-batch's tensor-parallel payloads (float32 bytes) on a stage holding ``layers`` blocks:
    ``refimpl.planner.communication.tp_stage_collectives``' payloads."""
    return {op: payload for op, (_, payload) in tp_stage_collectives(
        layers=layers, first=first, last=last, x=x, tokens=tokens, sequence_parallel=sequence_parallel,
        shared_qkv=shared_qkv_elements(config, tp=tp, tokens=tokens)).items()}


def stage_zero3_units(table, *, stage: int, num_stages: int, blocks: range) -> list[list[tuple[int, ...]]]:
    """ZeRO-3's units of pipeline stage ``stage`` as ``FullyShardedDataParallel(stage)`` cuts it
    (``shard_into_units``): the root, the stage's tensors outside its blocks (the embedding on the first
    stage, the final LayerNorm and the output layer, or the tied copy of the embedding, on the last; none
    on a middle stage), then each block (``table``: ``refimpl.planner.param_table.param_table``)."""
    root = list(table.embedding) if stage == 0 else []
    if stage == num_stages - 1:
        root += [*table.final_layernorm, *(table.output_layer or (table.head,))]
    return [[q.shape for q in root], *[[q.shape for q in table.blocks[i]] for i in blocks]]
