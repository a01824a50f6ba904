"""A clock that reads when the device did the work, not when the CPU asked for it.

On CPU + gloo a blocking call returns once its work is done, and ``work.wait()`` blocks until the data is
there: ``time.perf_counter()`` after it is the completion. On CUDA + NCCL neither holds: a kernel launch
returns before the kernel ran, and NCCL's ``work.wait()`` only makes the *current stream* wait for the
collective's stream, then returns at once. A CPU clock there reads launch times, and a collective's
duration comes out near zero. GPU timings come from CUDA events recorded on the current stream and read
after a synchronize (docs: DESIGN.md, "GPUs").

A **stamp** is what ``DeviceClock.mark`` returns:

* on CPU, the ``time.perf_counter()`` float taken now, so every timing path holds what it held before;
* on CUDA, a ``CudaStamp``: an event recorded on the current stream. It completes when the stream
  reaches it, after every kernel queued before it and after every collective the stream was made to wait
  for: a stamp taken right after ``work.wait()`` is the collective's completion.

A CUDA stamp is read once the device is past it: the first read of a stamp the device has not reached
calls ``torch.cuda.synchronize()`` once, after which every stamp taken before reads without waiting. Its
seconds are its time since a reference event, placed on the ``perf_counter`` axis (the reference is
recorded on an idle device as ``perf_counter`` is read), so device stamps and CPU stamps share one axis.

The records that hold stamps read them as seconds: a ``StampField`` (one stamp, a dataclass field)
and a ``StampList`` (a list of stamps) give floats to their readers, and the synchronize happens at
the first read, at the step's end, not while the step runs. ``seconds`` reads any stamp. A deferred
stamp compares and subtracts as its seconds, and pickles as them (a rank's events sent to the notebook
arrive as floats).

``current_clock`` is the clock of ``refimpl.comm.tracer.now``: CUDA's once this process has
initialised CUDA (its work is then asynchronous), else the CPU's.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, SupportsIndex, TypeAlias, TypeVar, cast

import torch

__all__ = ["CudaStamp", "DeferredStamp", "DeviceClock", "Stamp", "StampField", "StampList", "current_clock",
           "raw_stamp", "seconds"]


class DeferredStamp(ABC):
    """A stamp whose seconds are known once the device has reached it (``seconds``). Compared,
    subtracted or pickled it acts as its seconds, so code that holds a raw stamp keeps working."""

    __slots__ = ()

    @abstractmethod
    def seconds(self) -> float:
        """Seconds on the ``time.perf_counter`` axis (reading may wait for the device)."""

    def __float__(self) -> float:
        return self.seconds()

    def __lt__(self, other: object) -> bool:
        return self.seconds() < _number(other)

    def __le__(self, other: object) -> bool:
        return self.seconds() <= _number(other)

    def __gt__(self, other: object) -> bool:
        return self.seconds() > _number(other)

    def __ge__(self, other: object) -> bool:
        return self.seconds() >= _number(other)

    def __sub__(self, other: object) -> float:
        return self.seconds() - _number(other)

    def __rsub__(self, other: object) -> float:
        return _number(other) - self.seconds()

    def __reduce__(self) -> tuple[type, tuple[float]]:
        return float, (self.seconds(),)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.seconds()!r})"


Stamp: TypeAlias = float | DeferredStamp
"""What a clock's ``mark()`` returns: a ``perf_counter`` float on CPU, a ``DeferredStamp`` on a GPU."""


def seconds(stamp: Stamp | None) -> float | None:
    """The seconds of ``stamp`` (None stays None; a float is returned as it is)."""
    return stamp.seconds() if isinstance(stamp, DeferredStamp) else stamp


def _number(value: object) -> float:
    got = seconds(value)  # type: ignore[arg-type]
    if not isinstance(got, int | float):
        raise TypeError(f"a stamp compares with seconds or another stamp, not {type(value).__name__}")
    return got


# ------------------------------------------------------------------------------------------------- CUDA
@dataclass(frozen=True)
class _Reference:
    """An event the device has passed and the ``perf_counter`` reading taken as it completed."""

    event: torch.cuda.Event
    at: float


_REFERENCES: dict[int, _Reference] = {}
_LOCK = threading.Lock()


def _reference(device: int) -> _Reference:
    """The reference of ``device``, made at its first stamp (one synchronize, once per process)."""
    ref = _REFERENCES.get(device)
    if ref is not None:
        return ref
    with _LOCK:
        ref = _REFERENCES.get(device)
        if ref is None:
            torch.cuda.synchronize(device)  # idle: the event below completes as it is recorded
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            event.synchronize()
            ref = _REFERENCES[device] = _Reference(event=event, at=time.perf_counter())
        return ref


class CudaStamp(DeferredStamp):
    """A CUDA event recorded on the current stream of ``device`` (an index) when made: the time the stream
    reaches this point, read in seconds on the ``perf_counter`` axis once the device is past it."""

    __slots__ = ("_seconds", "device", "event")

    def __init__(self, device: int) -> None:
        self.device = device
        self._seconds: float | None = None
        _reference(device)  # recorded before this event, on an idle device
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(torch.cuda.current_stream(device))

    def seconds(self) -> float:
        if self._seconds is None:
            if not self.event.query():  # the one wait: every stamp taken so far is reached after it
                torch.cuda.synchronize(self.device)
            ref = _reference(self.device)
            self._seconds = ref.at + ref.event.elapsed_time(self.event) / 1e3  # elapsed_time: milliseconds
        return self._seconds


# ---------------------------------------------------------------------------------------------- the clock
@dataclass(frozen=True)
class DeviceClock:
    """Stamps for the work of ``device``: ``perf_counter`` floats on CPU (taken now), ``CudaStamp`` s
    on a GPU (taken when the current stream gets there)."""

    device: torch.device = torch.device("cpu")  # cpu on purpose: the default is the CPU's perf_counter

    def mark(self) -> Stamp:
        if self.device.type != "cuda":
            return time.perf_counter()
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return CudaStamp(index)


CPU_CLOCK = DeviceClock()


def current_clock() -> DeviceClock:
    """CUDA's clock on the current device once this process has initialised CUDA, else the CPU's: the clock
    of ``refimpl.comm.tracer.now`` (a forked child of a CUDA process does not count as initialised)."""
    if torch.cuda.is_initialized():
        return DeviceClock(torch.device("cuda", torch.cuda.current_device()))
    return CPU_CLOCK


# ------------------------------------------------------------------------------------ records of stamps
_REQUIRED: Any = object()
_Read = TypeVar("_Read", bound="float | None")


class StampField(Generic[_Read]):
    """A dataclass field that holds a stamp and reads as its seconds (``start: StampField[float] =
    StampField()``; ``StampField[float | None]`` for one that may hold None, ``StampField(default=None)``
    for an optional one). Its type argument is what a read gives; the dataclass's ``__init__`` and an
    assignment take any stamp. It stores the stamp in the instance's ``__dict__`` under its own name:
    ``raw_stamp`` gives it back unread."""

    def __init__(self, *, default: float | None = _REQUIRED) -> None:
        self.default = default
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> _Read:
        # the casts: a field holds None only where its annotation says ``float | None``
        if obj is None:  # the class's view: the dataclass default (none: a required field)
            if self.default is _REQUIRED:
                raise AttributeError(self.name)
            return cast(_Read, self.default)
        return cast(_Read, seconds(obj.__dict__[self.name]))

    def __set__(self, obj: object, value: Stamp | None) -> None:
        obj.__dict__[self.name] = value


def raw_stamp(obj: object, name: str) -> Stamp | None:
    """The stamp a ``StampField`` ``name`` of ``obj`` holds, not read (no synchronize)."""
    return obj.__dict__[name]


class StampList(list):
    """A list of stamps (or None) whose items read as seconds (indexing, slicing, iteration); what is put
    in is kept as it is. ``raw(i)`` is item ``i`` unread."""

    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        if isinstance(index, slice):
            return [seconds(x) for x in super().__getitem__(index)]
        return seconds(super().__getitem__(index))

    def __iter__(self) -> Iterator[float | None]:
        return (seconds(x) for x in super().__iter__())

    def __reversed__(self) -> Iterator[float | None]:
        return (seconds(x) for x in super().__reversed__())

    def raw(self, index: SupportsIndex) -> Stamp | None:
        return super().__getitem__(index)
