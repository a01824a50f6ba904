"""The alpha-beta cost model of a message and of the ring all-reduce, fitted to measurements (chapter 02).

The alpha-beta (Hockney) model prices a message of ``S`` bytes at ``T(S) = alpha + S / beta``: a fixed
latency ``alpha`` (software overhead, the handshake, the wire's delay) plus the bytes over a bandwidth
``beta``. Small messages are latency-bound, large ones bandwidth-bound; the two terms are equal at
``S = alpha * beta``. Composed step by step it prices the collectives (Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH", IJHPCA 2005): the ring all-reduce takes
``2(n - 1)`` steps of ``S/n`` bytes, ``T = 2(n - 1) alpha + 2(n - 1)/n S / beta``
(``AlphaBeta.ring_all_reduce``).

``fit_alpha_beta`` is least squares on the *relative* error, so a 4-byte and a 4-MB message count
alike (a plain fit would only see the largest messages); the times come from
``refimpl.measure.collective_timing``.

How well the model explains a measurement is ``AlphaBeta.r2``, the coefficient of determination of
``log T`` over the measured sizes: the fraction of the spread of the measured (log) times that the fitted
line accounts for. Near 1: the times are a latency plus a bandwidth term, and ``alpha``, ``beta`` mean what
they say. Near 0 (or below: worse than one constant time for all sizes): the times follow something else
(on a CPU with more ranks than cores, the scheduler), and the fitted numbers describe nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["AlphaBeta", "fit_alpha_beta"]


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
