"""Heartbeats that name a stuck rank (chapter 11).

A collective that times out says only that it timed out. Every rank therefore posts its position (step and
phase) to the process group's key-value store as it goes; when a collective fails, each surviving rank
reads all positions and names the rank that is behind (``explain_positions``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from datetime import timedelta


class Heartbeat:
    """Each rank's position (step, phase) in the process group's store, to name a stuck rank.

    Positions are ordered ``(step, phase index)``; a collective that fails because some rank never came
    (it stalled, or died) leaves that rank *behind* the others, which ``explain_positions`` reports.
    One small store write per phase (a TCP round trip to the store on rank 0). Disabled (every method a
    no-op) in a world of one or when the store cannot be reached.
    """

    PREFIX = "refimpl/heartbeat/"

    def __init__(self, rank: int, world_size: int, *, timeout_s: float = 5.0) -> None:
        self.rank, self.world_size = rank, world_size
        self.store = None
        if world_size > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            try:
                import torch.distributed as dist

                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=timedelta(seconds=timeout_s),
                                           wait_for_workers=False)
            except Exception as exc:  # noqa: BLE001 - heartbeats are a diagnostic, never a reason to fail
                print(f"[rank {rank}] heartbeats disabled: {exc}", file=sys.stderr)

    def beat(self, step: int, phase_index: int, phase: str) -> None:
        if self.store is not None:
            try:
                position = json.dumps([step, phase_index, phase, time.time()])
                self.store.set(f"{self.PREFIX}{self.rank}", position)
            except Exception:  # noqa: BLE001 - the store's host may be gone; the failure is reported elsewhere
                self.store = None

    def positions(self) -> dict[int, tuple[int, int, str, float] | None]:
        """Every rank's last position (None: it never reported, or the store is unreachable)."""
        out: dict[int, tuple[int, int, str, float] | None] = {}
        for r in range(self.world_size):
            out[r] = None
            if self.store is None:
                continue
            try:
                key = f"{self.PREFIX}{r}"
                if self.store.check([key]):
                    step, index, phase, t = json.loads(self.store.get(key))
                    out[r] = (int(step), int(index), str(phase), float(t))
            except Exception:  # noqa: BLE001
                self.store = None
        return out

    def explain(self) -> str:
        if self.store is None:
            return "no heartbeats (world of one, or the store on rank 0 is gone with its host)"
        return explain_positions(self.positions())


def explain_positions(positions: Mapping[int, tuple[int, int, str, float] | None],
                      now: float | None = None) -> str:
    """A report naming the ranks that are behind the others (the stalled or dead ones)."""
    now = time.time() if now is None else now
    lines = []
    for r, pos in sorted(positions.items()):
        if pos is None:
            lines.append(f"    rank {r}: never reported")
        else:
            lines.append(f"    rank {r}: step {pos[0]}, {pos[2]} (last heard {now - pos[3]:.1f} s ago)")
    known = {r: p[:2] for r, p in positions.items() if p is not None}
    silent = sorted(r for r, p in positions.items() if p is None)
    if not known:
        verdict = "no rank reported a position"
    else:
        lowest, highest = min(known.values()), max(known.values())
        behind = silent + sorted(r for r, p in known.items() if p == lowest and lowest < highest)
        if behind:
            ranks = ", ".join(str(r) for r in behind)
            verdict = (f"rank{'s' if len(behind) > 1 else ''} {ranks} stopped behind the others: "
                       f"stalled or dead there")
        else:
            verdict = "every rank reached the same point: no single rank is behind (a network problem?)"
    return "positions:\n" + "\n".join(lines) + f"\n  -> {verdict}"
