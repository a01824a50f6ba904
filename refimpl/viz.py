"""Matplotlib figures shared by the trainer and the chapters.

Every function returns the figure (a notebook displays it) and, given ``path``, also writes a PNG;
matplotlib falls back to its non-interactive Agg backend when no display is there (a headless box), and a
notebook kernel shows the figures inline.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import matplotlib.pyplot as plt
import numpy as np


class _Timings(Protocol):
    """What ``plot_alpha_beta`` reads of a measurement
    (``refimpl.measure.collective_timing.Timings``)."""

    op: str
    world_size: int
    sizes_bytes: Sequence[int]
    seconds: Sequence[float]


class _Fit(Protocol):
    """What ``plot_alpha_beta`` reads of a fit (``refimpl.planner.time_model.AlphaBeta``)."""

    alpha_s: float
    beta_bytes_per_s: float

    def predict(self, sizes: np.ndarray) -> np.ndarray: ...


def save_figure(fig, path: str | os.PathLike | None):
    """Lay ``fig`` out tightly and, given ``path``, write it as a PNG (its folder made); returns ``fig``."""
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def plot_loss(
    curves: dict[str, tuple[Sequence[int], Sequence[float]]],
    *,
    path: str | os.PathLike | None = None,
    title: str = "training loss",
    reference: float | None = math.log(256),
):
    """Loss against step for one or more runs; a dashed line at ln 256, the loss of a uniform guess."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, (steps, losses) in curves.items():
        ax.plot(list(steps), list(losses), label=label)
    if reference is not None:
        ax.axhline(reference, ls="--", color="grey", lw=1,
                   label=f"uniform over bytes: ln 256 = {reference:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def plot_timed_overlap(timed: Mapping[str, float], *, title: str, xlabel: str,
                       path: str | os.PathLike | None = None):
    """One overlap measurement as two bars, its serialized control above the overlapped run
    (``timed``: ``refimpl.parallel.overlap.time_overlap``'s result; chapters 03, 07 and 09)."""
    fig, ax = plt.subplots(figsize=(5, 1.8))
    ax.barh(["serialized", "overlapped"], [timed["serialized"], timed["overlapped"]],
            color=["tab:grey", "tab:blue"])
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    return save_figure(fig, path)


def plot_bars(
    groups: dict[str, dict[str, float]],
    *,
    ylabel: str,
    title: str,
    path: str | os.PathLike | None = None,
):
    """Grouped bars: ``groups[group][series] = value`` (e.g. memory measured vs planned, per component)."""
    names = list(groups)
    series = sorted({s for g in groups.values() for s in g}, key=lambda s: list(
        dict.fromkeys(k for g in groups.values() for k in g)).index(s))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, s in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [groups[n].get(s, 0.0) for n in names], width=width, label=s)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def plot_alpha_beta(
    timings: Sequence[_Timings],
    *,
    fits: Sequence[_Fit | None],
    models: Mapping[str, Callable[[np.ndarray], np.ndarray]] | None = None,
    title: str = "time per message: measured (points) and alpha-beta model (lines)",
    path: str | os.PathLike | None = None,
):
    """Log-log plot of each ``refimpl.measure.collective_timing.Timings`` (points) and its alpha-beta
    fit in ``fits`` (solid line; the caller fits, e.g. ``refimpl.planner.fit_alpha_beta``; None: no
    line), plus any ``models[label](sizes) -> seconds`` as dashed lines (e.g. a prediction from the p2p
    fit), chapter 02. Returns the figure; writes a PNG too when ``path`` is given. Draws only: nothing here
    measures or fits, and nothing of refimpl is imported (the package's modules import this one)."""
    lo = min(min(t.sizes_bytes) for t in timings)
    hi = max(max(t.sizes_bytes) for t in timings)
    grid = np.geomspace(max(1, lo), hi, 100)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for i, (tm, fit) in enumerate(zip(timings, fits, strict=True)):
        color = f"C{i}"
        label = f"{tm.op} ({tm.world_size} ranks)"
        ax.loglog(tm.sizes_bytes, tm.seconds, "o", color=color, label=label)
        if fit is not None:
            label = f"  fit: alpha={fit.alpha_s * 1e6:.0f} us, beta={fit.beta_bytes_per_s / 1e9:.2f} GB/s"
            ax.loglog(grid, fit.predict(grid), "-", color=color, alpha=0.7, label=label)
    for j, (label, model) in enumerate((models or {}).items()):
        ax.loglog(grid, model(grid), "--", color=f"C{len(timings) + j}", label=label)
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("time (s)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, path)
