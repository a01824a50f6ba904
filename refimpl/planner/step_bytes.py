"""Each technique's bytes per process group per step, declared as one term per technique and added up by
``refimpl.planner.run_prediction.predict_run`` (chapter 12).

A term is a function of the run (``Run``, computed once) and one rank (``Rank``) returning wire bytes by
``metrics.jsonl`` group key (``"tp"``, ``"cp"``, ``"pp"``, ``"dp x cp"``; under HSDP ``"dp_shard x cp"`` and
``"dp_replicate"``): collectives by the ring model (``refimpl.comm.tracer.wire_bytes``), sends by their
tensors' bytes. ``STEP_BYTES`` lists them: tensor parallelism (chapter 06), context parallelism (07),
pipeline parallelism (08), the gradient norm (04) and data parallelism with ZeRO (03-05); each docstring
gives its formula, the formulas themselves are ``refimpl.planner.run_terms``'. A technique that moves
bytes adds its term here; the byte-exact tests (tests/planner/ranks/test_planner_3d.py,
tests/planner/ranks/test_planner_zero3.py, tests/trainer/ranks/lane2/test_train_pairs.py) check the sum
against the trainer's ``metrics.jsonl``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from refimpl.config import ModelConfig, ParallelConfig
from refimpl.distributed.mesh import Coordinates, ParallelDims
from refimpl.parallel.pipeline_parallel import Action, stage_rank
from refimpl.planner.communication import shared_qkv_elements
from refimpl.planner.param_table import ParamSpec, ParamTable
from refimpl.planner.run_memory import RunMemory
from refimpl.planner.run_terms import (
    DP_KEY,
    SHARD_KEY,
    add_wire_bytes,
    data_parallel_bytes,
    recompute_tp_payloads,
    sp_gradient_payload,
    stage_zero3_units,
    tp_stage_payloads,
)
from refimpl.planner.zero_state import Shape, sharded_numel

if TYPE_CHECKING:
    from refimpl.planner.pipeline_memory import PipelineRankMemory

__all__ = ["STEP_BYTES", "Rank", "Run", "context_parallel_step_bytes", "data_parallel_step_bytes",
           "gradient_norm_bytes", "pipeline_step_bytes", "tensor_parallel_step_bytes"]

_SCALAR = 4  # a float32 scalar: the loss, the gradient norm's sum of squares


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
            add_wire_bytes(out, "tp", op, run.m * nbytes, tp)
    if sp:  # the LayerNorms' and row biases' gradients, after the data-parallel reduction
        replicated = [q.shape for q in r.params if q.sequence_parallel_gradient]
        sp_grads = sp_gradient_payload(replicated, zero_stage=run.parallel.zero_stage, n=run.shard_n,
                                       group_rank=r.group_rank)
        add_wire_bytes(out, "tp", "all_reduce", sp_grads, tp)
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
    add_wire_bytes(out, "pp", "all_reduce", _SCALAR, pp)
    return out


def gradient_norm_bytes(run: Run, r: Rank) -> dict[str, float]:
    """Clipping (chapter 04): the norm's float32 sum of squares all-reduced over each group the gradients
    are split over: ``pp``, ``tp`` and under ZeRO 1-3 the shard group (``dp x cp``; under HSDP
    ``dp_shard x cp``: the replicas hold the same shard). Nothing without clipping."""
    out: dict[str, float] = {}
    if run.grad_clip is not None:
        add_wire_bytes(out, "pp", "all_reduce", _SCALAR, run.dims.pp)
        add_wire_bytes(out, "tp", "all_reduce", _SCALAR, run.dims.tp)
        if run.parallel.zero_stage:
            key = DP_KEY if run.dims.dp_replicate == 1 else SHARD_KEY
            add_wire_bytes(out, key, "all_reduce", _SCALAR, run.shard_n)
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
    add_wire_bytes(out, DP_KEY, "all_reduce", _SCALAR, run.n)
    return out


STEP_BYTES: tuple[Callable[[Run, Rank], dict[str, float]], ...] = (
    tensor_parallel_step_bytes, context_parallel_step_bytes, pipeline_step_bytes, gradient_norm_bytes,
    data_parallel_step_bytes)
"""Each technique's bytes sent per step by ``metrics.jsonl`` group key, as one rank reads them: the terms
``predict_run`` adds up."""
