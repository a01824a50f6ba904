"""Peak bytes: of the model state through a step, and of the device or process (chapters 01 and 04).

``PeakStateBytes`` follows ``refimpl.measure.state.state_bytes``'s count through a whole step: a
``TorchDispatchMode`` that samples a caller-supplied count after every tensor operation (forward, backward,
collectives, optimizer) and keeps the largest, so a briefly gathered ZeRO-3 unit is seen (Rajbhandari et
al. 2020; what ``refimpl.planner.zero3_peak_gathered_bytes`` bounds). ``peak_memory_bytes`` is the
allocator's peak on a GPU and the process's peak resident set on a CPU (which also counts the Python
interpreter and libraries); ``peak_reserved_bytes`` the GPU allocator's peak of reserved segments (what
the GPU really gave the process: the allocated bytes plus the allocator's rounding and unused cached blocks;
None on a CPU). On a GPU both are peaks since ``reset_peak_memory``, which the trainer calls at the
start of every step, so that a step's record is that step's peak, not the run's so far.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refimpl.measure.state import StateMemory

__all__ = ["PeakStateBytes", "format_bytes", "peak_memory_bytes", "peak_reserved_bytes", "reset_peak_memory"]


@dataclass
class _Peak:
    total: int = 0
    at: StateMemory | None = None
    samples: int = 0


class PeakStateBytes(TorchDispatchMode):
    """Peak of ``count()`` (a ``StateMemory``) sampled after every tensor operation while active.

        with PeakStateBytes(lambda: model.state_bytes(optimizer)) as peak:
            train_step()
        peak.peak          # StateMemory at the largest total seen

    Sampling costs a walk over the state per op: use it for a measured step, not for timing.
    """

    def __init__(self, count: Callable[[], StateMemory]) -> None:
        super().__init__()
        self.count = count
        self._peak = _Peak()
        self._busy = False

    def sample(self) -> None:
        if self._busy:
            return
        self._busy = True
        try:
            m = self.count()
        finally:
            self._busy = False
        self._peak.samples += 1
        if m.total > self._peak.total:
            self._peak.total, self._peak.at = m.total, m

    def __enter__(self) -> PeakStateBytes:
        out = super().__enter__()
        self.sample()
        return out

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.sample()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        with torch.utils._python_dispatch._disable_current_modes():
            self.sample()
        return out

    @property
    def peak(self) -> StateMemory:
        if self._peak.at is None:
            raise RuntimeError("nothing sampled yet")
        return self._peak.at

    @property
    def samples(self) -> int:
        return self._peak.samples


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU (since ``reset_peak_memory``); peak resident set size of this
    process on a CPU (since it started: the kernel keeps no other)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def peak_reserved_bytes(device: torch.device) -> int | None:
    """Peak bytes the caching allocator reserved on a GPU (since ``reset_peak_memory``); None on a CPU,
    where no allocator of torch's reserves memory apart from what tensors take."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device) -> None:
    """Start the GPU's peaks anew (``torch.cuda.reset_peak_memory_stats``: a host-side counter, no sync);
    nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.5 KiB``, ..., ``2.0 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
