"""The overlap of data parallelism, drawn: backward compute against the bucket all-reduces (chapter 03).

``plot_overlap`` takes one ``refimpl.parallel.data_parallel.SyncTimeline`` per rank (and, if
given, the rank's traced ``all_reduce`` events of that step, whose ``start`` is the launch the tracer saw)
and draws, per rank, two lanes on a common clock (``time.perf_counter`` is shared by the processes of one
machine): **backward** from the first gradient at the output to the end of the autograd pass, with a tick
at every parameter's gradient hook, and **all-reduce** with one bar per bucket from its launch to its
completion, then the wait in ``finish_gradient_synchronization``. Whatever communication lies right of
the end of backward is *exposed*: nothing hides it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from refimpl.comm.tracer import CommEvent
from refimpl.parallel.data_parallel import SyncTimeline

__all__ = ["plot_overlap"]


def plot_overlap(
    timelines: Sequence[SyncTimeline],
    *,
    events_per_rank: Sequence[Sequence[CommEvent]] | None = None,
    title: str = "backward compute vs bucket all-reduces",
    path: str | os.PathLike | None = None,
):
    """One pair of lanes per rank (see the module docstring); returns the figure, writes a PNG if ``path``."""
    from refimpl.viz import plt, save_figure  # the backend choice lives in viz

    starts = [t.backward_start if t.backward_start is not None else min(x for x in t.launch if x is not None)
              for t in timelines]
    t0 = min(starts)

    def ms(t: float | None) -> float:
        return (t - t0) * 1e3 if t is not None else float("nan")

    n = len(timelines)
    fig, ax = plt.subplots(figsize=(8.0, 0.95 * n + 1.5))
    for r, tl in enumerate(timelines):
        base = 2 * (n - 1 - r)
        # backward lane
        b0 = tl.backward_start if tl.backward_start is not None else starts[r]
        b1 = tl.backward_end if tl.backward_end is not None else max(tl.grad_ready, default=b0)
        ax.broken_barh([(ms(b0), ms(b1) - ms(b0))], (base + 1.1, 0.7), facecolors="C0", alpha=0.35)
        ax.vlines([ms(t) for t in tl.grad_ready], base + 1.1, base + 1.8, colors="C0", lw=0.6)
        # all-reduce lane: launch (tracer start when given) -> completion
        launches = list(tl.launch)
        if events_per_rank is not None:
            evs = [e for e in events_per_rank[r] if e.op == "all_reduce"][: len(launches)]
            launches = [e.start for e in evs] + launches[len(evs) :]
        for b, (a, d) in enumerate(zip(launches, tl.done, strict=True)):
            if a is None or d is None:
                continue
            ax.broken_barh([(ms(a), max(ms(d) - ms(a), 1e-3))], (base + 0.15 + 0.25 * (b % 3), 0.25),
                           facecolors=f"C{1 + b % 3}", edgecolors="black", linewidth=0.3)
        if tl.wait_start is not None and tl.wait_end is not None:
            ax.broken_barh([(ms(tl.wait_start), ms(tl.wait_end) - ms(tl.wait_start))], (base + 0.05, 0.9),
                           facecolors="none", edgecolors="C3", hatch="//", linewidth=0.8)
        ax.axvline(ms(b1), ymin=0, ymax=1, color="grey", ls=":", lw=0.8)
        ax.text(ms(b1), base + 1.95, f" exposed {tl.exposed_fraction():.0%}", fontsize=7, va="top",
                color="C3")
    ax.set_yticks([2 * (n - 1 - r) + y for r in range(n) for y in (0.5, 1.45)],
                  [f"rank {r} {lane}" for r in range(n) for lane in ("all-reduce", "backward")], fontsize=8)
    ax.plot([], [], color="C0", alpha=0.35, lw=6, label="backward (ticks: gradient hooks)")
    ax.plot([], [], color="C1", lw=6, label="bucket all-reduce: launch -> done")
    ax.plot([], [], color="C3", lw=1, label="wait in finish_gradient_synchronization")
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, path)
