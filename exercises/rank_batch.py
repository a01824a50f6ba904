"""One spawn for a chapter's rank checks: ``exercises.grading.grade`` folds them (chapter 00: run_ranks).

A graded file's tasks each start ranks for a fraction of a second of work; started one by one, the
processes' start and their process group cost more than the checks. While ``folded`` is active, a
check's ``run_ranks`` does not start ranks at once: the first time it raises ``Deferred`` (the
grader sets the task aside), and the grader then runs every deferred call of the same world size and
timeouts in **one** spawn (``_calls_on_rank``: the calls one after the other on the same ranks) and
grades the task again, whose ``run_ranks`` now returns that call's per-rank results.

A failed call never borrows a verdict from the others. Each rank writes each call's result to a folder
of the grader's as soon as the call returns (``_calls_on_rank``); when a folded spawn fails, the calls that
completed on every rank before the failure keep those results (they passed), the one that failed (named
by the failing rank's message; with none named, a spawn that hung or died, the first call that did not
complete on every rank) runs alone, and the calls after it fold again. So every failure a learner reads
comes from a spawn of that call alone, exactly as ``refimpl.launch.run_ranks`` reports it, and every
call's results come from a spawn in which it completed on every rank. The spawns run one after the
other. Outside ``folded`` (a check called on its own) ``run_ranks`` is refimpl's.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import tempfile
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
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
        self._run_apart(list(groups.values()))

    def _run_apart(self, parts: list[list[Call]]) -> None:
        """``_run`` each part, one after the other (each its own spawn)."""
        for part in parts:
            self._run(part)

    def _run(self, calls: list[Call]) -> None:
        from refimpl.launch import RankFailed
        from refimpl.launch import run_ranks as spawn

        first = calls[0]
        if len(calls) == 1:  # exactly refimpl's spawn of this call: its results or its failure
            try:
                alone = spawn(first.fn, first.world_size, *first.args, timeout_s=first.timeout_s,
                              collective_timeout_s=first.collective_timeout_s, backend=first.backend,
                              env=dict(first.env))
            except RankFailed as exc:
                self.outcomes[first.key] = exc
                return
            self.outcomes[first.key] = pickle.dumps(alone)
            return
        with tempfile.TemporaryDirectory(prefix="rank_batch_") as kept:
            try:
                per_rank = spawn(_calls_on_rank, first.world_size, [(c.fn, c.args) for c in calls], kept,
                                 timeout_s=sum(c.timeout_s for c in calls),
                                 collective_timeout_s=first.collective_timeout_s, backend=first.backend,
                                 env=dict(first.env))
                failed = None
            except RankFailed as exc:
                failed, completed = exc, _completed(kept, first.world_size, len(calls))
        if failed is not None:
            self._split(calls, failed, completed)
            return
        for k, call in enumerate(calls):
            self.outcomes[call.key] = pickle.dumps([ranks[k] for ranks in per_rank])

    def _split(self, calls: list[Call], exc: BaseException, completed: list[list[Any]]) -> None:
        """After a folded spawn failed: keep the calls that completed on every rank before the failure,
        run the failed call alone and fold the calls after it again."""
        for call, per_rank in zip(calls, completed, strict=False):
            self.outcomes[call.key] = pickle.dumps(per_rank)
        found = _FAILED.search(str(exc).split("\n", 1)[0])
        named = int(found.group(1)) if found else -1
        # the call the failing rank named; with none named (a spawn that hung or died) the first call that
        # did not complete on every rank
        i = named if len(completed) <= named < len(calls) else len(completed)
        if i == len(calls):  # every call completed on every rank (a rank failed after the last): all passed
            return
        rest = calls[len(completed):i] + calls[i + 1:]
        self._run_apart([[calls[i]], rest] if rest else [[calls[i]]])


_FAILED = re.compile(r"folded call (\d+) of \d+ failed")
_ACTIVE: ContextVar[Batch | None] = ContextVar("exercises_rank_batch", default=None)


def _calls_on_rank(ctx, calls: list[tuple[Callable[..., Any], tuple]], kept: str) -> list[Any]:
    """Each ``fn(ctx, *args)`` in turn on these ranks; the first that raises ends the spawn, naming itself.

    Each call's result is also written to ``kept`` (``{call}-{rank}``) as soon as it returns, so that
    the calls that completed on every rank before a failure keep their results (``_completed``)."""
    from refimpl.launch.run_ranks import _exception_line

    out = []
    for i, (fn, args) in enumerate(calls):
        try:
            out.append(fn(ctx, *args))
        except BaseException as exc:  # noqa: BLE001 - reported with the call's index, then split off
            import traceback

            line = _exception_line("".join(traceback.format_exception(exc)))
            raise RuntimeError(f"folded call {i} of {len(calls)} failed: {line}") from exc
        path = Path(kept) / f"{i}-{ctx.rank}"
        path.with_suffix(".part").write_bytes(pickle.dumps(out[-1]))
        os.replace(path.with_suffix(".part"), path)  # whole or absent, even for a rank killed meanwhile
    return out


def _completed(kept: str, world_size: int, n: int) -> list[list[Any]]:
    """The per-rank results of the leading calls whose result every rank wrote to ``kept``."""
    done: list[list[Any]] = []
    for i in range(n):
        files = [Path(kept) / f"{i}-{r}" for r in range(world_size)]
        if not all(f.exists() for f in files):
            break
        done.append([pickle.loads(f.read_bytes()) for f in files])
    return done


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
