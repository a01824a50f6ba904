"""One trainer run at a layout, predicted per rank before it runs: ``predict_run`` (chapter 12).

The composition of the planner's terms for ``python -m refimpl.train --dp D --tp T --pp P --cp C ...``
(the mesh ``pp x dp x cp x tp``, ``refimpl.distributed.mesh``; Narayanan et al. 2021, "Efficient
large-scale language model training on GPU clusters using Megatron-LM", section 3), per rank:

* **state** (``refimpl.measure.state.StateMemory``), read where the trainer steps (the gradients
  reduced): fp32 weights, gradients and AdamW state of the rank's tensor-parallel shards of its pipeline
  stages, sharded by ZeRO stage (Rajbhandari et al. 2020; 1: the AdamW state, 2: and the gradients, 3: and
  the weights) over the ``dp x cp`` ranks, under HSDP over the rank's shard group:
  ``refimpl.planner.memory.state_memory_per_rank``,
  ``refimpl.planner.pipeline.pipeline_state_memory``, the rank's index in the group
  ``refimpl.planner.run_terms.shard_group_rank``. ZeRO-1 also holds its reduced gradient shards
  then (``finish_gradients`` reduce-scatters into them before the loss scaler and the step read them). ZeRO-3:
  the shards only, with or without pp: the full weights and gradients a unit gathers are freed once its
  gradients are reduce-scattered (pp: once per step after the schedule, ``finish_gradient_sync``, or in
  every backward with ``--zero3-reshard-per-microbatch``), before the step (measured: no full tensor is
  allocated there, tests/test_planner_zero3.py). That is not the peak a step reaches: the gathered units
  or stages that the memory preflight adds on top of the state
  (``refimpl.planner.memory.run_memory_per_rank``, under pp
  ``refimpl.planner.pipeline.pipeline_memory_per_rank``'s ZeRO-3 term) are not predicted here;
* **activations**: the bytes saved for backward that the rank holds at its peak: one micro-batch's
  (``refimpl.planner.memory.run_memory_per_rank``'s saved terms, Korthikanti et al. 2022; a backward
  frees them before the next forward; a checkpointed block keeps its input only) or, under pipeline
  parallelism, the schedule's held bytes
  (``refimpl.planner.pipeline.PipelineRankMemory.peak_held``: the micro-batches in flight and the
  sends kept). Where the trainer saves the token ids and labels themselves (no tp, no cp), they are
  views of the step's batch window ``[B/dp, s+1]`` (``refimpl.data``'s ``batch``): its whole int64
  storage, ``8 (B/dp) (s+1)``, is held once, not the ids' and labels' ``8 b s`` each; at ``b > 1`` the
  labels' ``[b, s]`` view is strided, and ``lm_loss``'s ``labels.flatten()`` saves a copy, ``8 b s`` (under
  pipeline parallelism the last stage then holds that copy per micro-batch in flight and no window:
  ``_held_with_label_copies``).
  Under sequence parallelism the embedding's output is the reduce-scatter's ``[b, s_c/t, h]`` shard
  itself (no view of a whole ``[b, s_c, h]``), so the planner's per-layer terms hold at every micro-batch
  size, ``b = 1`` too. ZeRO-3 saves the gathered weights, whose storage it frees after each unit's forward
  (under pp, by default, after the step's last backward): weights, not activations, so in fp32 it holds
  what ZeRO-2 holds (measured, tests/test_planner_zero3.py, with and without pp); in bf16 it computes in
  16-bit weights, a 16-bit residual stream
  (``refimpl.planner.run_terms.sixteen_bit_weight_activations``);
* **bytes sent per step** by process group, under the keys of the trainer's ``metrics.jsonl``
  (``refimpl.train.loop``: ``"tp"``, ``"cp"``, ``"pp"``, ``"dp x cp"``, under HSDP also ``"dp_shard x
  cp"`` and ``"dp_replicate"``; the ring model for collectives, ``refimpl.comm.tracer.wire_bytes``,
  the tensors' bytes for point-to-point sends). Read from the trainer's code, per step with ``A``
  micro-batches of ``b`` sequences, ``s_c = s/cp`` tokens each:

  - ``tp``: every micro-batch's tensor-parallel collectives of the rank's blocks, on the first stage the
    vocab-parallel embedding's (under sequence parallelism a reduce-scatter forward and an all-gather
    backward instead of one all-reduce), on the last the head's and the vocab-parallel loss's three ``b s_c``
    all-reduces (``refimpl.planner.communication.tensor_parallel_collectives``, split by stage);
    per micro-batch and checkpointed block the collectives its recomputed forward repeats before
    checkpoint's early stop (``refimpl.planner.run_terms.recompute_tp_payloads``); under sequence
    parallelism once per step the ``s/t``-token gradients' all-reduce (under ZeRO the rank's row shards
    of them); the gradient norm's float32 scalar (clipping on);
  - ``cp``: every micro-batch's attention traffic of the rank's blocks
    (``refimpl.planner.communication.context_parallel_bytes``), and a checkpointed block's forward
    exchanges again in its recomputation;
  - ``pp``: per micro-batch each stage's ``[b, s_c/u, h]`` float32 output (not the last stage) and input
    gradient (not the first), ``u = t`` under sequence parallelism; the tied embedding's gradient between
    the first and the last rank (``sync_tied_embeddings``, both ways; under ZeRO-2 the rank's shard of it,
    ``gradient_holder``; under ZeRO-3 too: the stage's registered parameter is the rank's shard again when
    the exchange runs, after the gradients' reduce-scatter, and its ``.grad`` the shard's); the step loss's
    and the norm's float32 scalars (``PipelineModule.step``'s all-reduce, the pipeline clip);
  - ``dp x cp`` (under HSDP ``dp_shard x cp`` and ``dp_replicate``): data parallelism's gradients and
    parameters (``refimpl.planner.run_terms.data_parallel_bytes``: ZeRO-0's all-reduce once per
    step; ZeRO-1's reduce-scatter and all-gather of padded shards; ZeRO-2's reduce-scatter per micro-batch;
    ZeRO-3's per micro-batch gathers of every unit, again before its backward but the root, and its
    reduce-scatters, HSDP's all-reduce of each unit's shard over the replicas; under pp each stage's units,
    its root the stage's tensors outside its blocks, by default each gathered and reduce-scattered once per
    step, with ``--zero3-reshard-per-microbatch`` per micro-batch); the loss average's scalar
    (over ``dp x cp`` under HSDP too); under ZeRO 1-3 the norm's scalar (the shards are disjoint over the
    group; under HSDP over the shard group only, the replicas hold the same shard);

* **bubble**: the schedule's textbook idle share
  (``refimpl.parallel.pipeline_parallel.simulator.bubble_formula``), None without pipeline parallelism.

Modelled: fp32 or bf16 (autocast; ZeRO-3: FSDP2's mixed precision, bf16 gathers and compute, fp32 reductions),
ZeRO 0-3, HSDP, activation checkpointing (any block selection), tensor, sequence and context parallelism, and
under pipeline parallelism all of them together: ZeRO-3 with 1F1B, GPipe, interleaved 1F1B or ZB-H1 (fp32 and
bf16), both ZeRO-3 modes (ZB-H1: gathered once per step, the trainer's only mode with it), with tp, cp or
HSDP; checkpointing under every schedule in fp32 (the recomputed blocks' tp and cp traffic counted per
stage); sequence parallelism with ZeRO 1-3; ZB-H1's deferred weight-gradient operands, the rank's tp shards
of them (a tied vocab-parallel head defers nothing). fp8 (bf16 autocast, the linears' GEMMs in fp8:
refimpl/planner/fp8.py's terms) at tp = 1: ZeRO 0-3 at pp = 1 (ZeRO-3: the fp8 weights gathered as e4m3
bytes, ``refimpl.planner.run_terms.data_parallel_bytes``), with cp, and ZeRO 0-2 under the pipeline
(each stage's fp8 layers' float32 inputs, ``refimpl.planner.pipeline.pipeline_memory_per_rank``; under
ZB-H1 the tensorwise fp8 layers' deferred dW operands at one byte,
``refimpl.planner.pipeline.stage_deferred_bytes``).
Refused in the words of the support tables (``refimpl.support``): what the trainer refuses, and what
the planner does not model (``NOT_MODELLED_TABLE``: fp16, 16-bit tensor-parallel traffic, zbv, ...).
Proven against the trainer, to the byte:
tests/test_planner_3d.py (8 ranks: 1F1B, ring attention, ZeRO 0/1, fp32/bf16, with and without
sequence parallelism; ZeRO-3 over the stages' TP blocks, with every block checkpointed too; checkpointing
under GPipe, interleaved 1F1B and ZB-H1 with tp, and under 1F1B with cp; ZB-H1 with tp; ZeRO-3 with cp; HSDP
under the pipeline; sequence parallelism with ZeRO 1-3 under the pipeline) and tests/test_planner_zero3.py
(4 ranks: ZeRO-2/3, 2-D ZeRO-3 with tp, HSDP with and without cp, checkpointing with tp, sequence parallelism
and ring attention, bf16 ZeRO-3, ZeRO-2 under the pipeline, ZeRO-1 with sequence parallelism, ZeRO-3 under
the pipeline: dp 2 x pp 2, 1F1B, GPipe, interleaved (2 virtual stages), ZB-H1 in fp32 and bf16 and 1F1B in
bf16, gathered once per step or per micro-batch; ZeRO-1 and ZeRO-3 with every block checkpointed under 1F1B)
and tests/test_train_fp8.py (2 ranks: fp8 at dp 2, ZeRO 0, 2 and 3, at cp 2, at pp 2 under 1F1B and ZB-H1).
Ulysses goes through the same terms but is not run there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from refimpl.comm.tracer import wire_bytes
from refimpl.config import ModelConfig, ParallelConfig, micro_batches
from refimpl.distributed.mesh import Coordinates, ParallelDims
from refimpl.measure.state import StateMemory
from refimpl.parallel.pipeline_parallel import Action, build_schedule, stage_rank
from refimpl.parallel.pipeline_parallel.simulator import bubble_formula
from refimpl.planner.activations import BlockSplit, local_tokens
from refimpl.planner.communication import context_parallel_bytes
from refimpl.planner.fp8 import fp8_weights
from refimpl.planner.memory import run_memory_per_rank, state_memory_per_rank
from refimpl.planner.param_table import ParamSpec, ParamTable, param_table
from refimpl.planner.params_flops import param_shapes
from refimpl.planner.pipeline import (
    PER_STEP,
    PipelineRankMemory,
    _walk,
    pipeline_memory_per_rank,
    stage_deferred_bytes,
)
from refimpl.planner.pipeline_stages import pipeline_state_memory, stage_layers, stage_params
from refimpl.planner.run_memory import RunMemory
from refimpl.planner.run_terms import (
    DP_KEY,
    SHARD_KEY,
    data_parallel_bytes,
    recompute_tp_payloads,
    shard_group_rank,
    shared_qkv_elements,
    sixteen_bit_weight_activations,
    sp_gradient_payload,
    stage_zero3_units,
    tp_stage_payloads,
)
from refimpl.planner.zero_state import Shape, sharded_numel
from refimpl.precision.policy import compute_dtype_of
from refimpl.support import check_modelled, check_supported

__all__ = ["RankPrediction", "RunPrediction", "predict_run"]

_SCALAR = 4  # a float32 scalar: the loss, the gradient norm's sum of squares
WINDOW = "the step's token window [B/dp, s+1] (int64; ids and labels are views of it)"
LABELS_COPY = "the labels flattened for the loss (int64; a copy: rows of the window are strided)"
_TRANSIENT = ("logits + their gradient (transient)", "recomputed block (backward)")


@dataclass(frozen=True, kw_only=True)
class RankPrediction:
    """One rank: its ``coords`` in the mesh, ``state`` at rest with gradients, the ``activations`` it holds
    at its peak (bytes, by term) and ``bytes_sent`` per step by ``metrics.jsonl`` group key."""

    rank: int
    coords: Coordinates
    state: StateMemory
    activations: dict[str, int]
    bytes_sent: dict[str, float]

    @property
    def activation_bytes(self) -> int:
        return sum(self.activations.values())


@dataclass(frozen=True, kw_only=True)
class RunPrediction:
    """Every rank of the run (rank order), the micro-batches per step and data-parallel rank, their size,
    and the schedule's ``bubble`` (None without pipeline parallelism)."""

    dims: ParallelDims
    microbatches: int
    micro_batch: int
    bubble: float | None
    ranks: list[RankPrediction] = field(default_factory=list)


def _add(out: dict[str, float], key: str, op: str, payload: float, n: int) -> None:
    if n > 1 and payload:
        out[key] = out.get(key, 0.0) + wire_bytes(op, payload, n)


def _held_with_label_copies(config: ModelConfig, rank_memory, parallel: ParallelConfig, *, actions,
                            ranges: list[range], micro_batch: int, seq_len: int) -> dict[str, int]:
    """The held bytes at the peak of the pipeline rank holding the last stage (``rank_memory``, its
    ``refimpl.planner.pipeline.PipelineRankMemory``) where the labels are not held as a view of the
    step's window: at ``b > 1`` (tp = cp = 1) a micro-batch's labels, rows ``[b, s]`` of the window
    ``[B/dp, s+1]``, are strided, and ``lm_loss``'s ``labels.flatten()`` saves a copy, ``8 b s`` per
    micro-batch in flight, in place of the planner's per-step labels term (measured, both 1F1B and GPipe:
    tests/test_planner_zero3.py). The rank's actions walked again (``refimpl.planner.pipeline._walk``)
    with that term moved into the last stage's micro-batch bytes; ``actions``: the rank's of
    ``refimpl.parallel.pipeline_parallel.build_schedule``."""
    num_stages, b, h = len(ranges), micro_batch, config.hidden_size
    saved = {st: dict(terms) for st, terms in rank_memory.saved.items()}
    del saved[num_stages - 1][PER_STEP[1]]
    saved[num_stages - 1][LABELS_COPY] = 8 * b * seq_len
    compute = compute_dtype_of(parallel.precision)
    deferred = None if parallel.pp_schedule != "zbh1" else {
        st: stage_deferred_bytes(config, stage=st, num_stages=num_stages, blocks=ranges[st], micro_batch=b,
                                 seq_len=seq_len, compute_dtype=compute,
                                 fp8_layers={q.name for q in fp8_weights(config)}
                                 if parallel.precision == "fp8" else ()) for st in saved}
    terms, _ = _walk(actions, saved=saved, deferred=deferred, num_stages=num_stages,
                     outputs=4 * b * seq_len * h)  # float32 [b, s, h] at each boundary (tp = cp = 1)
    return terms


def predict_run(config: ModelConfig, parallel: ParallelConfig, *, seq_len: int, global_batch: int,
                world_size: int | None = None, micro_batch: int | None = None,
                grad_clip: float | None = 1.0) -> RunPrediction:
    """Predict one optimizer step of the trainer at the layout and options of ``parallel`` for every rank
    (module docstring): the same ``refimpl.config.ParallelConfig`` the trainer's options give
    (``RunOptions.parallel``) and ``refimpl.parallel.parallelize`` applies.

    ``world_size``: needed when ``parallel.dp`` is None (then ``dp = world_size / (cp tp pp)``, as the
    trainer derives it). ``global_batch`` sequences of ``seq_len`` tokens per step, split over ``dp``;
    ``micro_batch`` (``--micro-batch-size``) and, under pipeline parallelism, ``parallel.microbatches``
    (``--microbatches``, default per-rank batch / ``micro_batch``, else ``pp``) as the trainer reads them;
    ``grad_clip`` None: no norm.

    Every ZeRO stage (``parallel.zero_stage``), HSDP (``parallel.dp_replicate``), the blocks
    ``parallel.activation_checkpointing`` selects, fp32 or bf16 are modelled, and fp8 (ZeRO 0-3 at pp = 1,
    with cp too; under pp ZeRO 0-2, zbh1 tensorwise); a combination the trainer refuses
    (``refimpl.support.check_supported``) or the planner does not model (``refimpl.support.
    NOT_MODELLED_TABLE``) raises a ``refimpl.config.ConfigError`` in its rows' words.
    """
    if world_size is None:
        if parallel.dp is None:
            raise ValueError("predict_run needs parallel.dp or the world_size to derive it from")
        world_size = parallel.dp * parallel.cp * parallel.tp * parallel.pp
    check_supported(parallel)  # what the trainer refuses is not predicted (refimpl/support.py)
    check_modelled(config, parallel)  # nor what the planner does not model (its NOT_MODELLED_TABLE)
    dims = ParallelDims.from_world(world_size, **parallel.degrees)
    checkpointed = parallel.checkpointed_blocks(config.num_layers)
    run = _run_of(config, parallel, dims, seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch,
                  grad_clip=grad_clip, checkpointed=checkpointed)
    ranks = [_predict_rank(run, rank) for rank in range(dims.world_size)]
    pp, m, v = dims.pp, run.m, parallel.virtual_stages
    bubble = (bubble_formula(parallel.pp_schedule, pp_size=pp, num_microbatches=m, virtual_stages=v) if pp > 1
              else None)
    return RunPrediction(dims=dims, microbatches=m, micro_batch=run.b, bubble=bubble, ranks=ranks)


@dataclass(frozen=True, kw_only=True)
class _Run:
    """What every rank's prediction reads, computed once by ``_run_of``: the run's options; ``m``
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


def _run_of(config: ModelConfig, parallel: ParallelConfig, dims: ParallelDims, *, seq_len: int,
            global_batch: int, micro_batch: int | None, grad_clip: float | None,
            checkpointed: list[int]) -> _Run:
    """``predict_run``'s ``_Run``: the batch split as the trainer splits it, the stages, the parameters and
    the memory terms of the run's ranks."""
    precision, sequence_parallel = parallel.precision, parallel.sequence_parallel
    cp_method, cp_layout, pp_schedule = parallel.cp_method, parallel.cp_layout, parallel.pp_schedule
    pp, tp, cp, dp, v = dims.pp, dims.tp, dims.cp, dims.dp, parallel.virtual_stages
    per_rank = global_batch // dp
    m = micro_batches(per_rank_batch=per_rank, micro_batch_size=micro_batch, pp=pp,
                      microbatches=parallel.microbatches)  # the trainer's rule (refimpl.config.micro_batches)
    b, h, n = per_rank // m, config.hidden_size, dp * cp
    s_c = local_tokens(config, seq_len=seq_len, cp=cp, cp_method=cp_method, cp_layout=cp_layout, tp=tp)
    num_stages = pp * v
    ranges = stage_layers(config, num_stages=num_stages, balance=parallel.pp_balance, tp=tp)
    split = BlockSplit(tp=tp, sequence_parallel=sequence_parallel, cp=cp, cp_method=cp_method,
                       cp_layout=cp_layout)
    schedule = (build_schedule(pp_schedule, pp_size=pp, num_microbatches=m, virtual_stages=v)
                if pp > 1 else None)
    # ZeRO-3 in 16 bits: a 16-bit residual
    residual = compute_dtype_of(precision) if parallel.fsdp_mixed_precision else None
    pipe = (pipeline_memory_per_rank(config, pp=pp, num_microbatches=m, schedule=pp_schedule,
                                     virtual_stages=v, micro_batch=b, seq_len=seq_len, precision=precision,
                                     balance=parallel.pp_balance, residual_dtype=residual,
                                     checkpointed_blocks=checkpointed, **split)
            if pp > 1 else None)
    flat = None if pp > 1 else run_memory_per_rank(config, dims, micro_batch=b, seq_len=seq_len,
                                                   precision=precision, sequence_parallel=sequence_parallel,
                                                   cp_method=cp_method, cp_layout=cp_layout,
                                                   checkpointed_blocks=checkpointed)
    table = param_table(config, tp=tp)
    root = table.embedding + table.final_layernorm + table.output_layer
    units = [[q.shape for q in root], *[[q.shape for q in block] for block in table.blocks]]  # ZeRO-3's
    fp8_units = None  # fp8 under ZeRO-3 (pp = 1): which tensors of each unit are gathered as e4m3 bytes
    if precision == "fp8":
        gathered_fp8 = {q.name for q in fp8_weights(config, tp=tp)}
        fp8_units = [[q.name in gathered_fp8 for q in unit] for unit in (root, *table.blocks)]
    shard_n = n // dims.dp_replicate  # the ranks ZeRO shards over: dp x cp, or HSDP's shard group
    cp_layer = context_parallel_bytes(config, micro_batch=b, seq_len=seq_len, cp=cp, method=cp_method, tp=tp,
                                      compute_dtype=compute_dtype_of(precision)) if cp > 1 else None
    return _Run(config=config, parallel=parallel, dims=dims, seq_len=seq_len, grad_clip=grad_clip,
                checkpointed=checkpointed, m=m, b=b, per_rank=per_rank, s_c=s_c, x=b * s_c * h,
                tokens=b * s_c, n=n, shard_n=shard_n, num_stages=num_stages, ranges=ranges, table=table,
                units=units, fp8_units=fp8_units, cp_layer=cp_layer, pipe=pipe, schedule=schedule, flat=flat)


def _predict_rank(run: _Run, rank: int) -> RankPrediction:
    """Rank ``rank``'s prediction (module docstring): the bytes it sends per step, the activations it holds
    at its peak and its state at rest."""
    config, dims, pp, tp = run.config, run.dims, run.dims.pp, run.dims.tp
    c = dims.coordinates(rank)
    group_rank = shard_group_rank(dims, rank)  # the rank's index in the group ZeRO shards over
    stages = [st for st in range(run.num_stages) if stage_rank(st, pp_size=pp) == c.pp]
    held_params = [q for st in stages for q in stage_params(config, stage=st, num_stages=run.num_stages,
                                                            blocks=run.ranges[st], tp=tp)]
    shapes = [q.shape for q in held_params]
    if pp == 1:
        shapes = param_shapes(config, tp=tp)
    sent: dict[str, float] = {}
    _add_microbatch_bytes(run, sent, stages=stages)
    _add_step_bytes(run, sent, c=c, stages=stages, held_params=held_params, shapes=shapes,
                    group_rank=group_rank)
    held, state = _held_and_state(run, c=c, stages=stages, group_rank=group_rank)
    if run.parallel.zero_stage == 1:  # the shards' gradients, reduced before the step (finish_gradients)
        shard_grads = 4 * sharded_numel(shapes, group_rank, run.n)
        state = dataclasses.replace(state, grads=state.grads + shard_grads)
    return RankPrediction(rank=rank, coords=c, state=state, activations=held, bytes_sent=sent)


def _add_microbatch_bytes(run: _Run, sent: dict[str, float], *, stages: list[int]) -> None:
    """Add to ``sent`` what the rank sends per micro-batch: each of its ``stages``' tp collectives, cp
    attention traffic and pipeline boundaries, then what the recomputed forwards of its checkpointed blocks
    send again in every backward."""
    config, pp, tp, m = run.config, run.dims.pp, run.dims.tp, run.m
    sequence_parallel, cp_layer = run.parallel.sequence_parallel, run.cp_layer
    for st in stages:  # per micro-batch: tp collectives, cp attention, pipeline boundaries
        first, last = st == 0, st == run.num_stages - 1
        if tp > 1:
            for op, payload in tp_stage_payloads(config, layers=len(run.ranges[st]), first=first, last=last,
                                                 x=run.x, tokens=run.tokens, tp=tp,
                                                 sequence_parallel=sequence_parallel).items():
                _add(sent, "tp", op, m * payload, tp)
        if cp_layer is not None:
            per_layer = cp_layer["forward"] + cp_layer["backward"]
            sent["cp"] = sent.get("cp", 0.0) + m * len(run.ranges[st]) * per_layer
        if pp > 1:  # float32 [b, s_c/u, h]
            boundary = 4 * run.b * (run.s_c // (tp if sequence_parallel else 1)) * config.hidden_size
            sent["pp"] = sent.get("pp", 0.0) + m * boundary * ((not last) + (not first))
    recomputed = [i for st in stages for i in run.ranges[st] if i in run.checkpointed]  # this rank's blocks
    if recomputed:  # the recomputed forwards of the rank's checkpointed blocks, in every backward
        if tp > 1:
            shared = shared_qkv_elements(config, tp=tp, tokens=run.tokens)
            for op, payload in recompute_tp_payloads(checkpointed=len(recomputed), x=run.x, shared_qkv=shared,
                                                     sequence_parallel=sequence_parallel).items():
                _add(sent, "tp", op, m * payload, tp)
        if cp_layer is not None:
            sent["cp"] = sent.get("cp", 0.0) + m * len(recomputed) * cp_layer["forward"]


def _add_step_bytes(run: _Run, sent: dict[str, float], *, c: Coordinates, stages: list[int],
                    held_params: list[ParamSpec], shapes: Sequence[Shape], group_rank: int) -> None:
    """Add to ``sent`` what the rank (``c``, holding ``stages`` and their ``held_params``, ``shapes`` the
    tensors its ZeRO 0-2 shards) sends once per step: the sequence-parallel gradients' all-reduce, the tied
    embedding's gradient and the step loss over the pipeline, the gradient norm's scalars, data
    parallelism's gradients and parameters, the loss's mean."""
    config, parallel, pp, tp, n = run.config, run.parallel, run.dims.pp, run.dims.tp, run.n
    zero_stage, shard_n, replicas = parallel.zero_stage, run.shard_n, run.dims.dp_replicate
    if parallel.sequence_parallel:  # the s/t-token parameters' gradients (LayerNorms, row biases)
        replicated = [q.shape for q in held_params if q.sequence_parallel_gradient]
        _add(sent, "tp", "all_reduce", sp_gradient_payload(replicated, zero_stage=zero_stage, n=shard_n,
                                                           group_rank=group_rank), tp)
    if pp > 1:
        if config.tie_word_embeddings and c.pp in (stage_rank(0, pp_size=pp),
                                                   stage_rank(run.num_stages - 1, pp_size=pp)):
            tied = (sharded_numel([run.table.head.shape], group_rank, shard_n)
                    if zero_stage in (2, 3) and shard_n > 1
                    else run.table.head.numel)  # ZeRO-2/3 keep (and exchange) only their gradient shard
            sent["pp"] = sent.get("pp", 0.0) + 4 * tied  # the embedding's gradient, both ways
        _add(sent, "pp", "all_reduce", _SCALAR, pp)  # the step loss, from the last stage
    if run.grad_clip is not None:  # the norm's sum of squares over the groups its gradients are split over
        _add(sent, "pp", "all_reduce", _SCALAR, pp)
        _add(sent, "tp", "all_reduce", _SCALAR, tp)
        if zero_stage:  # the ZeRO shards: over dp x cp, under HSDP the shard group (dp_shard placements)
            _add(sent, DP_KEY if replicas == 1 else SHARD_KEY, "all_reduce", _SCALAR, shard_n)
    unit_lists: list[Sequence[Sequence[Shape]]]
    if zero_stage == 3 and pp > 1:  # each stage its own wrapper (parallelize's _shard_stages)
        unit_lists = [stage_zero3_units(run.table, stage=st, num_stages=run.num_stages, blocks=run.ranges[st])
                      for st in stages]
    else:
        unit_lists = [run.units if zero_stage == 3 else [shapes]]
    zero3_kept = pp > 1 and not parallel.zero3_reshard_per_microbatch  # the stages gathered once per step
    for unit_shapes in unit_lists:
        for key, sent_bytes in data_parallel_bytes(unit_shapes, zero_stage=zero_stage, dp_cp=n,
                                                   replicas=replicas, microbatches=run.m,
                                                   gather_bytes=2 if parallel.fsdp_mixed_precision else 4,
                                                   zero3_kept=zero3_kept,
                                                   fp8=run.fp8_units if zero_stage == 3 else None).items():
            sent[key] = sent.get(key, 0.0) + sent_bytes
    _add(sent, DP_KEY, "all_reduce", _SCALAR, n)  # the loss's mean over dp x cp


def _held_and_state(run: _Run, *, c: Coordinates, stages: list[int],
                    group_rank: int) -> tuple[dict[str, int], StateMemory]:
    """The activations the rank (``c``, holding ``stages``) holds at its peak, by term, and its state at
    rest, sharded over its ZeRO group (``group_rank``: its index there)."""
    config, parallel, dims, b, seq_len = run.config, run.parallel, run.dims, run.b, run.seq_len
    tp, cp, window = dims.tp, dims.cp, 8 * run.per_rank * (seq_len + 1)
    if dims.pp > 1:
        assert run.pipe is not None and run.schedule is not None  # built for pp > 1 (_run_of)
        held = dict(run.pipe[c.pp].peak_terms)
        if tp == 1 and cp == 1 and b > 1 and run.num_stages - 1 in stages:  # labels copied per micro-batch
            held = _held_with_label_copies(config, run.pipe[c.pp], parallel, actions=run.schedule[c.pp],
                                           ranges=run.ranges, micro_batch=b, seq_len=seq_len)
        if tp == 1 and cp == 1 and any([held.pop(k, 0) for k in PER_STEP]):
            held[WINDOW] = window  # ids on the first stage, labels on the last
        state = pipeline_state_memory(config, pp=dims.pp, pp_rank=c.pp,
                                      virtual_stages=parallel.virtual_stages, balance=parallel.pp_balance,
                                      tp=tp, zero_stage=parallel.zero_stage, zero_shards=run.shard_n,
                                      dp_rank=group_rank)  # HSDP: over the rank's shard group
        return held, state
    assert run.flat is not None  # built for pp = 1 (_run_of)
    held = {k: val for k, val in run.flat.activations.items() if k not in _TRANSIENT}
    if parallel.fsdp_mixed_precision:  # ZeRO-3 in 16 bits computes in the gathered 16-bit weights: a 16-bit
        held |= sixteen_bit_weight_activations(config, checkpointed_blocks=run.checkpointed,  # residual
                                               compute_dtype=compute_dtype_of(parallel.precision),
                                               micro_batch=b, seq_len=seq_len, cp=cp,
                                               cp_method=parallel.cp_method, cp_layout=parallel.cp_layout)
    if tp == 1 and cp == 1:  # the ids and labels of every micro-batch: views of the window
        held["token ids, labels, positions"] -= 2 * 8 * run.tokens
        held[WINDOW] = window
        if b > 1:  # lm_loss's labels.flatten() copies the strided [b, s] view of the [b, s+1] rows
            held[LABELS_COPY] = 8 * run.tokens
    return held, state_memory_per_rank(config, dims, zero_stage=parallel.zero_stage, dp_rank=group_rank)
