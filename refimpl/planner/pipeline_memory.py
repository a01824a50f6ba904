"""The activations a pipeline rank holds over the schedule (chapter 08; Huang et al. 2019, GPipe;
Narayanan et al. 2021, 1F1B and interleaved 1F1B; Qi et al. 2023, zero bubble). The stages and what each
holds: ``refimpl.planner.pipeline_stages``.

One micro-batch of ``b`` sequences of ``s`` tokens saves ``A(s)`` bytes for backward in stage ``s``: the
blocks' terms of ``refimpl.planner.activations.activation_bytes_per_layer`` for its blocks (a
checkpointed block keeps its input), on the first stage the int64 positions ``8 s``, on the last the
final LayerNorm, the output layer's input, the float32 log-softmax ``4 s b V`` and the loss's 4-byte total
weight (``refimpl.planner.activations.outside_block_bytes`` split by stage). The token ids and the
labels are views of the step's batch: ``8 m b s`` each, once, on the first and the last stage.

The runtime (``refimpl.parallel.pipeline_parallel.run_schedule``) also keeps what it sends: every
forward's ``[b, s, h]`` float32 output, ``O = 4 s b h`` (stage ``s < S - 1``), until that micro-batch's
backward (``autograd.backward`` needs it), and a backward's input gradient, ``G = 4 s b h`` (stage
``s > 0``), until its send is waited, at the start of the rank's next action (each boundary's transfers
go out as one group, waited before the next action computes). Walking the rank's action list
(``refimpl.parallel.pipeline_parallel.build_schedule``) in order::

    F(s, i): + A(s) + O(s)        B(s, i): - A(s) - O(s) + G(s) (+ D(s))        W(s, i): - D(s)

(the ``G`` of a ``B`` gone again after the next action's start), the rank's bytes after each action;
the peak is the largest. With one stage per rank that is ``k (A + O)`` plus at most one ``G``, ``k`` the
micro-batches in flight (``refimpl.parallel.pipeline_parallel.Simulation.peak_in_flight``): GPipe
``m``, 1F1B ``min(p - r, m)`` on rank ``r``, whatever ``m``; interleaved adds its chunks' ``A``
separately, each chunk its own size. ZB-H1 (``zbh1``): between its ``B`` and its ``W`` a micro-batch holds
``D(s)``, the linear layers' inputs and output gradients that ``W`` multiplies
(``stage_deferred_bytes``), not ``A(s)``; it is in flight until its ``W`` (the simulator's rule).
Transient on top (not held between actions): the last stage's logits and their gradient,
``(p + 4) s b V`` (an estimate of the loss's peak, as in ``refimpl.planner.memory``), the received
output gradient of a backward ``4 s b h`` (stage ``s < S - 1``), and the largest checkpointed block's
recomputation.

Inside the other axes (chapter 12, as ``refimpl.parallel.parallelize`` builds it: tensor and context
parallelism first, then the split): the stages hold the tensor-parallel shards of ``t`` ranks, and every
term above is the rank's: the blocks' and the embedding's and loss's at ``s_c = s/cp`` tokens by
``cp_method`` (``refimpl.planner.activations``; under tp the vocab-parallel embedding's local ids and
mask, the loss's softmax shard ``4 s_c b V/t``, target index and masks, per micro-batch), the boundaries
``O = G = 4 (s_c/u) b h`` (``u = t`` under sequence parallelism, else 1), the logits
``(p + 4) s_c b ceil(V/t)``. The rank's model state: ``refimpl.planner.pipeline_stages.rank_state_terms``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from refimpl.config import ModelConfig, ParallelConfig
from refimpl.parallel.pipeline_parallel import SCHEDULES, build_schedule, simulate, stage_rank
from refimpl.planner.activations import (
    BlockSplit,
    activation_bytes_per_layer,
    local_tokens,
    outside_block_bytes,
)
from refimpl.planner.fp8 import fp8_extra_saved_bytes, fp8_weights
from refimpl.planner.param_table import Shape
from refimpl.planner.pipeline_stages import rank_param_shapes, rank_state_terms, stage_layers
from refimpl.planner.run_memory import RunMemory
from refimpl.planner.run_terms import final_norm_16
from refimpl.precision.policy import compute_dtype_of
from refimpl.support import check_supported, not_modelled

__all__ = ["PER_STEP", "ZBV_NOT_MODELLED", "PipelineRankMemory", "pipeline_memory_per_rank",
           "stage_deferred_bytes", "stage_saved_bytes"]

ZBV_NOT_MODELLED = not_modelled("zbv")  # refimpl/support.py

PER_STEP = ("token ids (the step's batch, int64)", "labels (the step's batch, int64)")
FP8_INPUTS = "fp8 layers' float32 LayerNorm-fed inputs"  # --precision fp8 (refimpl/planner/fp8.py)


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


def stage_saved_bytes(config: ModelConfig, *, stage: int, num_stages: int, blocks: range, micro_batch: int,
                      seq_len: int, num_microbatches: int = 1, compute_dtype: torch.dtype = torch.float32,
                      checkpointed_blocks: set[int] | list[int] | tuple[int, ...] = (),
                      deferred_weights: bool = False, residual_dtype: torch.dtype | None = None,
                      **split: Any) -> dict[str, int]:
    """What one micro-batch saves for backward in stage ``stage`` (module docstring), term by term, plus
    the ``PER_STEP`` terms (the batch's token ids on the first stage, labels on the last: ``8 m b s``
    each, held once per step). ``deferred_weights`` (zbh1's linear layers,
    ``refimpl.parallel.pipeline_parallel.defer_weight_gradients``): under autocast they keep the
    float32 LayerNorm outputs they are given (QKV and MLP inputs, the output layer's), ``4 s b h`` each
    instead of autocast's ``p s b h`` copy (measured). ``split``: ``tp``, ``sequence_parallel``, ``cp``,
    ``cp_method``, ``cp_layout`` of ``refimpl.planner.activations.activation_bytes_per_layer``: the
    blocks' terms at the rank's ``s_c = s/cp`` tokens, and under tp the first and the last stage's shares
    of ``refimpl.planner.activations.outside_block_bytes`` (the vocab-parallel embedding's int64
    local ids and bool mask, the loss's softmax shard, target index and two masks: per micro-batch, no
    view of the step's batch). ``residual_dtype`` (None: float32): the residual stream's, 16-bit where the
    model computes in 16-bit weights (ZeRO-3's mixed precision: the blocks' terms and the last stage's
    final LayerNorm and head inputs in that dtype, as
    ``refimpl.planner.run_terms.sixteen_bit_weight_activations`` counts them at pp 1)."""
    b, v, tp = micro_batch, config.vocab_size, split.get("tp", 1)
    p, chosen = compute_dtype.itemsize, set(checkpointed_blocks)
    kw = {"micro_batch": b, "seq_len": seq_len, "compute_dtype": compute_dtype, **split}
    layer_kw = kw if residual_dtype is None else {**kw, "residual_dtype": residual_dtype}
    terms = {"block activations": sum(activation_bytes_per_layer(config, checkpointed=i in chosen,
                                                                 **layer_kw).total for i in blocks)}
    s = local_tokens(config, seq_len=seq_len, cp=split.get("cp", 1), cp_method=split.get("cp_method", "ring"),
                     cp_layout=split.get("cp_layout"), tp=tp)
    if deferred_weights and p != 4 and (residual_dtype is None or residual_dtype.itemsize == 4):
        # (ZeRO-3 in 16 bits: the LayerNorms run in the gathered 16-bit weights, their outputs 16-bit)
        plain = [i for i in blocks if i not in chosen]
        widened = (2 * len(plain) + (stage == num_stages - 1)) * (4 - p) * s * b * config.hidden_size
        terms["float32 LayerNorm outputs the deferred linears keep"] = widened
    outside = outside_block_bytes(config, **kw)
    if stage == 0:
        if tp == 1:
            terms[PER_STEP[0]] = 8 * num_microbatches * b * s
        else:
            terms["vocab-parallel embedding local ids (int64) + mask (bool)"] = 8 * s * b + s * b
        if config.position_embedding == "learned":  # RoPE's positions are the blocks' cos and sin
            terms["positions (int64)"] = 8 * s
    if stage == num_stages - 1:
        final = "final layernorm + output layer inputs"
        if residual_dtype is not None and residual_dtype.itemsize != 4:  # 16-bit norm terms, head input
            outside[final] = final_norm_16(config, p, s * b)
        if tp == 1:
            terms |= {final: outside[final], "log-softmax (fp32)": 4 * s * b * v,
                      PER_STEP[1]: 8 * num_microbatches * b * s, "loss total weight": 4}
        else:
            terms |= {final: outside[final], "vocab-parallel softmax shard (fp32)": 4 * s * b * -(-v // tp),
                      "vocab-parallel loss target index (int64) + masks (bool)": 8 * s * b + 2 * s * b}
    return terms


@dataclass(frozen=True, kw_only=True)
class PipelineRankMemory:
    """One pipeline rank: its ``stages`` and their ``blocks``, its ``param_shapes``;
    ``saved`` (per stage, one micro-batch's bytes, ``stage_saved_bytes``); ``in_flight``: the
    micro-batches held at the peak, ``peak_in_flight`` the simulator's most at once; ``peak_terms``: the
    held bytes at the peak by term; ``transient``: on top, within one action; ``memory``: the rank's
    ``refimpl.planner.memory.RunMemory`` (fp32 weights, gradients, AdamW state of its parameters,
    autocast's 16-bit copies of its matmul weights; the activations at the peak and the transients)."""

    rank: int
    stages: tuple[int, ...]
    blocks: tuple[range, ...]
    param_shapes: list[Shape]
    saved: dict[int, dict[str, int]]
    in_flight: int
    peak_in_flight: int
    peak_terms: dict[str, int]
    transient: dict[str, int] = field(default_factory=dict)
    memory: RunMemory
    deferred: dict[int, int] | None = None  # zbh1: per stage, what a B leaves to its W (stage_deferred_bytes)

    @property
    def peak_held(self) -> int:
        """Bytes held at the peak between actions (saved activations and kept sends)."""
        return sum(self.peak_terms.values())


def _walk(actions, *, saved: dict[int, dict[str, int]], deferred: dict[int, int] | None, num_stages: int,
          outputs: int) -> tuple[dict[str, int], int]:
    """The held bytes by term after each action of one rank; returns those at the peak and the
    micro-batches in flight then (forwarded, not yet backwarded; with ``deferred``, the bytes a ``B``
    leaves to its ``W`` per stage: not yet ``W``-ed)."""
    per_mb = {st: sum(v for k, v in t.items() if k not in PER_STEP) for st, t in saved.items()}
    per_step = {st: {k: v for k, v in t.items() if k in PER_STEP} for st, t in saved.items()}
    forwarded = {st: 0 for st in saved}  # F done, B not yet
    waiting = {st: 0 for st in saved}  # B done, W not yet (zbh1)
    sent_out = 0
    best: tuple[int, dict[str, int], int] = (-1, {}, 0)
    for a in actions:
        if a.kind == "F":
            forwarded[a.stage] += 1
            sent_out += outputs if a.stage < num_stages - 1 else 0
        elif a.kind == "B":
            forwarded[a.stage] -= 1
            waiting[a.stage] += 1 if deferred is not None else 0
            sent_out -= outputs if a.stage < num_stages - 1 else 0  # released at its backward
        else:
            waiting[a.stage] -= 1
        sent_grad = outputs if a.kind == "B" and a.stage > 0 else 0  # until the next action's start
        held = sum(per_mb[st] * k for st, k in forwarded.items())
        terms = {"activations of the micro-batches in flight": held}
        if deferred is not None:
            held = sum(deferred[st] * k for st, k in waiting.items())
            terms["weight-gradient inputs awaiting their W"] = held
        for st, k in forwarded.items():
            for name, nbytes in per_step[st].items():
                terms[name] = nbytes if k else 0
        terms |= {"stage outputs sent (kept until their backward)": sent_out,
                  "input gradient sent (kept until the next action starts)": sent_grad}
        if sum(terms.values()) > best[0]:
            best = (sum(terms.values()), terms, sum(forwarded.values()) + sum(waiting.values()))
    return best[1], best[2]




def _transient_terms(config: ModelConfig, *, mine: list[int], ranges: list[range], boundary: int,
                     micro_batch: int, seq_len: int, tokens: int, compute: torch.dtype,
                     checkpointed_blocks: set[int] | list[int] | tuple[int, ...],
                     split: BlockSplit) -> dict[str, int]:
    """``pipeline_memory_per_rank``'s transients on top of a pipeline rank's held bytes (its stages
    ``mine``; ``tokens``: a sequence's on the rank): the output gradient received for a backward (``boundary``
    bytes, but on the last stage), the logits and their gradient (on the last stage), the saved tensors of a
    checkpointed block recomputed in backward."""
    num_stages, b, p, tp = len(ranges), micro_batch, compute.itemsize, split["tp"]
    transient = {}
    if any(st < num_stages - 1 for st in mine):  # received for a backward, alive until the next action
        transient["output gradient received for a backward (transient)"] = boundary
    if num_stages - 1 in mine:
        transient["logits + their gradient (transient)"] = (p + 4) * tokens * b * -(-config.vocab_size // tp)
    chosen = [i for st in mine for i in ranges[st] if i in set(checkpointed_blocks)]
    if chosen:
        full = activation_bytes_per_layer(config, micro_batch=b, seq_len=seq_len, compute_dtype=compute,
                                          **split)
        transient["recomputed block (backward, transient)"] = full.total
    return transient




def pipeline_memory_per_rank(config: ModelConfig, *, pp: int, num_microbatches: int, schedule: str = "1f1b",
                             virtual_stages: int = 1, micro_batch: int, seq_len: int, precision: str = "fp32",
                             checkpointed_blocks: set[int] | list[int] | tuple[int, ...] = (),
                             balance: str = "layers", tp: int = 1, sequence_parallel: bool = False,
                             cp: int = 1, cp_method: str = "ring", cp_layout: str | None = None,
                             zero_stage: int = 0, zero_shards: int = 1, dp_rank: int = 0,
                             zero3_reshard_per_microbatch: bool = False,
                             residual_dtype: torch.dtype | None = None) -> list[PipelineRankMemory]:
    """Every pipeline rank of ``pp`` ranks, in rank order, running ``schedule`` over ``num_microbatches``
    micro-batches of ``micro_batch`` sequences of ``seq_len`` tokens (module docstring). ``precision``
    ``fp32``, or ``bf16``, ``fp16``, ``fp8`` under autocast; ``checkpointed_blocks``: global block indices;
    ``tp``, ``sequence_parallel``, ``cp``, ``cp_method``, ``cp_layout``: the split inside the stages
    (chapter 12, as ``refimpl.parallel.parallelize`` builds it); ZeRO ``zero_stage`` over ``zero_shards``
    ranks as group rank ``dp_rank`` holds it, with ZeRO-3's tensors gathered for the step or per
    micro-batch (``zero3_reshard_per_microbatch``): ``refimpl.planner.pipeline_stages.rank_state_terms``;
    ``residual_dtype``: as ``stage_saved_bytes`` (ZeRO-3 in 16 bits computes in 16-bit weights)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
    if schedule == "zbv":
        raise ValueError(ZBV_NOT_MODELLED)
    compute = compute_dtype_of(precision)  # fp8: bf16 autocast around the fp8 GEMMs; unknown: ValueError
    check_supported(ParallelConfig(pp=pp, tp=tp, zero_stage=zero_stage, pp_schedule=schedule,
                                   sequence_parallel=sequence_parallel,
                                   zero3_reshard_per_microbatch=zero3_reshard_per_microbatch))
    m, v = num_microbatches, virtual_stages
    table = build_schedule(schedule, pp_size=pp, num_microbatches=m, virtual_stages=v)
    sim = simulate(table, num_microbatches=m, virtual_stages=v)  # refuses an invalid or deadlocking table
    num_stages, zbh1 = pp * v, schedule == "zbh1"
    ranges = stage_layers(config, num_stages=num_stages, balance=balance, tp=tp)
    sp = BlockSplit(tp=tp, sequence_parallel=sequence_parallel, cp=cp, cp_method=cp_method,
                    cp_layout=cp_layout)
    b, h = micro_batch, config.hidden_size
    s = local_tokens(config, seq_len=seq_len, cp=cp, cp_method=cp_method, cp_layout=cp_layout, tp=tp)
    boundary = 4 * (s // (tp if sequence_parallel else 1)) * b * h  # float32 [b, s_c/u, h]
    fp8_names = {q.name for q in fp8_weights(config, tp=tp)} if precision == "fp8" else set()
    fp8_extra = (fp8_extra_saved_bytes(config, micro_batch=b, tokens=s, tp=tp,
                                       sequence_parallel=sequence_parallel)
                 if precision == "fp8" else None)  # per block
    out = []
    for r in range(pp):
        mine = [st for st in range(num_stages) if stage_rank(st, pp_size=pp) == r]
        shapes = rank_param_shapes(config, pp=pp, rank=r, ranges=ranges, tp=tp)
        saved = {st: stage_saved_bytes(config, stage=st, num_stages=num_stages, blocks=ranges[st],
                                       micro_batch=b, seq_len=seq_len, num_microbatches=m,
                                       compute_dtype=compute, checkpointed_blocks=checkpointed_blocks,
                                       deferred_weights=zbh1, residual_dtype=residual_dtype, **sp)
                 for st in mine}
        if fp8_extra is not None and not zbh1:  # fp8: the LayerNorm-fed fp8 layers keep their float32
            for st in mine:  # inputs (under zbh1 every deferred linear does already: stage_saved_bytes)
                extra = sum(fp8_extra[i] for i in ranges[st] if i not in set(checkpointed_blocks))
                if extra:
                    saved[st][FP8_INPUTS] = extra
        deferred = None if not zbh1 else {
            st: stage_deferred_bytes(config, stage=st, num_stages=num_stages, blocks=ranges[st],
                                     micro_batch=b, seq_len=s, compute_dtype=compute,
                                     fp8_layers=fp8_names, tp=tp) for st in mine}
        terms, flying = _walk(table[r], saved=saved, deferred=deferred, num_stages=num_stages,
                              outputs=boundary)
        transient = _transient_terms(config, mine=mine, ranges=ranges, boundary=boundary, micro_batch=b,
                                     seq_len=seq_len, tokens=s, compute=compute,
                                     checkpointed_blocks=checkpointed_blocks, split=sp)
        state = rank_state_terms(config, mine=mine, ranges=ranges, shapes=shapes, tp=tp, precision=precision,
                                 zero_stage=zero_stage, zero_shards=zero_shards, dp_rank=dp_rank,
                                 zero3_reshard_per_microbatch=zero3_reshard_per_microbatch)
        out.append(PipelineRankMemory(rank=r, stages=tuple(mine), blocks=tuple(ranges[st] for st in mine),
                                      param_shapes=shapes, saved=saved, in_flight=flying,
                                      peak_in_flight=sim.peak_in_flight[r], peak_terms=terms,
                                      transient=transient, deferred=deferred,
                                      memory=RunMemory(state=state, activations={**terms, **transient},
                                                       rank=r)))
    return out
