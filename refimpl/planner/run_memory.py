"""``RunMemory``, one rank's planned bytes by term (chapters 01, 05, 08 and 10): what
``refimpl.planner.memory.run_memory_per_rank`` and
``refimpl.planner.pipeline_memory.pipeline_memory_per_rank`` return, and the trainer's preflight prints
(``RunMemory.describe``) when a run would not fit."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunMemory"]


@dataclass(frozen=True, kw_only=True)
class RunMemory:
    """A run's bytes per rank, term by term: ``state`` (model state) and ``activations`` (what the rank
    saves for backward at its peak, and the transients on top); ``rank``: the pipeline rank the figures
    are of (None without pipeline parallelism)."""

    state: dict[str, int]
    activations: dict[str, int]
    rank: int | None = None

    @property
    def total(self) -> int:
        return sum(self.state.values()) + sum(self.activations.values())

    def describe(self) -> str:
        """One line: the total and every non-zero term, in MiB (naming the pipeline rank, if any)."""
        terms = [f"{k} {v / 2**20:,.1f}" for k, v in {**self.state, **self.activations}.items() if v]
        where = "" if self.rank is None else f"pipeline rank {self.rank}: "
        return f"{where}{self.total / 2**20:,.1f} MiB = " + " + ".join(terms)
