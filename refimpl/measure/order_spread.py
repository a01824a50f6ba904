"""The numerics rule's yardstick (docs/ARCHITECTURE.md; chapters 03-10): how far a parallel run may land
from one device when both add the same numbers in other orders.

One device trains the same model twice in two summation orders (the whole batch at once, and one sequence
per micro-batch), per precision; ``spread = max_step |loss_batch - loss_micro|`` is what reordering alone
moves the losses by, measured, never assumed. In 16 bits the spread is at least one device's
``max |loss_16 - loss_fp32|``: a 16-bit parallel run rounds partial results (a row layer's partial sums, ring
attention's float32 blocks) where one device rounds once, a rounding no reordering of one device's
arithmetic contains. The tolerance is ``factor x spread``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["order_tolerance"]


def order_tolerance(losses: Mapping[tuple[str, str], Sequence[float]], precision: str, *,
                    factor: float) -> float:
    """``factor x`` the order spread of ``precision``; ``losses[(precision, "batch" | "micro")]`` are one
    device's losses in the two orders (16 bits also need ``losses["fp32", "batch"]``). A ValueError when the
    two orders gave the same bits: then there is no yardstick."""
    a, b = np.asarray(losses[precision, "batch"]), np.asarray(losses[precision, "micro"])
    spread = float(np.abs(a - b).max())
    if not spread > 0:
        raise ValueError(f"{precision}: both summation orders give the same bits: no yardstick")
    if precision != "fp32":
        spread = max(spread, float(np.abs(a - np.asarray(losses["fp32", "batch"])).max()))
    return factor * spread
