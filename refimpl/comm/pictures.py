"""Pictures of communication: who holds what before and after a collective, and a timeline (chapter 02).

``plot_who_holds_what`` draws, for each collective, every rank's tensor before and after as a row of
cells. A cell is coloured by the rank whose input value it holds (so a broadcast paints every row in the
root's colour, an all-to-all transposes the colours), and grey with a sigma when its value is none of the
inputs: a reduction of several. Choose inputs whose values are distinct across ranks (e.g. ``10 (r + 1) +
j``) for the colours to tell the truth. ``plot_timeline`` draws the events of a
``refimpl.comm.tracer.CommTracer`` per rank as bars in time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from refimpl.comm.tracer import CommEvent

__all__ = ["plot_timeline", "plot_who_holds_what"]

Holdings = Sequence[torch.Tensor | Sequence[float] | None]
"""One entry per rank: its 1-D tensor, or None when the rank holds nothing meaningful."""


def _values(x) -> list[float] | None:
    if x is None:
        return None
    return [float(v) for v in (x.detach().flatten().tolist() if isinstance(x, torch.Tensor) else x)]


def _draw_ranks(ax, rows: list[list[float] | None], owner: Mapping[float, int], width: int, title: str):
    n = len(rows)
    for r, row in enumerate(rows):
        y = n - 1 - r
        ax.text(-0.3, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=8)
        if row is None or not row:
            ax.text(0.1, y + 0.5, "-", ha="left", va="center", fontsize=9, color="grey")
            continue
        for j, v in enumerate(row):
            src = owner.get(v)
            face = f"C{src}" if src is not None else "0.85"
            ax.add_patch(_rect(j, y, face))
            text = f"{v:g}" if src is not None else f"Σ {v:g}"
            ax.text(j + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7,
                    color="white" if src is not None else "black")
    ax.set_xlim(-1.6, max(width, 1) + 0.1)
    ax.set_ylim(-0.1, n + 0.1)
    ax.set_title(title, fontsize=9, loc="left")
    ax.axis("off")


def _rect(x: float, y: float, face: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.04, y + 0.06), 0.92, 0.88, facecolor=face, edgecolor="white", alpha=0.9)


def plot_who_holds_what(
    pictures: Mapping[str, tuple[Holdings, Holdings]],
    *,
    path: str | os.PathLike | None = None,
):
    """One row of two panels per collective, ``pictures[name] = (before, after)`` (per-rank tensors).

    Returns the figure; writes a PNG too when ``path`` is given.
    """
    from refimpl.viz import plt, save_figure  # the backend choice lives in viz

    names = list(pictures)
    n_ranks = max(len(b) for b, _ in pictures.values())
    rows = {name: tuple([_values(x) for x in side] for side in pictures[name]) for name in names}
    width = max(len(row or []) for before, after in rows.values() for row in (*before, *after))  # cells
    fig, axes = plt.subplots(len(names), 2, figsize=(min(16.0, 2.0 + 1.1 * width), 0.42 * (n_ranks + 1.2) *
                                                      len(names)), squeeze=False)
    for i, name in enumerate(names):
        before, after = rows[name]
        owner: dict[float, int] = {}
        for r, row in enumerate(before):
            for v in row or []:
                owner.setdefault(v, r)
        _draw_ranks(axes[i][0], before, owner, width, f"{name}: before")
        _draw_ranks(axes[i][1], after, owner, width, f"{name}: after")
    return save_figure(fig, path)


def plot_timeline(
    events_per_rank: Sequence[Sequence[CommEvent]],
    *,
    ops: Sequence[str] | None = None,
    title: str = "communication timeline",
    path: str | os.PathLike | None = None,
):
    """Each rank's traced events as bars from start to end (ms since the earliest event), coloured by op.

    ``events_per_rank[r]`` is rank ``r``'s ``tracer.events`` (ranks on one machine share the clock of
    ``time.perf_counter``). ``ops`` keeps only those ops. Events never waited (no end) are drawn as ticks.
    """
    from refimpl.viz import plt, save_figure

    kept = [[e for e in evs if ops is None or e.op in ops] for evs in events_per_rank]
    starts = [e.start for evs in kept for e in evs]
    t0 = min(starts) if starts else 0.0
    names = list(dict.fromkeys(e.op for evs in kept for e in evs))
    fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(kept) + 1.4))
    for r, evs in enumerate(kept):
        y = len(kept) - 1 - r
        for e in evs:
            start = (e.start - t0) * 1e3
            dur = ((e.end if e.end is not None else e.start) - e.start) * 1e3
            k = names.index(e.op)
            height, offset = 0.8 / len(names), 0.1 + 0.8 * k / len(names)
            ax.broken_barh([(start, max(dur, 1e-3))], (y + offset, height), facecolors=f"C{k}", alpha=0.8)
    for k, name in enumerate(names):
        ax.plot([], [], color=f"C{k}", lw=6, label=name)
    n = len(kept)
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    if names:
        ax.legend(fontsize=8, loc="upper right")
    return save_figure(fig, path)
