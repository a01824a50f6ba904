"""What one synchronised backward did when (chapter 03): the overlap of backward and bucket all-reduces.

``refimpl.parallel.data_parallel.data_parallel.DataParallelBucket`` leaves one ``SyncTimeline``
per synchronisation (``last_timeline``); ``refimpl.parallel.dp_viz`` draws it, and
``SyncTimeline.exposed_fraction`` is the share of communication that backward did not hide.

Its times are stamps of ``refimpl.comm.tracer.now``, held as they were taken and read as seconds
(``refimpl.comm.device_clock``): on CPU ``time.perf_counter`` floats; on CUDA events on the current
stream, because a gradient hook runs when its kernels are launched, not done, and NCCL's ``work.wait()``
only makes the stream wait for the all-reduce. A bucket's ``done`` is stamped in a callback on the
collective's future, which on NCCL runs on a stream made to wait for the collective: its event completes
with it. CUDA stamps are read after one synchronize, at the first read (after the step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from refimpl.comm.device_clock import StampField, StampList

__all__ = ["SyncTimeline"]


@dataclass
class SyncTimeline:
    """What one synchronised backward did when, in seconds of the tracer's clock (device time on CUDA).

    ``launch[b]`` / ``done[b]``: when bucket ``b``'s reduction was launched and seen complete (a callback
    on the collective's future, so it is the completion, not the later ``wait()``); ``grad_ready``: the
    time of every gradient hook; ``backward_start`` / ``backward_end``: the first gradient reaching the
    model's output and the end of the autograd pass; ``wait_start`` / ``wait_end``: the call to
    ``finish_gradient_synchronization``. The lists are ``refimpl.comm.device_clock.StampList`` s and
    the single times ``refimpl.comm.device_clock.StampField`` s: stamps in, seconds out.
    """

    launch: StampList
    done: StampList
    grad_ready: StampList = field(default_factory=StampList)
    backward_start: StampField[float | None] = StampField(default=None)
    backward_end: StampField[float | None] = StampField(default=None)
    wait_start: StampField[float | None] = StampField(default=None)
    wait_end: StampField[float | None] = StampField(default=None)

    def __post_init__(self) -> None:
        self.launch, self.done = StampList(self.launch), StampList(self.done)
        self.grad_ready = StampList(self.grad_ready)

    def _intervals(self, not_before: float = -math.inf) -> list[tuple[float, float]]:
        spans = sorted((max(a, not_before), b) for a, b in zip(self.launch, self.done, strict=True)
                       if a is not None and b is not None and b > max(a, not_before))
        merged: list[tuple[float, float]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged

    def comm_seconds(self) -> float:
        """Wall time during which at least one bucket's reduction was in flight."""
        return sum(b - a for a, b in self._intervals())

    def exposed_seconds(self) -> float:
        """The part of ``comm_seconds`` after backward ended: communication that nothing hides."""
        end = self.backward_end if self.backward_end is not None else -math.inf
        return sum(b - a for a, b in self._intervals(not_before=end))

    def exposed_fraction(self) -> float:
        total = self.comm_seconds()
        return self.exposed_seconds() / total if total > 0 else 0.0

