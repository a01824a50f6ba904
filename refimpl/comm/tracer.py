"""A communication tracer: every collective and point-to-point call made through :mod:`refimpl.comm.ops`.

Chapter 02 introduces it; later chapters use it to *prove* their traffic (bytes per step against a
formula, the overlap of communication with backward as a timeline).

    with CommTracer() as tracer:
        for step in range(3):
            train_step()
            tracer.step()              # closes step 0, 1, 2
    tracer.summary()                   # {"all_reduce": OpTotal(count=..., nbytes=..., wire_bytes=...)}

Each :class:`CommEvent` records the op, the payload bytes (the tensor handed to the op), the *wire bytes*
this rank sends under the bandwidth-optimal ring algorithm (NCCL's model: all-reduce 2(n-1)/n S,
reduce-scatter and all-gather (n-1)/n of the full tensor, broadcast S, p2p send S), the group size, the
peer of a point-to-point call, the start time and the end time (when the op returned, or for an async op
when its handle was waited), and the step.

Active tracers are kept on a process-wide stack, the one piece of process state in refimpl, like
PyTorch's own profiler: autograd may run gradient hooks on another thread, where a context variable
would not be seen. Tracing off costs one list check per call.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

_LOCK = threading.Lock()
_ACTIVE: list[CommTracer] = []


@dataclass(kw_only=True)
class CommEvent:
    op: str
    nbytes: int
    wire_bytes: float
    group_size: int
    peer: int | None
    start: float
    end: float | None
    step: int
    async_op: bool


@dataclass(frozen=True, kw_only=True)
class OpTotal:
    count: int
    nbytes: int
    wire_bytes: float


def wire_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on ``nbytes`` of payload under the ring algorithm.

    ``nbytes`` is the full (unsharded) tensor for reduce-scatter and all-gather: the input of a
    reduce-scatter, the output of an all-gather.
    """
    n = group_size
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n * nbytes
    if op in ("broadcast", "reduce", "send", "isend"):
        return float(nbytes)
    return 0.0  # recv, irecv, barrier: nothing sent by this rank


@dataclass
class CommTracer:
    """Records :class:`CommEvent` s while active (``with CommTracer() as t:``); see the module docstring."""

    events: list[CommEvent] = field(default_factory=list)
    current_step: int = 0
    origin: float = field(default_factory=time.perf_counter)

    def __enter__(self) -> CommTracer:
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    def step(self) -> None:
        """Close the current step: later events count toward the next one."""
        self.current_step += 1

    def record(self, event: CommEvent) -> None:
        with _LOCK:
            self.events.append(event)

    def select(self, *, op: str | None = None, step: int | None = None) -> list[CommEvent]:
        return [e for e in self.events if (op is None or e.op == op) and (step is None or e.step == step)]

    def summary(self, *, step: int | None = None) -> dict[str, OpTotal]:
        """Count, payload bytes and wire bytes per op (over all steps, or one)."""
        out: dict[str, OpTotal] = {}
        for e in self.select(step=step):
            t = out.get(e.op, OpTotal(count=0, nbytes=0, wire_bytes=0.0))
            out[e.op] = OpTotal(count=t.count + 1, nbytes=t.nbytes + e.nbytes,
                                wire_bytes=t.wire_bytes + e.wire_bytes)
        return out

    def bytes_sent(self, *, step: int | None = None, op: str | None = None) -> float:
        """Wire bytes this rank sent (ring model for collectives, exact for point-to-point)."""
        return sum(e.wire_bytes for e in self.select(op=op, step=step))

    def per_step(self) -> list[dict[str, OpTotal]]:
        return [self.summary(step=s) for s in range(self.current_step + 1) if self.select(step=s)]


def active_tracers() -> list[CommTracer]:
    """The tracers that should see a call made now (a snapshot)."""
    if not _ACTIVE:
        return []
    with _LOCK:
        return list(_ACTIVE)


def now() -> float:
    return time.perf_counter()
