"""The terms ``refimpl.planner.run_prediction.predict_run`` adds for ZeRO-2/3, HSDP, activation
checkpointing and ZeRO-3's 16-bit weights (chapters 04, 05 and 10), each read from the runtime's code and
proven against the trainer to the byte in tests/test_planner_zero3.py.

* ``data_parallel_bytes``: the bytes one rank sends per step for the gradients and parameters of data
  parallelism, by ``metrics.jsonl`` group key. ZeRO-0: one all-reduce of the gradients over ``dp x cp``
  per step (``DataParallelBucket`` under ``no_sync`` but the last micro-batch; ``reduce_gradients_`` after
  the pipeline's last backward). ZeRO-1: one reduce-scatter of the padded gradients and one all-gather of
  the stepped parameters (``ShardedOptimizer.step``). ZeRO-2: the reduce-scatter in every backward, so once
  per micro-batch (``ShardedOptimizer._on_grad_ready``: the buckets of a backward cover all its gradients,
  flushed at its end; bucket sizes move the same padded total), the all-gather once, after the step.
  ZeRO-3 (``FullyShardedDataParallel``): per micro-batch, every unit (each block, the root) all-gathered
  for forward and every unit but the root again before its backward (the root is kept from forward to the
  end of backward; a checkpointed block's recomputation runs after its pre-backward gather and gathers
  nothing), and one reduce-scatter per unit with trainable parameters
  (``refimpl.planner.communication.zero_collectives``); the gathers in ``param_dtype`` (bf16 under
  ZeRO-3's mixed precision: 2 bytes), the reductions in ``reduce_dtype`` (fp32). HSDP (``dp_replicate``
  R > 1): the same over the shard group ``"dp_shard x cp"`` of ``dp/R cp`` ranks, and each unit's reduced
  padded shard all-reduced over the R replicas (``"dp_replicate"``; ``fsdp_communications.
  reduce_scatter_grads``). ZeRO-3 under pipeline parallelism (``refimpl.parallel.parallelize.
  _shard_stages``: each stage sharded in place over ``dp x cp``, its own root unit, the stage's modules
  outside its blocks): by default (``zero3_kept``) every unit of the stage all-gathered once per step, in
  the first forward, and kept through the micro-batches (``reshard_after_forward=False``, the root's
  pre-forward hook finds it gathered), the full gradients accumulated over the micro-batches
  (``set_requires_gradient_sync(False)``) and reduce-scattered once per unit after the schedule
  (``finish_gradient_sync`` from ``PipelineModule.after_backward``): one all-gather and one reduce-scatter
  of each unit's padded tensors per step, whatever ``m``; with ``--zero3-reshard-per-microbatch`` the
  pp = 1 schedule per micro-batch, ``m`` times: a unit's forward gathers it, its backward again but the
  root's, and reduce-scatters it. The root is gathered ``m`` times whatever the schedule: every backward
  ends by freeing all units (``_finish_backward``), and the next action (a forward, or a backward's
  pre-backward hook) gathers it again, so it is gathered once per backward.
* ``recompute_tp_payloads``, the tensor-parallel collectives a checkpointed block's recomputed forward
  repeats in backward: ``torch.utils.checkpoint``'s non-reentrant early stop ends the recomputation once
  the block's last saved tensor (the second MLP linear's input) is rebuilt, so the attention's row layer
  reduces again (``g``: one all-reduce of ``b s_c h``; under sequence parallelism the QKV and first MLP
  column inputs' two all-gathers and the attention's reduce-scatter) and the MLP's row layer does not.
  Context parallelism's attention runs again too: its forward exchanges, once per checkpointed block and
  micro-batch (``refimpl.planner.communication.context_parallel_bytes``' ``"forward"``).
* ``sixteen_bit_weight_activations``: ZeRO-3 in bf16 computes in the gathered 16-bit weights (FSDP2's
  ``MixedPrecisionPolicy``, no autocast), so the residual stream, the LayerNorms' inputs and statistics
  and a checkpointed block's input are 16-bit too (``refimpl.planner.activations.
  activation_bytes_per_layer`` with ``residual_dtype``), and outside the blocks the final LayerNorm's input
  and statistics and the head's input; the loss's log-softmax stays float32 (``lm_loss`` casts the logits).
* ``shard_group_rank``: a rank's index in the group ZeRO shards over (``dp x cp``, or HSDP's shard
  group), the ``dp_rank`` of ``refimpl.planner.memory.state_memory_per_rank``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from refimpl.comm.tracer import wire_bytes
from refimpl.config import ModelConfig, ParallelConfig
from refimpl.distributed.mesh import Coordinates, ParallelDims
from refimpl.parallel.pipeline_parallel import Action, stage_rank
from refimpl.planner.activations import activation_bytes, local_tokens
from refimpl.planner.communication import zero_collectives
from refimpl.planner.param_table import ParamSpec, ParamTable
from refimpl.planner.run_memory import RunMemory
from refimpl.planner.zero_state import Shape, padded_numel, sharded_numel

if TYPE_CHECKING:  # pipeline.py reads final_norm_16 from here
    from refimpl.planner.pipeline import PipelineRankMemory

__all__ = ["DP_KEY", "REPLICA_KEY", "SHARD_KEY", "STEP_BYTES", "Rank", "Run", "data_parallel_bytes",
           "final_norm_16", "recompute_tp_payloads", "shard_group_rank", "shared_qkv_elements",
           "sixteen_bit_weight_activations", "sp_gradient_payload", "stage_zero3_units", "tp_stage_payloads"]

DP_KEY, SHARD_KEY, REPLICA_KEY = "dp x cp", "dp_shard x cp", "dp_replicate"  # metrics.jsonl's group keys
_SCALAR = 4  # a float32 scalar: the loss, the gradient norm's sum of squares


def _add(out: dict[str, float], key: str, op: str, payload: float, n: int) -> None:
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
    """Wire bytes one rank sends per step for data parallelism's gradients and parameters (module
    docstring), by group key; not the loss's or the norm's scalars. ``unit_shapes``: the rank's parameter
    shapes (its tensor-parallel blocks; pp: its stages' tensors), cut into ZeRO-3's units, the root first
    (stages 0-2 use only their union; ZeRO-3 under pp: one stage's units, its root first, called per
    stage); ``dp_cp``: the ``dp x cp`` ranks; ``replicas``: HSDP's R (ZeRO-3); ``microbatches``: backwards
    per step; ``gather_bytes``: ZeRO-3's ``param_dtype`` size; ``zero3_kept``: ZeRO-3 under pp by default,
    each unit gathered once per step and kept, its accumulated gradients reduced once (module docstring);
    ``fp8`` (ZeRO-3 at pp = 1 under ``--precision fp8``): per unit, which tensors are gathered as e4m3, one
    byte per element beside the others' ``gather_bytes``, each gather preceded by the MAX all-reduce of the
    unit's fp32 amaxes (``refimpl.parallel.zero.fsdp_float8``)."""
    out: dict[str, float] = {}
    shapes = [s for unit in unit_shapes for s in unit]
    m, n = microbatches, dp_cp
    if zero_stage == 0:
        _add(out, DP_KEY, "all_reduce", 4 * sum(math.prod(s) for s in shapes), n)
    elif zero_stage in (1, 2):
        grads = 4 * padded_numel(shapes, n)
        _add(out, DP_KEY, "reduce_scatter", (m if zero_stage == 2 else 1) * grads, n)
        _add(out, DP_KEY, "all_gather", grads, n)
    else:
        shard = n // replicas
        key = DP_KEY if replicas == 1 else SHARD_KEY
        if fp8 is not None:  # per tensor: e4m3 bytes or gather_bytes; the root once, the blocks twice
            if zero3_kept:
                raise ValueError("fp8 gathers under the pipeline are not modelled")
            times = [1 if u == 0 else 2 for u in range(len(unit_shapes))]
            gathered = sum(t * sum(padded_numel([s], shard) * (1 if f else gather_bytes)
                                   for s, f in zip(unit, flags, strict=True))
                           for t, unit, flags in zip(times, unit_shapes, fp8, strict=True) if unit)
            _add(out, key, "all_gather", m * gathered, shard)
            amaxes = sum(t * 4 * sum(flags) for t, flags in zip(times, fp8, strict=True))
            if amaxes:
                _add(out, key, "all_reduce", m * amaxes, shard)
        elif zero3_kept:  # each unit gathered once per step (padded rows), every unit with a root's count
            gathered = gather_bytes * sum(padded_numel(unit, shard) for unit in unit_shapes)
            _add(out, key, "all_gather", gathered, shard)
        else:
            gathers = zero_collectives(unit_shapes, shard, 3, bytes_per_element=gather_bytes)
            if "all_gather" in gathers:
                _add(out, key, "all_gather", m * gathers["all_gather"][1], shard)
        reductions = 1 if zero3_kept else m  # the accumulated full gradients once, or every backward's
        for op, (_, payload) in zero_collectives(unit_shapes, shard, 3, replicas=replicas).items():
            if op == "reduce_scatter":
                _add(out, key, op, reductions * payload, shard)
            elif op == "all_reduce":  # HSDP: each unit's reduced shard over the replicas
                _add(out, REPLICA_KEY, op, reductions * payload, replicas)
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


def shared_qkv_elements(config: ModelConfig, *, tp: int, tokens: int) -> int:
    """Elements of one block's qkv output that ``refimpl.models.gpt_sharding.SharedKeyValueQKV``
    all-gathers (and reduce-scatters back) when ``t/g`` ranks share each key/value head, ``tokens (a + 2g)
    d``; 0 when each rank holds whole query groups."""
    if config.query_groups >= tp:
        return 0
    return tokens * (config.num_attention_heads + 2 * config.query_groups) * config.head_dim


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
    p = torch.empty((), dtype=compute_dtype).element_size()
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
    """One micro-batch's tensor-parallel payloads (float32 bytes) on a stage holding ``layers`` blocks
    (first / last stage: the embedding / the head and loss), ``x = b s_c h``, ``tokens = b s_c``: the
    stage's part of ``refimpl.planner.communication.tensor_parallel_collectives`` (the parts of all
    stages add up to it)."""
    f, la = int(first), int(last)
    # fewer key/value heads than tp: each block's qkv output gathered (backward: reduced-scattered)
    shared = 4 * layers * shared_qkv_elements(config, tp=tp, tokens=tokens)
    if not sequence_parallel:  # f/g all-reduces: 4 per block, the embedding's sum, the head's f
        out = {"all_reduce": 4 * (4 * layers * x + f * x + la * (x + 3 * tokens))}
        return out | ({"all_gather": shared, "reduce_scatter": shared} if shared else {})
    # SP: the embedding reduce-scatters into the sequence shard (backward: all-gather)
    return {"all_reduce": 4 * la * 3 * tokens,
            "all_gather": 4 * (6 * layers + f + 2 * la) * x + shared,
            "reduce_scatter": 4 * (4 * layers + f + la) * x + shared}


def stage_zero3_units(table, *, stage: int, num_stages: int, blocks: range) -> list[list[tuple[int, ...]]]:
    """ZeRO-3's units of pipeline stage ``stage`` as ``FullyShardedDataParallel(stage)`` cuts it
    (``shard_into_units``): the root, the stage's tensors outside its blocks (the embedding on the first
    stage, the final LayerNorm and the output layer, or the tied copy of the embedding, on the last; none
    on a middle stage), then each block (``table``: ``refimpl.planner.param_table.param_table``)."""
    root = list(table.embedding) if stage == 0 else []
    if stage == num_stages - 1:
        root += [*table.final_layernorm, *(table.output_layer or (table.head,))]
    return [[q.shape for q in root], *[[q.shape for q in table.blocks[i]] for i in blocks]]


@dataclass(frozen=True, kw_only=True)
class Run:
    """What every rank's terms read, computed once by ``refimpl.planner.run_prediction.predict_run``: the
    run's options; ``m``
    micro-batches per step of ``b`` sequences (``per_rank`` per data-parallel rank) of ``s_c`` tokens on
    each rank, ``x = b s_c h`` and ``tokens = b s_c``; ``n = dp x cp`` ranks, ``shard_n`` of them in a ZeRO
    shard group; the stages' blocks (``ranges``), the parameters (``table``), ZeRO-3's units (and which of
    their tensors fp8 gathers); one layer's context-parallel bytes; under pipeline parallelism the pipeline
    ranks' memory (``pipe``) and actions (``schedule``), else the one rank's (``flat``)."""

    config: ModelConfig
    parallel: ParallelConfig
    dims: ParallelDims
    seq_len: int
    grad_clip: float | None
    checkpointed: list[int]
    m: int
    b: int
    per_rank: int
    s_c: int
    x: int
    tokens: int
    n: int
    shard_n: int
    num_stages: int
    ranges: list[range]
    table: ParamTable
    units: Sequence[Sequence[Shape]]
    fp8_units: list[list[bool]] | None
    cp_layer: dict[str, int] | None
    pipe: list[PipelineRankMemory] | None
    schedule: list[list[Action]] | None
    flat: RunMemory | None


@dataclass(frozen=True, kw_only=True)
class Rank:
    """One rank as its terms read it: its ``coords`` in the mesh, the pipeline ``stages`` it holds, their
    ``params`` (its tensor-parallel shards), the ``shapes`` its ZeRO 0-2 shards and its index in the ZeRO
    shard group (``group_rank``, ``shard_group_rank``)."""

    coords: Coordinates
    stages: list[int]
    params: list[ParamSpec]
    shapes: Sequence[Shape]
    group_rank: int


def _recomputed(run: Run, r: Rank) -> int:
    """How many of the rank's blocks are checkpointed (their forwards run again in every backward)."""
    return sum(i in run.checkpointed for st in r.stages for i in run.ranges[st])


def tensor_parallel_step_bytes(run: Run, r: Rank) -> dict[str, float]:
    """``tp`` (chapter 06): per micro-batch each held stage's collectives (``tp_stage_payloads``) and those
    the recomputed forwards of its checkpointed blocks repeat (``recompute_tp_payloads``); once per step,
    under sequence parallelism, the ``s/t``-token gradients' all-reduce (``sp_gradient_payload``)."""
    config, tp, sp = run.config, run.dims.tp, run.parallel.sequence_parallel
    out: dict[str, float] = {}
    payloads = [tp_stage_payloads(config, layers=len(run.ranges[st]), first=st == 0,
                                  last=st == run.num_stages - 1, x=run.x, tokens=run.tokens, tp=tp,
                                  sequence_parallel=sp) for st in r.stages if tp > 1]
    if (recomputed := _recomputed(run, r)) and tp > 1:
        shared = shared_qkv_elements(config, tp=tp, tokens=run.tokens)
        payloads.append(recompute_tp_payloads(checkpointed=recomputed, x=run.x, sequence_parallel=sp,
                                              shared_qkv=shared))
    for payload in payloads:
        for op, nbytes in payload.items():
            _add(out, "tp", op, run.m * nbytes, tp)
    if sp:  # the LayerNorms' and row biases' gradients, after the data-parallel reduction
        replicated = [q.shape for q in r.params if q.sequence_parallel_gradient]
        _add(out, "tp", "all_reduce", sp_gradient_payload(replicated, zero_stage=run.parallel.zero_stage,
                                                          n=run.shard_n, group_rank=r.group_rank), tp)
    return out


def context_parallel_step_bytes(run: Run, r: Rank) -> dict[str, float]:
    """``cp`` (chapter 07): per micro-batch every held block's attention exchanges, forward and backward
    (``refimpl.planner.communication.context_parallel_bytes``), and a checkpointed block's forward ones again
    in its recomputation."""
    if run.cp_layer is None:
        return {}
    layers = sum(len(run.ranges[st]) for st in r.stages)
    forward, backward = run.cp_layer["forward"], run.cp_layer["backward"]
    return {"cp": float(run.m * (layers * (forward + backward) + _recomputed(run, r) * forward))}


def pipeline_step_bytes(run: Run, r: Rank) -> dict[str, float]:
    """``pp`` (chapter 08): per micro-batch each held stage's float32 ``[b, s_c/u, h]`` output (not the last
    stage) and input gradient (not the first), ``u = t`` under sequence parallelism; once per step the tied
    embedding's gradient between the first and the last rank, both ways (``sync_tied_embeddings``; under
    ZeRO-2/3 the rank's shard of it), and the step loss's scalar from the last stage."""
    pp, last = run.dims.pp, run.num_stages - 1
    if pp == 1:
        return {}
    boundary = 4 * run.b * (run.s_c // (run.dims.tp if run.parallel.sequence_parallel else 1))
    out = {"pp": float(sum(run.m * boundary * run.config.hidden_size * ((st != last) + (st != 0))
                           for st in r.stages))}
    if run.config.tie_word_embeddings and r.coords.pp in (stage_rank(0, pp_size=pp),
                                                           stage_rank(last, pp_size=pp)):
        head, sharded = run.table.head, run.parallel.zero_stage in (2, 3) and run.shard_n > 1
        out["pp"] += 4 * (sharded_numel([head.shape], r.group_rank, run.shard_n) if sharded else head.numel)
    _add(out, "pp", "all_reduce", _SCALAR, pp)
    return out


def gradient_norm_bytes(run: Run, r: Rank) -> dict[str, float]:
    """Clipping (chapter 04): the norm's float32 sum of squares all-reduced over each group the gradients
    are split over: ``pp``, ``tp`` and under ZeRO 1-3 the shard group (``dp x cp``; under HSDP
    ``dp_shard x cp``: the replicas hold the same shard). Nothing without clipping."""
    out: dict[str, float] = {}
    if run.grad_clip is not None:
        _add(out, "pp", "all_reduce", _SCALAR, run.dims.pp)
        _add(out, "tp", "all_reduce", _SCALAR, run.dims.tp)
        if run.parallel.zero_stage:
            key = DP_KEY if run.dims.dp_replicate == 1 else SHARD_KEY
            _add(out, key, "all_reduce", _SCALAR, run.shard_n)
    return out


def data_parallel_step_bytes(run: Run, r: Rank) -> dict[str, float]:
    """``dp x cp`` (chapters 03-05): the gradients and parameters of ZeRO 0-3 and HSDP
    (``data_parallel_bytes``; ZeRO-3 under pp: each held stage its own units, gathered once per step unless
    ``--zero3-reshard-per-microbatch``), and the loss's mean."""
    parallel, zero_stage = run.parallel, run.parallel.zero_stage
    unit_lists: list[Sequence[Sequence[Shape]]] = [run.units if zero_stage == 3 else [r.shapes]]
    if zero_stage == 3 and run.dims.pp > 1:  # each stage its own wrapper (parallelize's _shard_stages)
        unit_lists = [stage_zero3_units(run.table, stage=st, num_stages=run.num_stages, blocks=run.ranges[st])
                      for st in r.stages]
    out: dict[str, float] = {}
    for units in unit_lists:
        for key, nbytes in data_parallel_bytes(
                units, zero_stage=zero_stage, dp_cp=run.n, replicas=run.dims.dp_replicate, microbatches=run.m,
                gather_bytes=2 if parallel.fsdp_mixed_precision else 4,
                fp8=run.fp8_units if zero_stage == 3 else None,
                zero3_kept=run.dims.pp > 1 and not parallel.zero3_reshard_per_microbatch).items():
            out[key] = out.get(key, 0.0) + nbytes
    _add(out, DP_KEY, "all_reduce", _SCALAR, run.n)
    return out


STEP_BYTES: tuple[Callable[[Run, Rank], dict[str, float]], ...] = (
    tensor_parallel_step_bytes, context_parallel_step_bytes, pipeline_step_bytes, gradient_norm_bytes,
    data_parallel_step_bytes)
"""Each technique's bytes sent per step by ``metrics.jsonl`` group key, as one rank reads them: the terms
``predict_run`` adds up."""
