"""One spawn for a chapter's rank checks: ``exercises.grading.grade`` folds them (chapter 00: run_ranks).

A graded file's tasks each start ranks for a fraction of a second of work; started one by one, the
processes' start and their process group cost more than the checks. While ``folded`` is active, a
check's ``run_ranks`` does not start ranks at once: the first time it raises ``Deferred`` (the
grader sets the task aside), and the grader then runs every deferred call of the same world size and
timeouts in **one** spawn (``_calls_on_rank``: the calls one after the other on the same ranks) and
grades the task again, whose ``run_ranks`` now returns that call's per-rank results.

A failed call never borrows a verdict from the others: when a folded spawn fails, its calls are split (the
one that failed, named by the failing rank's message, runs alone, the others fold again; with no call
named, a spawn that hung or died, the calls are halved), so every failure a learner reads comes from a
spawn of that call alone, exactly as ``refimpl.launch.run_ranks`` reports it, and only calls that all
passed share a spawn. Outside ``folded`` (a check called on its own) ``run_ranks`` is refimpl's.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


class Deferred(BaseException):
    """A check asked for ranks whose outcome is not known yet (a BaseException: no check's ``except
    Exception`` takes it for a wrong answer)."""


@dataclass(frozen=True, kw_only=True)
class Call:
    """One ``run_ranks`` call of a check, as refimpl's would run it."""

    fn: Callable[..., Any]
    world_size: int
    args: tuple
    timeout_s: float
    collective_timeout_s: float
    backend: str | None
    env: tuple[tuple[str, str], ...]

    @property
    def key(self) -> tuple:
        return (self.fn.__module__, self.fn.__qualname__, self.world_size, pickle.dumps(self.args),
                self.timeout_s, self.collective_timeout_s, self.backend, self.env)

    @property
    def group(self) -> tuple:
        """Calls that may share a spawn: the same ranks, process-group timeout, backend and environment."""
        return (self.world_size, self.collective_timeout_s, self.backend, self.env)


@dataclass(kw_only=True)
class Batch:
    """The outcomes known so far (call key -> pickled per-rank results, or the RankFailed it raised) and
    the calls waiting for a spawn."""

    outcomes: dict[tuple, bytes | BaseException] = field(default_factory=dict)
    pending: dict[tuple, Call] = field(default_factory=dict)

    def run_pending(self) -> None:
        """Run the waiting calls, one spawn per ``Call.group`` (fewer calls per spawn after a failure)."""
        groups: dict[tuple, list[Call]] = {}
        for call in self.pending.values():
            groups.setdefault(call.group, []).append(call)
        self.pending = {}
        for calls in groups.values():
            self._run(calls)

    def _run(self, calls: list[Call]) -> None:
        from refimpl.launch import RankFailed
        from refimpl.launch import run_ranks as spawn

        first = calls[0]
        try:
            if len(calls) == 1:  # exactly refimpl's spawn of this call: its results or its failure
                alone = spawn(first.fn, first.world_size, *first.args, timeout_s=first.timeout_s,
                              collective_timeout_s=first.collective_timeout_s, backend=first.backend,
                              env=dict(first.env))
                per_rank = [[r] for r in alone]
            else:
                per_rank = spawn(_calls_on_rank, first.world_size, [(c.fn, c.args) for c in calls],
                                 timeout_s=sum(c.timeout_s for c in calls),
                                 collective_timeout_s=first.collective_timeout_s, backend=first.backend,
                                 env=dict(first.env))
        except RankFailed as exc:
            if len(calls) == 1:
                self.outcomes[first.key] = exc
                return
            found = _FAILED.search(str(exc).split("\n", 1)[0])
            i = int(found.group(1)) if found and int(found.group(1)) < len(calls) else None
            parts = [calls[:len(calls) // 2], calls[len(calls) // 2:]] if i is None else \
                [[calls[i]], calls[:i] + calls[i + 1:]]  # the failed call alone, the others folded again
            for part in parts:
                if part:
                    self._run(part)
            return
        for k, call in enumerate(calls):
            self.outcomes[call.key] = pickle.dumps([ranks[k] for ranks in per_rank])


_FAILED = re.compile(r"folded call (\d+) of \d+ failed")
_ACTIVE: ContextVar[Batch | None] = ContextVar("exercises_rank_batch", default=None)


def _calls_on_rank(ctx, calls: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """Each ``fn(ctx, *args)`` in turn on these ranks; the first that raises ends the spawn, naming itself."""
    from refimpl.launch.run_ranks import _exception_line

    out = []
    for i, (fn, args) in enumerate(calls):
        try:
            out.append(fn(ctx, *args))
        except BaseException as exc:  # noqa: BLE001 - reported with the call's index, then split off
            import traceback

            line = _exception_line("".join(traceback.format_exception(exc)))
            raise RuntimeError(f"folded call {i} of {len(calls)} failed: {line}") from exc
    return out


@contextlib.contextmanager
def folded() -> Iterator[Batch]:
    """While active, ``run_ranks`` defers to the yielded ``Batch`` (see the module docstring)."""
    batch = Batch()
    token = _ACTIVE.set(batch)
    try:
        yield batch
    finally:
        _ACTIVE.reset(token)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              collective_timeout_s: float | None = None, backend: str | None = None,
              env: dict[str, str] | None = None) -> list[Any]:
    """``refimpl.launch.run_ranks``, folded with other checks' calls while ``folded`` is active."""
    from refimpl.launch import run_ranks as spawn

    batch = _ACTIVE.get()
    if batch is None:
        return spawn(fn, world_size, *args, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s,
                     backend=backend, env=env)
    call = Call(fn=fn, world_size=world_size, args=args, timeout_s=timeout_s,
                collective_timeout_s=collective_timeout_s or timeout_s / 2, backend=backend,
                env=tuple(sorted((env or {}).items())))
    outcome = batch.outcomes.get(call.key)
    if outcome is None:
        batch.pending[call.key] = call
        raise Deferred(call.fn.__qualname__)
    if isinstance(outcome, BaseException):
        raise outcome
    return pickle.loads(outcome)
