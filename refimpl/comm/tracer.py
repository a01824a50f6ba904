"""A communication tracer: every collective and point-to-point call made through ``refimpl.comm.ops``.

Chapter 02 introduces it; later chapters use it to *prove* their traffic (bytes per step against a
formula, the overlap of communication with backward as a timeline).

    with CommTracer() as tracer:
        for step in range(3):
            train_step()
            tracer.step()              # closes step 0, 1, 2
    tracer.summary()                   # {"all_reduce": OpTotal(count=..., nbytes=..., wire_bytes=...)}

Each ``CommEvent`` records the op, the payload bytes, the bytes this rank sends, the group size, the
peer of a point-to-point call, the start time (when the op was posted) and the end time (when the op
returned, or for an async op when its handle was waited), and the step. The times are stamps of
``now``: on CPU ``time.perf_counter()`` floats; on CUDA events on the current stream, since NCCL's
``work.wait()`` only makes the current stream wait for the collective and returns at once (an end stamp
recorded after it completes when the stream has waited, the collective's completion). Read, ``start``
and ``end`` are seconds on the ``perf_counter`` axis either way; CUDA stamps are read after one
synchronize, at the first read (``refimpl.comm.device_clock``). What is **measured** and what is
**modelled**:

* ``nbytes`` (every op) is measured: ``numel * element_size`` of the tensors handed to the op (for
  reduce-scatter and all-gather the full, unsharded tensor);
* ``wire_bytes`` of a point-to-point call is measured too: a ``send``/``isend`` puts exactly the tensor it
  was handed on the wire (``nbytes``), a ``recv``/``irecv`` sends nothing (``measured=True``);
* ``wire_bytes`` of a ``torch.distributed`` collective is a **model**: the backend does not say what it
  sends, so the tracer books what the bandwidth-optimal ring would send (``wire_bytes``: all-reduce
  2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S, broadcast and reduce S), the model NCCL's ring
  follows on large messages. gloo picks other algorithms and NCCL uses trees on small messages, so it is
  not what went on the wire (``measured=False``).

Collectives built from point-to-point calls (``refimpl.comm.ring``) are therefore measured byte by
byte: ``CommTracer.measured_bytes_sent`` counts only them, ``CommTracer.modelled_bytes_sent``
only the collectives' model, ``CommTracer.bytes_sent`` both (docs/ARCHITECTURE.md, chapter 02).

A point-to-point op posted in a ``batch_isend_irecv`` group is booked like a plain one (``isend`` or
``irecv``, its bytes measured), with ``batched=True``. ``on_send``, when given, is called with every tensor
this rank hands to a send (plain or batched) as it is posted: how a memory measurement counts what is
kept alive for sending (``refimpl.measure.run_measurement.LiveTensorBytes``) without patching the
ops.

Active tracers are kept on a process-wide stack, the one piece of process state in refimpl, like
PyTorch's own profiler: autograd may run gradient hooks on another thread, where a context variable
would not be seen. Tracing off costs one list check per call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from refimpl.comm import device_clock
from refimpl.comm.device_clock import Stamp, StampField

_LOCK = threading.Lock()
_ACTIVE: list[CommTracer] = []


P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
"""Point-to-point ops: their ``wire_bytes`` are measured, not modelled."""


@dataclass(kw_only=True)
class CommEvent:
    """One call. ``nbytes``: payload, measured from the tensors. ``wire_bytes``: bytes this rank sends,
    measured for point-to-point calls (``measured=True``), the ring model for collectives (``False``).
    ``start`` / ``end``: stamps of ``now``, read as seconds (``.device_clock.StampField``)."""

    op: str
    nbytes: int
    wire_bytes: float
    group_size: int
    peer: int | None
    start: StampField[float] = StampField()
    end: StampField[float | None] = StampField()  # None until the op returned (async: until it was waited)
    step: int
    async_op: bool
    measured: bool = True
    group_id: int | None = None  # id() of the process group the call was made on (None: the default group)
    batched: bool = False  # posted in a batch_isend_irecv group (one event per op of the group)


@dataclass(frozen=True, kw_only=True)
class OpTotal:
    """Totals of one op: ``nbytes`` measured; ``wire_bytes`` measured when ``measured`` (p2p ops), else the
    ring model."""

    count: int
    nbytes: int
    wire_bytes: float
    measured: bool = True


def wire_bytes(op: str, nbytes: float, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on ``nbytes`` of payload: the ring **model** for collectives.

    A model, not a measurement: what the bandwidth-optimal ring sends (NCCL's ring on large messages);
    a backend may send something else (gloo's own algorithms, NCCL's trees). ``nbytes`` is the full
    (unsharded) tensor for reduce-scatter and all-gather: the input of a reduce-scatter, the output of an
    all-gather. For point-to-point ops it is exact: a send sends its tensor, a receive nothing.
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
    """Records ``CommEvent`` s while active (``with CommTracer() as t:``); see the module docstring."""

    events: list[CommEvent] = field(default_factory=list)
    current_step: int = 0
    origin: float = field(default_factory=time.perf_counter)
    on_send: Callable[[Any], None] | None = None  # called with each tensor handed to a send (docstring)

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
        """Count, payload bytes (measured) and wire bytes (measured for p2p, modelled for collectives) per op
        (over all steps, or one)."""
        out: dict[str, OpTotal] = {}
        for e in self.select(step=step):
            t = out.get(e.op, OpTotal(count=0, nbytes=0, wire_bytes=0.0, measured=e.measured))
            out[e.op] = OpTotal(count=t.count + 1, nbytes=t.nbytes + e.nbytes,
                                wire_bytes=t.wire_bytes + e.wire_bytes, measured=t.measured and e.measured)
        return out

    def bytes_sent_by_group(self, *, step: int | None = None) -> dict[int | None, float]:
        """Wire bytes this rank sent per process group (by ``id``; None: the default group), as
        ``bytes_sent`` books them: measured for point-to-point calls, the ring model for collectives."""
        out: dict[int | None, float] = {}
        for e in self.select(step=step):
            out[e.group_id] = out.get(e.group_id, 0.0) + e.wire_bytes
        return out

    def bytes_sent(self, *, step: int | None = None, op: str | None = None) -> float:
        """Wire bytes this rank sent: measured for point-to-point calls **plus the ring model** for
        ``torch.distributed`` collectives (see ``measured_bytes_sent``, ``modelled_bytes_sent``)."""
        return sum(e.wire_bytes for e in self.select(op=op, step=step))

    def measured_bytes_sent(self, *, step: int | None = None, op: str | None = None) -> int:
        """Bytes this rank handed to ``send``/``isend``: measured from the tensors, no model involved."""
        return sum(e.nbytes for e in self.select(op=op, step=step) if e.op in ("send", "isend"))

    def modelled_bytes_sent(self, *, step: int | None = None, op: str | None = None) -> float:
        """What the ring model books for this rank's ``torch.distributed`` collectives (not measured)."""
        return sum(e.wire_bytes for e in self.select(op=op, step=step) if not e.measured)

    def per_step(self) -> list[dict[str, OpTotal]]:
        return [self.summary(step=s) for s in range(self.current_step + 1) if self.select(step=s)]


def active_tracers() -> list[CommTracer]:
    """The tracers that should see a call made now (a snapshot)."""
    if not _ACTIVE:
        return []
    with _LOCK:
        return list(_ACTIVE)


def now() -> Stamp:
    """A stamp of the tracer's clock, the one every timing path reads: on CPU ``time.perf_counter()`` taken
    now; once this process has initialised CUDA, an event on the current stream, which completes when the
    device gets there (NCCL's ``work.wait()`` and kernel launches return before the work is done). Read it
    with ``refimpl.comm.device_clock.seconds``; the records that hold stamps read them as seconds."""
    return device_clock.current_clock().mark()
