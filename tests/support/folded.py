"""Several rank functions in one spawn: a module's per-test spawns folded into one per world size.

A spawn's fixed cost (processes, imports, the process group) is seconds on the 2-core machine; the work of
a unit test's rank function is a fraction of one. ``run_folded`` runs ``{key: (fn, args)}`` one after
the other on the same ``world_size`` ranks (``refimpl.launch.run_ranks``: one free port, the whole
spawn within ``timeout_s``, each collective within ``collective_timeout_s``) and returns ``{key: per-rank
results}``: each test asserts on its key as it did on its own spawn's results. A call that raises ends the
spawn, its rank's message naming the call's key, so the module's tests fail (that test's, and the others
with it: a fold trades isolation for time). A rank function that patches module state for a negative
control restores it before it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from refimpl.launch import run_ranks


def _calls_on_rank(ctx, calls: list[tuple[Hashable, Callable[..., Any], tuple]]) -> list[Any]:
    out = []
    for key, fn, args in calls:
        try:
            out.append(fn(ctx, *args))
        except Exception as exc:
            raise RuntimeError(f"folded call {key!r} ({fn.__name__}): {type(exc).__name__}: {exc}") from exc
    return out


def run_folded(world_size: int, calls: dict[Hashable, tuple[Callable[..., Any], tuple]], *, timeout_s: float,
               collective_timeout_s: float | None = None) -> dict[Hashable, list[Any]]:
    """``{key: run_ranks(fn, world_size, *args)}`` for every ``key: (fn, args)`` of ``calls``, from one spawn
    (run_ranks' ``timeout_s`` and ``collective_timeout_s``, default ``timeout_s / 2``)."""
    items = [(key, fn, tuple(args)) for key, (fn, args) in calls.items()]
    per_rank = run_ranks(_calls_on_rank, world_size, items, timeout_s=timeout_s,
                         collective_timeout_s=collective_timeout_s)
    return {key: [ranks[k] for ranks in per_rank] for k, (key, _, _) in enumerate(items)}
