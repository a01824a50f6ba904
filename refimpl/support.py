"""The support table: every combination of techniques refimpl refuses, written once, with its reason.

The trainer's options (:class:`refimpl.train.RunOptions`), :func:`refimpl.parallel.parallelize` and the
planner (:func:`refimpl.planner.run_memory_per_rank`, the pipeline's memory model) all ask
:func:`check_supported`, so a combination is refused in the same words before a process starts, before a
model is touched and before a plan is made; ``python -m refimpl.train --list-layouts`` prints the table.
A row leaves the table when the combination is built (docs/ARCHITECTURE.md: how a new technique plugs in).

Each row is a predicate over a :class:`~refimpl.config.ParallelConfig` and the reason a learner needs:
what the combination would do wrong, and what to use instead. tests/test_support.py holds, per row, a
configuration it refuses and the nearest one it lets through.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from refimpl.config import ConfigError, ParallelConfig

__all__ = ["SUPPORT_TABLE", "Unsupported", "check_supported", "describe_support_table", "refusals"]


@dataclass(frozen=True, kw_only=True)
class Unsupported:
    """One refused combination: ``name`` (a short id), ``when`` (the combination, in words), ``reason``
    (why, and what to use instead) and ``applies`` (the predicate)."""

    name: str
    when: str
    reason: str
    applies: Callable[[ParallelConfig], bool]

    def message(self) -> str:
        return f"{self.when}: {self.reason}"


SUPPORT_TABLE: tuple[Unsupported, ...] = (
    Unsupported(
        name="sp-without-tp", when="sequence parallelism with tp = 1",
        reason="it splits the activations between the tensor-parallel regions over the tensor-parallel "
               "ranks: it needs tp > 1",
        applies=lambda c: c.sequence_parallel and c.tp == 1),
    Unsupported(
        name="zero3-zbh1", when="ZeRO-3 with the zbh1 schedule",
        reason="zbh1 computes the weight gradients outside backward (its W actions), where ZeRO-3's "
               "gradient hooks do not see them; use 1f1b, gpipe or interleaved with ZeRO-3",
        applies=lambda c: c.zero_stage == 3 and c.pp > 1 and c.pp_schedule == "zbh1"),
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
        name="zero2-zbh1", when="ZeRO-2 with the zbh1 schedule",
        reason="ZeRO-2 reduce-scatters each gradient when backward has accumulated it, and zbh1 computes "
               "the weight gradients outside backward (its W actions); use ZeRO-1 with zbh1",
        applies=lambda c: c.zero_stage == 2 and c.pp > 1 and c.pp_schedule == "zbh1"),
    Unsupported(
        name="pipeline-options-without-pp", when="micro-batches or virtual stages with pp = 1",
        reason="they set the pipeline: they need pp > 1",
        applies=lambda c: c.pp == 1 and (c.microbatches is not None or c.virtual_stages != 1)),
    Unsupported(
        name="virtual-stages-without-interleaving",
        when="virtual stages > 1 without the interleaved schedule",
        reason="only interleaved 1F1B runs several model chunks per rank; use --pp-schedule interleaved",
        applies=lambda c: c.virtual_stages > 1 and c.pp_schedule != "interleaved"),
)


def refusals(config: ParallelConfig) -> list[Unsupported]:
    """The rows of :data:`SUPPORT_TABLE` that refuse ``config``, in the table's order."""
    return [row for row in SUPPORT_TABLE if row.applies(config)]


def check_supported(config: ParallelConfig) -> None:
    """Raise :class:`~refimpl.config.ConfigError` with the first refusing row's message (the others after
    it), or return: everything in ``config`` composes."""
    rows = refusals(config)
    if rows:
        raise ConfigError("; and ".join(row.message() for row in rows))


def describe_support_table() -> str:
    """The table as text, one refused combination per line (``--list-layouts``)."""
    lines = ["Combinations refused by the trainer, parallelize and the planner alike (refimpl/support.py):"]
    for row in SUPPORT_TABLE:
        lines += [f"  {row.name}", *textwrap.wrap(row.message(), 100, initial_indent=" " * 6,
                                                   subsequent_indent=" " * 6)]
    return "\n".join(lines)
