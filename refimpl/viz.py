"""Matplotlib figures shared by the trainer and the chapters.

Every function returns the figure (a notebook displays it) and, given ``path``, also writes a PNG;
matplotlib falls back to its non-interactive Agg backend when no display is there (a headless box), and a
notebook kernel shows the figures inline.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt


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
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


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
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
