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
from dataclasses import dataclass, field

from refimpl.config import ModelConfig, ParallelConfig, micro_batches
from refimpl.distributed.mesh import Coordinates, ParallelDims
from refimpl.measure.state import StateMemory
from refimpl.parallel.pipeline_parallel import build_schedule, stage_rank
from refimpl.parallel.pipeline_parallel.simulator import bubble_formula
from refimpl.planner.activations import BlockSplit, local_tokens
from refimpl.planner.communication import context_parallel_bytes
from refimpl.planner.fp8 import fp8_weights
from refimpl.planner.memory import run_memory_per_rank, state_memory_per_rank
from refimpl.planner.param_table import param_table
from refimpl.planner.params_flops import param_shapes
from refimpl.planner.pipeline import PER_STEP, _walk, pipeline_memory_per_rank, stage_deferred_bytes
from refimpl.planner.pipeline_stages import pipeline_state_memory, stage_layers, stage_params
from refimpl.planner.run_terms import STEP_BYTES, Rank, Run, shard_group_rank, sixteen_bit_weight_activations
from refimpl.planner.zero_state import sharded_numel
from refimpl.precision.policy import compute_dtype_of
from refimpl.support import check_modelled, check_supported

__all__ = ["RankPrediction", "RunPrediction", "predict_run"]

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
    ranks = []
    for rank in range(dims.world_size):
        r, sent = _rank_of(run, rank), dict[str, float]()
        for term in STEP_BYTES:  # each technique's declared bytes per group (refimpl.planner.run_terms)
            for key, nbytes in term(run, r).items():
                sent[key] = sent.get(key, 0.0) + nbytes
        ranks.append(RankPrediction(rank=rank, coords=r.coords, state=_state(run, r),
                                    activations=_held(run, r), bytes_sent=sent))
    pp, m, v = dims.pp, run.m, parallel.virtual_stages
    bubble = (bubble_formula(parallel.pp_schedule, pp_size=pp, num_microbatches=m, virtual_stages=v) if pp > 1
              else None)
    return RunPrediction(dims=dims, microbatches=m, micro_batch=run.b, bubble=bubble, ranks=ranks)


def _run_of(config: ModelConfig, parallel: ParallelConfig, dims: ParallelDims, *, seq_len: int,
            global_batch: int, micro_batch: int | None, grad_clip: float | None,
            checkpointed: list[int]) -> Run:
    """``predict_run``'s ``Run``: the batch split as the trainer splits it, the stages, the parameters and
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
    return Run(config=config, parallel=parallel, dims=dims, seq_len=seq_len, grad_clip=grad_clip,
               checkpointed=checkpointed, m=m, b=b, per_rank=per_rank, s_c=s_c, x=b * s_c * h,
               tokens=b * s_c, n=n, shard_n=shard_n, num_stages=num_stages, ranges=ranges, table=table,
               units=units, fp8_units=fp8_units, cp_layer=cp_layer, pipe=pipe, schedule=schedule, flat=flat)


def _rank_of(run: Run, rank: int) -> Rank:
    """Rank ``rank`` as its terms read it (``refimpl.planner.run_terms.Rank``)."""
    config, pp, tp = run.config, run.dims.pp, run.dims.tp
    c = run.dims.coordinates(rank)
    stages = [st for st in range(run.num_stages) if stage_rank(st, pp_size=pp) == c.pp]
    params = [q for st in stages for q in stage_params(config, stage=st, num_stages=run.num_stages,
                                                       blocks=run.ranges[st], tp=tp)]
    shapes = param_shapes(config, tp=tp) if pp == 1 else [q.shape for q in params]
    return Rank(coords=c, stages=stages, params=params, shapes=shapes,
                group_rank=shard_group_rank(run.dims, rank))


def _held(run: Run, r: Rank) -> dict[str, int]:
    """The activations rank ``r`` holds at its peak, by term (module docstring): the pipeline rank's held
    bytes or the one micro-batch's, the step's token window in place of the ids and labels (tp = cp = 1)."""
    config, parallel, dims, b, seq_len, c = run.config, run.parallel, run.dims, run.b, run.seq_len, r.coords
    views, window = dims.tp == 1 and dims.cp == 1, 8 * run.per_rank * (seq_len + 1)
    if dims.pp > 1:
        assert run.pipe is not None and run.schedule is not None  # built for pp > 1 (_run_of)
        held = dict(run.pipe[c.pp].peak_terms)
        if views and b > 1 and run.num_stages - 1 in r.stages:  # labels copied per micro-batch
            held = _held_with_label_copies(config, run.pipe[c.pp], parallel, actions=run.schedule[c.pp],
                                           ranges=run.ranges, micro_batch=b, seq_len=seq_len)
        if views and any([held.pop(k, 0) for k in PER_STEP]):
            held[WINDOW] = window  # ids on the first stage, labels on the last
        return held
    assert run.flat is not None  # built for pp = 1 (_run_of)
    held = {k: val for k, val in run.flat.activations.items() if k not in _TRANSIENT}
    if parallel.fsdp_mixed_precision:  # ZeRO-3 in 16 bits computes in the gathered 16-bit weights
        held |= sixteen_bit_weight_activations(config, checkpointed_blocks=run.checkpointed,
                                               compute_dtype=compute_dtype_of(parallel.precision),
                                               micro_batch=b, seq_len=seq_len, cp=dims.cp,
                                               cp_method=parallel.cp_method, cp_layout=parallel.cp_layout)
    if views:  # the ids and labels of every micro-batch: views of the window
        held["token ids, labels, positions"] -= 2 * 8 * run.tokens
        held[WINDOW] = window
        if b > 1:  # lm_loss's labels.flatten() copies the strided [b, s] view of the [b, s+1] rows
            held[LABELS_COPY] = 8 * run.tokens
    return held


def _state(run: Run, r: Rank) -> StateMemory:
    """Rank ``r``'s state where the trainer steps, sharded over its ZeRO group (HSDP: its shard group);
    ZeRO-1 holds its reduced gradient shards then too (``finish_gradients``)."""
    parallel, dims = run.parallel, run.dims
    if dims.pp > 1:
        state = pipeline_state_memory(run.config, pp=dims.pp, pp_rank=r.coords.pp, tp=dims.tp,
                                      virtual_stages=parallel.virtual_stages, balance=parallel.pp_balance,
                                      zero_stage=parallel.zero_stage, zero_shards=run.shard_n,
                                      dp_rank=r.group_rank)
    else:
        state = state_memory_per_rank(run.config, dims, zero_stage=parallel.zero_stage, dp_rank=r.group_rank)
    if parallel.zero_stage == 1:
        shard_grads = 4 * sharded_numel(r.shapes, r.group_rank, run.n)
        state = dataclasses.replace(state, grads=state.grads + shard_grads)
    return state
