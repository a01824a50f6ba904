"""The failure log (chapter 11): one JSON line per failure in ``<out>/failures.jsonl``, read back for the
report of a failed run."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from refimpl.elastic.restart import restart_count

FAILURES = "failures.jsonl"


def record_failure(out: str | os.PathLike | None, **fields: Any) -> None:
    """Append one line to ``<out>/failures.jsonl`` (one short write: lines of ranks do not interleave)."""
    if out is None:
        return
    entry = {"time": time.time(), "attempt": restart_count(), **fields}
    path = Path(out) / FAILURES
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_failures(out: str | os.PathLike, *, since: float = 0.0) -> list[dict]:
    path = Path(out) / FAILURES
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if entry.get("time", 0.0) >= since:
            entries.append(entry)
    return entries


def summarize_failures(entries: Sequence[Mapping[str, Any]]) -> str:
    """One line per recorded failure, by attempt: what the report of a failed run lists."""
    if not entries:
        return "  (no failure was recorded by the trainer: a rank may have been killed from outside)"
    lines = []
    for e in sorted(entries, key=lambda e: (e.get("attempt", 0), e.get("time", 0.0))):
        where = f"step {e['step']}" if e.get("step") is not None else "before training"
        lines.append(f"  attempt {e.get('attempt', 0)}, rank {e.get('rank')}, {where}: {e.get('message')}")
    return "\n".join(lines)
