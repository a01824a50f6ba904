"""The support table: every combination of techniques refimpl refuses, written once, with its reason.

The trainer's options (``refimpl.train.RunOptions``), ``refimpl.parallel.parallelize`` and the
planner (``refimpl.planner.run_memory_per_rank``, the pipeline's memory model) all ask
``check_supported``, so a combination is refused in the same words before a process starts, before a
model is touched and before a plan is made; ``python -m refimpl.train --list-layouts`` prints the table.
A row leaves the table when the combination is built (docs/ARCHITECTURE.md: how a new technique plugs in).

Each row is a predicate over a ``refimpl.config.ParallelConfig`` and the reason a learner needs:
what the combination would do wrong, and what to use instead. tests/unit/test_support.py holds, per row, a
configuration it refuses and the nearest one it lets through.

Mixture-of-experts models and expert parallelism (chapter 09) have their own rows,
``MOE_SUPPORT_TABLE``: each applies to a layout with ``ep > 1`` (expert parallelism implies MoE
blocks), or to any layout when the caller says the model has MoE blocks (``check_supported(config,
moe=True)``: the trainer and ``refimpl.parallel.parallelize``, which know the model); their cases
are tests/ranks/test_moe_model.py's.

What the trainer runs and the planner's exact terms do not predict is ``NOT_MODELLED_TABLE``, read
the same way: ``refimpl.planner.predict_run`` and ``refimpl.planner.run_memory_of`` raise its sentences
(``check_modelled``), ``--list-layouts`` prints it after the refusals. A row leaves it when the planner's
terms are measured against the trainer for that combination.

What a layout needs of the model and the sequence (tensor parallelism splits the heads, the MLP width and
the vocabulary; sequence parallelism and context parallelism split the sequence) is
``shape_refusals``, the one rule set: the trainer's preflight raises its sentences
(``refimpl.train.layout.check_shapes``) and the planner's search asks it with the table
(``python -m refimpl.plan`` ranks no layout the trainer would refuse; tests/planner/cli/test_plan_cli.py runs
its top layouts through the trainer's validation).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from refimpl.config import ConfigError, ModelConfig, ParallelConfig

__all__ = ["MOE_NOT_MODELLED", "MOE_SUPPORT_TABLE", "NOT_MODELLED_TABLE", "SUPPORT_TABLE", "NotModelled",
           "Unsupported", "check_modelled", "check_supported", "describe_support_table", "not_modelled",
           "refusals", "shape_refusals"]


@dataclass(frozen=True, kw_only=True)
class Unsupported:
    """One refused combination: ``name`` (a short id), ``when`` (the combination, in words), ``reason``
    (why, and what to use instead) and ``applies`` (the predicate)."""

    name: str
    when: str
    reason: str
    applies: Callable[[ParallelConfig], bool]
    experts: bool = False  # a row of MoE models: applies when the model has MoE blocks (or ep > 1)

    def message(self) -> str:
        return f"{self.when}: {self.reason}"


SUPPORT_TABLE: tuple[Unsupported, ...] = (
    Unsupported(
        name="sp-without-tp", when="sequence parallelism with tp = 1",
        reason="it splits the activations between the tensor-parallel regions over the tensor-parallel "
               "ranks: it needs tp > 1",
        applies=lambda c: c.sequence_parallel and c.tp == 1),
    Unsupported(
        name="tp-comm-overlap-without-sp", when="--tp-comm-overlap without sequence parallelism over tp > 1",
        reason="the collective matmul splits the sequence-parallel all-gather and reduce-scatter of the "
               "tensor-parallel linears into ring steps along the sequence: it needs --sequence-parallel "
               "and tp > 1 (without sequence parallelism the linears all-reduce, which it does not split)",
        applies=lambda c: c.tp_comm_overlap and not (c.sequence_parallel and c.tp > 1)),
    Unsupported(
        name="tp-comm-overlap-fp8", when="--tp-comm-overlap with --precision fp8",
        reason="the ring multiplies each sequence chunk with its own plain matmul, not through the linear "
               "seam the fp8 GEMMs plug into: not built; use bf16 with --tp-comm-overlap, or fp8 without it",
        applies=lambda c: c.tp_comm_overlap and c.precision == "fp8"),
    Unsupported(
        name="tp-comm-overlap-zero-bubble", when="--tp-comm-overlap with a zero-bubble schedule (zbh1, zbv)",
        reason="a zero-bubble schedule defers each linear's weight gradient to its W action, and the ring "
               "computes it inside backward, chunk by chunk along the all-gather: not built; use 1f1b or "
               "interleaved with --tp-comm-overlap, or the zero-bubble schedule without it",
        applies=lambda c: c.tp_comm_overlap and c.pp > 1 and c.pp_schedule in ("zbh1", "zbv")),
    Unsupported(
        name="zero3-reshard-zbh1", when="--zero3-reshard-per-microbatch with the zbh1 schedule (or zbv)",
        reason="resharding per micro-batch reduce-scatters a unit's gradients and frees its gathered weights "
               "when the unit's backward ends, and zbh1 adds the weight gradients later, in its W actions; "
               "use ZeRO-3's default under pp (each stage gathered once and reduced once per step, after the "
               "last W), or 1f1b",
        applies=lambda c: (c.zero_stage == 3 and c.pp > 1 and c.pp_schedule in ("zbh1", "zbv")
                           and c.zero3_reshard_per_microbatch)),
    Unsupported(
        name="zero3-reshard-without-zero3-pp",
        when="--zero3-reshard-per-microbatch without ZeRO-3 and pp > 1",
        reason="it sets how ZeRO-3 gathers a pipeline stage's weights per micro-batch: it needs both",
        applies=lambda c: c.zero3_reshard_per_microbatch and not (c.zero_stage == 3 and c.pp > 1)),
    Unsupported(
        name="hsdp-without-zero3", when="HSDP (dp_replicate > 1) without ZeRO-3",
        reason="hybrid sharding shards the parameters over a shard group and replicates them across the "
               "groups: it is ZeRO-3's (FSDP2's HSDP); use --zero-stage 3",
        applies=lambda c: c.dp_replicate > 1 and c.zero_stage != 3),
    Unsupported(
        name="fp8-scaling-without-fp8", when="--fp8-scaling rowwise without --precision fp8",
        reason="it chooses the scales of the fp8 linears: it needs --precision fp8",
        applies=lambda c: c.fp8_scaling != "tensorwise" and c.precision != "fp8"),
    Unsupported(
        name="fp8-zero3-rowwise", when="--fp8-scaling rowwise with ZeRO-3",
        reason="ZeRO-3 gathers the fp8 linears' weights in fp8 with one scale per tensor (torchao's fp8 "
               "all-gather is tensorwise only too); a rowwise layer casts its weight per row for the output "
               "GEMM and per column for the input gradient, two copies no one gathered copy serves, and "
               "gathering bf16 instead would round its weights twice (bf16, then fp8) where ZeRO 0-2 round "
               "once; use --fp8-scaling tensorwise with ZeRO-3, or ZeRO 0-2 with rowwise",
        applies=lambda c: c.precision == "fp8" and c.zero_stage == 3 and c.fp8_scaling == "rowwise"),
    Unsupported(
        name="pipeline-options-without-pp", when="micro-batches or virtual stages with pp = 1",
        reason="they set the pipeline: they need pp > 1",
        applies=lambda c: c.pp == 1 and (c.microbatches is not None or c.virtual_stages != 1)),
    Unsupported(
        name="virtual-stages-without-interleaving",
        when="virtual stages > 1 without the interleaved schedule",
        reason="only interleaved 1F1B and ZB-V run several model chunks per rank; use --pp-schedule "
               "interleaved",
        applies=lambda c: c.virtual_stages > 1 and c.pp_schedule not in ("interleaved", "zbv")),
    Unsupported(
        name="zbv-two-chunks", when="the zbv schedule without --virtual-stages 2",
        reason="ZB-V runs exactly two model chunks per rank, placed in a V (rank r holds stages r and "
               "2 pp - 1 - r); pass --virtual-stages 2",
        applies=lambda c: c.pp > 1 and c.pp_schedule == "zbv" and c.virtual_stages != 2),
    Unsupported(
        name="zbv-fp8", when="the zbv schedule with --precision fp8",
        reason="fp8's deferred weight gradients are measured against one device under zbh1 only (its W "
               "actions read the fp8 casts kept since B); use --pp-schedule zbh1 with fp8",
        applies=lambda c: c.pp > 1 and c.pp_schedule == "zbv" and c.precision == "fp8"),
)


MOE_SUPPORT_TABLE: tuple[Unsupported, ...] = (
    Unsupported(
        name="moe-hsdp", when="MoE blocks or expert parallelism with HSDP (dp_replicate > 1)", experts=True,
        reason="HSDP shards over a shard group and all-reduces the shards across the replicas, and the "
               "experts would need a shard group and replicas of their own inside the expert-data-parallel "
               "ranks: not built; use ZeRO-3 over dp x cp (the experts sharded over edp) or ZeRO 0-2",
        applies=lambda c: c.dp_replicate > 1),
)
"""The rows of mixture-of-experts models (module docstring)."""


@dataclass(frozen=True, kw_only=True)
class NotModelled:
    """One combination the trainer runs and the planner does not predict: ``name`` (a short id), ``reason``
    (the sentence the planner raises: what it models instead), ``applies`` (the predicate over the model
    and the layout); ``memory``: the memory model (``refimpl.planner.run_memory_of``) refuses it too, not
    ``refimpl.planner.predict_run`` only."""

    name: str
    reason: str
    applies: Callable[[ModelConfig, ParallelConfig], bool]
    memory: bool = False


MOE_NOT_MODELLED: tuple[tuple[str, Callable[[ModelConfig, ParallelConfig], bool]], ...] = (
    ("pp > 1", lambda m, c: c.pp > 1), ("cp > 1", lambda m, c: c.cp > 1),
    ("sequence parallelism", lambda m, c: c.sequence_parallel), ("fp8", lambda m, c: c.precision == "fp8"),
    ("shared experts", lambda m, c: m.moe_shared_experts > 0))
"""What of an MoE layout the planner's terms do not count (``NOT_MODELLED_TABLE``'s ``moe-layout``; the
trainer runs each): the stage split, the sequence's parts and the tp ranks' own tokens, fp8's converted
layers, DeepSeekMoE's shared experts' saved tensors (``refimpl.planner.experts.unmodelled_moe``)."""

NOT_MODELLED_TABLE: tuple[NotModelled, ...] = (
    NotModelled(
        name="moe-bytes", applies=lambda m, c: bool(m.num_experts) or c.ep > 1,
        reason="the planner does not model an MoE run's bytes per process group yet (the expert gradients on "
               "edp, the all-to-alls on ep); run_memory_of plans its memory, "
               "refimpl.planner.experts.all_to_all_bytes its all-to-alls"),
    NotModelled(
        name="moe-layout",
        applies=lambda m, c: bool(m.num_experts) and any(on(m, c) for _, on in MOE_NOT_MODELLED),
        reason="the planner models MoE blocks at pp = 1 without cp, sequence parallelism, fp8 or shared "
               "experts"),
    NotModelled(
        name="mla", memory=True, applies=lambda m, c: m.attention_type == "mla",
        reason="the planner's exact terms do not model multi-head latent attention yet (python -m "
               "refimpl.plan estimates its layouts)"),
    NotModelled(
        name="fp16", applies=lambda m, c: c.precision not in ("fp32", "bf16", "fp8"),
        reason="predict_run models fp32, bf16 and fp8 (fp16 is not measured against it)"),
    NotModelled(
        name="zbv", applies=lambda m, c: c.pp > 1 and c.pp_schedule == "zbv",
        reason="the planner does not model the zbv schedule (ZB-V's V placement: two chunks per rank, the "
               "first and the last stage on rank 0, its deferred weight gradients in flight): plan with "
               "zbh1, whose memory the planner models, or measure zbv with the trainer"),
    NotModelled(
        name="fp8-zbh1-rowwise",
        applies=lambda m, c: (c.precision == "fp8" and c.pp > 1 and c.pp_schedule == "zbh1"
                              and c.fp8_scaling == "rowwise"),
        reason="predict_run models zbh1's deferred fp8 weight gradients with tensorwise scaling (rowwise "
               "keeps per-row scales: not measured)"),
    NotModelled(
        name="fp8-pp-zero3", applies=lambda m, c: c.precision == "fp8" and c.pp > 1 and c.zero_stage == 3,
        reason="predict_run models --precision fp8 with ZeRO 0-3 at pp = 1 and ZeRO 0-2 under pp (what "
               "tests/trainer/ranks/cli/test_train_fp8.py measures; the stages' fp8 gathers are not "
               "measured against it)"),
    NotModelled(
        name="tp-16-bit", applies=lambda m, c: c.tp > 1 and c.precision != "fp32",
        reason="predict_run models the tensor-parallel traffic in fp32 only (under autocast the activations "
               "it moves are 16-bit)"),
    NotModelled(
        name="pp-checkpointing-16-bit",
        applies=lambda m, c: c.pp > 1 and c.precision != "fp32" and bool(c.checkpointed_blocks(m.num_layers)),
        reason="predict_run models activation checkpointing under pp in fp32 (measured); in 16 bits it is "
               "not measured"),
    NotModelled(
        name="zbh1-sp", applies=lambda m, c: c.pp > 1 and c.pp_schedule == "zbh1" and c.sequence_parallel,
        reason="predict_run models zbh1 without sequence parallelism (the deferred column layers' gathered "
               "inputs under SP are not measured)"),
    NotModelled(
        name="tp-comm-overlap", applies=lambda m, c: c.tp_comm_overlap,
        reason="predict_run models the sequence-parallel linears' all-gathers and reduce-scatters; "
               "--tp-comm-overlap's rings (the same bytes as point-to-point steps, other transient buffers) "
               "are not measured against it"),
    NotModelled(
        name="zero3-no-reshard", applies=lambda m, c: c.zero_stage == 3 and not c.reshard_after_forward,
        reason="predict_run models ZeRO-3 with reshard_after_forward (the trainer's setting): without it no "
               "unit is gathered again for backward"),
)
"""The rows the planner does not model (module docstring)."""


def not_modelled(name: str) -> str:
    """The reason of ``NOT_MODELLED_TABLE``'s row ``name``."""
    return next(row.reason for row in NOT_MODELLED_TABLE if row.name == name)


def check_modelled(model: ModelConfig, config: ParallelConfig, *, what: str = "predict_run",
                   memory: bool = False) -> None:
    """Raise ``refimpl.config.ConfigError`` (``what: `` and the reasons of the rows of
    ``NOT_MODELLED_TABLE`` that apply, joined by ``; and ``), or return. ``memory``: the memory model's
    rows only."""
    rows = [row for row in NOT_MODELLED_TABLE if (row.memory or not memory) and row.applies(model, config)]
    if rows:
        raise ConfigError(f"{what}: " + "; and ".join(row.reason for row in rows))


def refusals(config: ParallelConfig, *, moe: bool = False) -> list[Unsupported]:
    """The rows of ``SUPPORT_TABLE``, then ``MOE_SUPPORT_TABLE``, that refuse ``config``, in the
    tables' order; an MoE row only when ``moe`` (the model has MoE blocks) or ``config.ep > 1``."""
    experts = moe or config.ep > 1
    return [row for row in (*SUPPORT_TABLE, *MOE_SUPPORT_TABLE)
            if (experts or not row.experts) and row.applies(config)]


def check_supported(config: ParallelConfig, *, moe: bool = False) -> None:
    """Raise ``refimpl.config.ConfigError`` with the first refusing row's message (the others after
    it), or return: everything in ``config`` composes. ``moe``: the model has MoE blocks."""
    rows = refusals(config, moe=moe)
    if rows:
        raise ConfigError("; and ".join(row.message() for row in rows))


def shape_refusals(model: ModelConfig, config: ParallelConfig, *, seq_len: int) -> list[str]:
    """What the degrees of ``config`` need of ``model`` and of sequences of ``seq_len`` tokens and do not
    get, one sentence each naming the trainer's flags (none: the shapes split). Tensor parallelism gives
    each of its ``tp`` ranks ``1/tp`` of the heads, of the MLP width and of the vocabulary (chapter 06),
    sequence parallelism ``1/tp`` of the tokens; ring attention cuts a sequence into ``2 cp`` chunks,
    Ulysses into ``cp`` and gives each context-parallel rank whole heads of its tensor-parallel rank's
    (chapter 07). Multi-head latent attention (the DeepSeek-V3 form, ``refimpl.models.mla``) is built for
    neither. The trainer's preflight (``refimpl.train.layout.check_shapes``) raises these
    sentences, the planner's search skips the layouts they refuse: one rule set."""
    tp, cp, s, heads = config.tp, config.cp, seq_len, model.num_attention_heads
    out = []
    if model.attention_type == "mla" and tp > 1:
        out.append(f"--tp {tp}: multi-head latent attention under tensor parallelism is not built (its up "
                   "projections would split by heads, its latent and shared rotated key be replicated): "
                   "DeepSeek-V3 trains it at tp 1 with ep and pp; use --ep/--pp/--dp")
    if model.attention_type == "mla" and cp > 1:
        out.append(f"--cp {cp}: multi-head latent attention under context parallelism is not built (ring "
                   "attention and Ulysses replace the course's multi-head attention only): use "
                   "--ep/--pp/--dp, or --arch llama for --cp")
    if tp > 1:
        out += [f"--tp {tp} does not divide the {size} {what} (each tensor-parallel rank holds 1/{tp} of "
                f"them); change {flag} or --tp"
                for what, size, flag in (("attention heads", heads, "--num-heads"),
                                         ("MLP width", model.ffn_size, "--hidden-size"),
                                         ("vocabulary entries", model.vocab_size, "the vocabulary"))
                if size % tp]
        kv = model.query_groups
        if kv != heads and kv % tp and tp % kv:  # (multi-head: the heads rule says it)
            out.append(f"--tp {tp} and the {kv} key/value heads (--num-kv-heads): one must divide the "
                       "other (each tensor-parallel rank holds whole query groups, or tp/kv ranks share "
                       "one key/value head); change --num-kv-heads or --tp")
        if config.sequence_parallel and s % tp:
            out.append(f"--sequence-parallel splits the sequence over the {tp} tensor-parallel ranks: "
                       f"--seq-len {s} does not divide by {tp}")
    if cp > 1:
        parts = 2 * cp if config.cp_method == "ring" else cp
        if s % parts:
            out.append(f"--cp {cp} --cp-method {config.cp_method} cuts each sequence into {parts} equal "
                       f"parts: --seq-len {s} does not divide by {parts}")
        if config.cp_method == "ulysses" and (heads // tp) % cp:
            out.append(f"--cp-method ulysses gives each of the {cp} context-parallel ranks whole heads: the "
                       f"heads per tensor-parallel rank ({heads} / --tp {tp} = {heads // tp}) do not "
                       f"divide by {cp}; use --cp-method ring or change --num-heads")
        kv = model.query_groups
        held = max(kv // tp, 1)  # tp/kv ranks share one key/value head when kv < tp
        if config.cp_method == "ulysses" and kv != heads and held % cp:
            out.append(f"--cp-method ulysses gives each of the {cp} context-parallel ranks whole key/value "
                       f"heads too: the key/value heads per tensor-parallel rank ({kv} / --tp {tp}: "
                       f"{held}) do not divide by {cp}; use --cp-method ring or change --num-kv-heads")
        if config.sequence_parallel and (s // cp) % tp:
            out.append(f"--sequence-parallel splits each context-parallel rank's {s // cp} tokens (--seq-len "
                       f"{s} / --cp {cp}) over the {tp} tensor-parallel ranks: they do not divide by {tp}")
    return out


def describe_support_table() -> str:
    """The tables as text, one combination per line (``--list-layouts``): the refused, then the not
    modelled."""
    refused = [(r.name, r.message()) for r in (*SUPPORT_TABLE, *MOE_SUPPORT_TABLE)]
    unmodelled = [(r.name, r.reason) for r in NOT_MODELLED_TABLE]
    lines = []
    for title, rows in (("Combinations refused by the trainer, parallelize and the planner alike "
                         "(refimpl/support.py):", refused),
                        ("Combinations the trainer runs and the planner does not predict "
                         "(NOT_MODELLED_TABLE):", unmodelled)):
        lines.append(title)
        for name, text in rows:
            lines += [f"  {name}", *textwrap.wrap(text, 100, initial_indent=" " * 6,
                                                  subsequent_indent=" " * 6, break_on_hyphens=False)]
    return "\n".join(lines)
