"""One trainer run at a layout, predicted per rank before it runs: ``predict_run`` (chapter 12).

The composition of the planner's terms for ``python -m refimpl.train --dp D --tp T --pp P --cp C ...``
(the mesh ``pp x dp x cp x tp``, ``refimpl.distributed.mesh``; Narayanan et al. 2021, "Efficient
large-scale language model training on GPU clusters using Megatron-LM", section 3), per rank:

* **state** (``refimpl.measure.state.StateMemory``), where the trainer steps: fp32 weights, gradients and
  AdamW state of the rank's tensor-parallel shards of its stages, sharded by ZeRO stage (Rajbhandari et
  al. 2020; 1: the AdamW state, 2: and the gradients, 3: and the weights) over ``dp x cp`` (HSDP: the
  rank's shard group, ``refimpl.planner.run_terms.shard_group_rank``); ZeRO-1 holds its reduced gradient
  shards then too; ZeRO-3 its shards only (a unit's gathered tensors are freed before the step; the
  gathered units the memory preflight adds, ``refimpl.planner.memory.run_memory_per_rank``, are not
  predicted here);
* **activations**: the bytes saved for backward the rank holds at its peak (Korthikanti et al. 2022): one
  micro-batch's (``run_memory_per_rank``), or the schedule's under pp
  (``refimpl.planner.pipeline_memory.PipelineRankMemory``: micro-batches in flight, sends kept). Without tp
  and cp the ids and labels are views of the step's window ``[B/dp, s+1]``, held once, ``8 (B/dp) (s+1)``
  bytes; at ``b > 1`` ``lm_loss``'s ``labels.flatten()`` copies the strided labels, ``8 b s`` (under pp
  per micro-batch in flight on the last stage: ``_held_with_label_copies``). ZeRO-3 saves gathered
  weights, not activations; in 16 bits it computes in 16-bit weights, a 16-bit residual stream
  (``refimpl.planner.run_terms.sixteen_bit_weight_activations``);
* **bytes sent per step** by ``metrics.jsonl`` group key (``"tp"``, ``"cp"``, ``"pp"``, ``"dp x cp"``,
  under HSDP ``"dp_shard x cp"`` and ``"dp_replicate"``; collectives by the ring model,
  ``refimpl.comm.tracer.wire_bytes``, sends by their tensors' bytes): the sum of the terms each technique
  declares, ``refimpl.planner.step_bytes.STEP_BYTES`` (tensor, context and pipeline parallelism, the
  gradient norm, data parallelism and ZeRO), each derived in its docstring;
* **bubble**: the schedule's textbook idle share
  (``refimpl.parallel.pipeline_parallel.simulator.bubble_formula``), None without pipeline parallelism.

What it does not model is refused in the words of ``refimpl.support.NOT_MODELLED_TABLE``. Proven to the
byte against the trainer: tests/planner/ranks/test_planner_3d.py (8 ranks: 1F1B, GPipe, interleaved and ZB-H1
with tp, cp, sequence parallelism, ZeRO 0-3, HSDP and checkpointing),
tests/planner/ranks/test_planner_zero3.py (4 ranks: ZeRO-2/3, HSDP, bf16 ZeRO-3, ZeRO-3 under every schedule,
gathered per step or per micro-batch), tests/trainer/ranks/cli/test_train_fp8.py (fp8) and
tests/trainer/ranks/lane2/test_train_pairs.py (every pair of techniques).
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
from refimpl.planner.memory import run_memory_per_rank
from refimpl.planner.param_table import param_table
from refimpl.planner.params_flops import param_shapes
from refimpl.planner.pipeline_memory import PER_STEP, _walk, pipeline_memory_per_rank
from refimpl.planner.pipeline_stages import stage_layers, stage_params
from refimpl.planner.run_terms import shard_group_rank, sixteen_bit_weight_activations
from refimpl.planner.step_bytes import STEP_BYTES, Rank, Run
from refimpl.planner.zero_state import sharded_numel, zero_memory
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


def _held_with_label_copies(run: Run, pp_rank: int) -> dict[str, int]:
    """The held bytes at the peak of pipeline rank ``pp_rank``, which holds the last stage, where the labels
    are not held as a view of the step's window: at ``b > 1`` (tp = cp = 1) a micro-batch's labels, rows
    ``[b, s]`` of the window ``[B/dp, s+1]``, are strided, and ``lm_loss``'s ``labels.flatten()`` saves a
    copy, ``8 b s`` per micro-batch in flight, in place of the planner's per-step labels term (measured,
    both 1F1B and GPipe: tests/planner/ranks/test_planner_zero3.py). The rank's actions walked again
    (``refimpl.planner.pipeline_memory._walk``) with that term moved into the last stage's micro-batch
    bytes."""
    assert run.pipe is not None and run.schedule is not None  # built for pp > 1 (_run_of)
    last, b, s, memory = run.num_stages - 1, run.b, run.seq_len, run.pipe[pp_rank]
    saved = {st: dict(terms) for st, terms in memory.saved.items()}
    del saved[last][PER_STEP[1]]
    saved[last][LABELS_COPY] = 8 * b * s
    terms, _ = _walk(run.schedule[pp_rank], saved=saved, deferred=memory.deferred, num_stages=last + 1,
                     outputs=4 * b * s * run.config.hidden_size)  # float32 [b, s, h] at each boundary
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
    ``grad_clip`` None: no norm. A combination the trainer refuses (``refimpl.support.check_supported``)
    or the planner does not model (``refimpl.support.NOT_MODELLED_TABLE``) raises a
    ``refimpl.config.ConfigError`` in its rows' words.
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
        for term in STEP_BYTES:  # each technique's declared bytes per group (step_bytes.py)
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
    """Rank ``rank`` as its terms read it (``refimpl.planner.step_bytes.Rank``)."""
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
        assert run.pipe is not None  # built for pp > 1 (_run_of)
        held = dict(run.pipe[c.pp].peak_terms)
        if views and b > 1 and run.num_stages - 1 in r.stages:  # labels copied per micro-batch
            held = _held_with_label_copies(run, c.pp)
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
    """Rank ``r``'s state where the trainer steps: its parameters (under pp its stages') sharded over its
    ZeRO group (HSDP: its shard group), as ``state_memory_per_rank`` and ``pipeline_state_memory`` count
    them; ZeRO-1 holds its reduced gradient shards then too (``finish_gradients``)."""
    state = zero_memory(r.shapes, run.shard_n, run.parallel.zero_stage, rank=r.group_rank)
    if run.parallel.zero_stage == 1:
        shard_grads = 4 * sharded_numel(r.shapes, r.group_rank, run.n)
        state = dataclasses.replace(state, grads=state.grads + shard_grads)
    return state
