"""Measured latency and bandwidth, and the alpha-beta cost model fitted to them (chapter 02).

The alpha-beta (Hockney) model prices a message of ``S`` bytes at ``T(S) = alpha + S / beta``: a fixed
latency ``alpha`` (software overhead, the handshake, the wire's delay) plus the bytes over a bandwidth
``beta``. Small messages are latency-bound, large ones bandwidth-bound; the two terms are equal at
``S = alpha * beta``. Composed step by step it prices the collectives (Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH", IJHPCA 2005): the ring all-reduce takes
``2(n - 1)`` steps of ``S/n`` bytes, ``T = 2(n - 1) alpha + 2(n - 1)/n S / beta``
(:meth:`AlphaBeta.ring_all_reduce`).

* :func:`measure_p2p`: ping-pong between two ranks, one-way time = half the round trip;
* :func:`measure_collective`: any collective, e.g. ``ops.all_reduce`` or ``ring_all_reduce``;
* :func:`fit_alpha_beta`: least squares on the *relative* error, so a 4-byte and a 4-MB message count
  alike (a plain fit would only see the largest messages);
* :func:`plot_alpha_beta`: measured points against the fitted lines, log-log.

Each size is run ``warmup`` times unmeasured (connection setup, allocator, caches), then ``repeats`` times;
the time of one repeat is the slowest rank's, and the median over repeats is kept (robust to a stray
slow run on a shared machine). Timings on an oversubscribed CPU are only illustrative: docs/ARCHITECTURE.md
keeps absolute times out of assertions.

How well the model explains a measurement is :attr:`AlphaBeta.r2`, the coefficient of determination of
``log T`` over the measured sizes: the fraction of the spread of the measured (log) times that the fitted
line accounts for. Near 1: the times are a latency plus a bandwidth term, and ``alpha``, ``beta`` mean what
they say. Near 0 (or below: worse than one constant time for all sizes): the times follow something else
(on a CPU with more ranks than cores, the scheduler), and the fitted numbers describe nothing.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from refimpl.comm import ops

__all__ = [
    "DEFAULT_SIZES",
    "AlphaBeta",
    "Timings",
    "fit_alpha_beta",
    "measure_collective",
    "measure_p2p",
    "plot_alpha_beta",
]

DEFAULT_SIZES: tuple[int, ...] = (4, 64, 1024, 16 * 1024, 256 * 1024, 4 * 1024 * 1024)
"""Message sizes in bytes, from one float32 to 4 MiB."""


@dataclass(frozen=True, kw_only=True)
class Timings:
    """Median seconds of one ``op`` per message size, on ``world_size`` ranks (the same on every rank)."""

    op: str
    world_size: int
    sizes_bytes: tuple[int, ...]
    seconds: tuple[float, ...]
    repeats: int


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """``T(S) = alpha_s + S / beta_bytes_per_s``; ``r2``: the fit's coefficient of determination of log T
    (1: the line explains every measured time; 0: no better than a constant; see the module docstring)."""

    alpha_s: float
    beta_bytes_per_s: float
    r2: float

    def predict(self, nbytes):
        """Seconds for messages of ``nbytes`` (a number or an array)."""
        return self.alpha_s + np.asarray(nbytes, dtype=np.float64) / self.beta_bytes_per_s

    def ring_all_reduce(self, nbytes, n: int):
        """Seconds of a ring all-reduce of ``nbytes`` on ``n`` ranks: ``2(n-1) alpha + 2(n-1)/n S / beta``."""
        s = np.asarray(nbytes, dtype=np.float64)
        return 2 * (n - 1) * self.alpha_s + 2 * (n - 1) / n * s / self.beta_bytes_per_s

    @property
    def half_bandwidth_bytes(self) -> float:
        """The message size at which latency and bandwidth cost the same: ``alpha * beta``."""
        return self.alpha_s * self.beta_bytes_per_s


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of ``T = alpha + S / beta``, minimising the relative error ``sum ((T_fit - T)/T)^2``.

    Exact on data that follow the model. Raises ``ValueError`` with fewer than two distinct sizes. ``r2``
    is ``1 - sum (log T - log T_fit)^2 / sum (log T - mean log T)^2``, on ``log T`` (what the log-log plot
    shows, and like the relative error it weighs small and large messages alike): 1 is a perfect fit, 0 no
    better than the mean, negative worse; ``-inf`` when the fitted line is not positive at every size.
    """
    s = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if s.shape != t.shape or len(np.unique(s)) < 2:
        raise ValueError("need matching sizes and times with at least two distinct sizes")
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    # rows scaled by 1/T:  [1/T, S/T] @ [alpha, 1/beta] ~ 1
    a = np.stack([1.0 / t, s / t], axis=1)   # (k, 2)
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    beta = 1.0 / inv_beta if inv_beta != 0 else float("inf")
    fitted = alpha + s * inv_beta
    if np.all(fitted > 0):
        log_t, log_f = np.log(t), np.log(fitted)
        ss_tot = float(np.sum((log_t - log_t.mean()) ** 2))
        r2 = 1.0 - float(np.sum((log_t - log_f) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    else:
        r2 = float("-inf")  # the line goes below zero somewhere: not a usable model
    return AlphaBeta(alpha_s=float(alpha), beta_bytes_per_s=float(beta), r2=r2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(values: list[float], device: torch.device, group) -> list[float]:
    """Element-wise max over the ranks (a repeat takes as long as its slowest rank)."""
    if group is None and not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # bookkeeping: not traced on purpose
    return t.tolist()


def measure_collective(
    fn: Callable[..., object],
    sizes_bytes: Sequence[int] = DEFAULT_SIZES,
    *,
    name: str | None = None,
    repeats: int = 5,
    warmup: int = 2,
    group=None,
    device: torch.device | str = "cpu",
) -> Timings:
    """Median time of ``fn(buffer, group=group)`` on float32 buffers of each size. Call on every rank.

    ``fn`` is e.g. :func:`refimpl.comm.ops.all_reduce` or :func:`refimpl.comm.ring.ring_all_reduce`.
    Buffers are zeros (sums stay finite however often they run) of ``max(1, size // 4)`` elements.
    """
    device = torch.device(device)
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    medians = []
    for size in sizes_bytes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)  # (size/4,)
        times = []
        for i in range(warmup + repeats):
            if n > 1:
                dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            fn(buf, group=group)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        medians.append(statistics.median(_slowest(times, device, group)))
    return Timings(op=name or getattr(fn, "__name__", "collective"), world_size=n,
                   sizes_bytes=tuple(int(s) for s in sizes_bytes), seconds=tuple(medians), repeats=repeats)


def measure_p2p(
    sizes_bytes: Sequence[int] = DEFAULT_SIZES,
    *,
    src: int = 0,
    dst: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    group=None,
    device: torch.device | str = "cpu",
) -> Timings:
    """One-way time of a message between group ranks ``src`` and ``dst``: half a ping-pong's round trip.

    Call on every rank of the group (the others wait); every rank gets the same :class:`Timings`. Uses
    blocking ``ops.send``/``ops.recv``, so an active tracer sees each message.
    """
    device = torch.device(device)
    rank, n = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    if n < 2 or src == dst or not (0 <= src < n and 0 <= dst < n):
        raise ValueError(f"need two distinct ranks of a group of at least 2; got src={src}, dst={dst}, n={n}")
    g_src, g_dst = ((src, dst) if group is None
                    else (dist.get_global_rank(group, src), dist.get_global_rank(group, dst)))
    medians = []
    for size in sizes_bytes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)  # (size/4,)
        times = []
        dist.barrier(group=group)
        for i in range(warmup + repeats):
            _sync(device)
            t0 = time.perf_counter()
            if rank == src:
                ops.send(buf, dst=g_dst, group=group)
                ops.recv(buf, src=g_dst, group=group)
            elif rank == dst:
                ops.recv(buf, src=g_src, group=group)
                ops.send(buf, dst=g_src, group=group)
            _sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - t0) / 2)
        medians.append(statistics.median(times) if rank == src else 0.0)
    t = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.broadcast(t, src=g_src, group=group)  # bookkeeping: src's clock is the measurement
    return Timings(op="p2p", world_size=2, sizes_bytes=tuple(int(s) for s in sizes_bytes),
                   seconds=tuple(t.tolist()), repeats=repeats)


def plot_alpha_beta(
    timings: Sequence[Timings],
    *,
    fits: Sequence[AlphaBeta | None] | None = None,
    models: Mapping[str, Callable[[np.ndarray], np.ndarray]] | None = None,
    title: str = "time per message: measured (points) and alpha-beta model (lines)",
    path: str | os.PathLike | None = None,
):
    """Log-log plot of each :class:`Timings` (points) and its fit (solid line; fitted here when ``fits`` is
    None), plus any ``models[label](sizes) -> seconds`` as dashed lines (e.g. a prediction from the p2p fit).
    Returns the figure; writes a PNG too when ``path`` is given."""
    from refimpl.viz import plt  # the backend choice lives in viz

    fits = list(fits) if fits is not None else [fit_alpha_beta(t.sizes_bytes, t.seconds) for t in timings]
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
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig
