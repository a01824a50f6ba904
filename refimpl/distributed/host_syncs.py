"""Counting the device-to-host synchronisations of a piece of code, on CPU (chapters 09 and 12).

On a GPU the host only enqueues kernels; it waits for the device when it needs a value the device computes:
``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``, and every operator whose
**output shape depends on the data** (``nonzero``, a boolean mask index, ``masked_select``, ``bincount``
(it reads the ids' maximum to size its output), ``unique``, ``repeat_interleave`` without ``output_size``).
Each one drains the stream: the host stops enqueueing, the GPU runs dry, and the next kernels start late.
``torch.cuda.set_sync_debug_mode("warn")`` reports them on CUDA; on CPU nothing synchronises, so
``HostSyncCounter`` counts the calls that *would*: a ``TorchDispatchMode`` sees every aten operator
(forward and backward) and names the data-dependent ones, and ``Tensor.tolist`` / ``.cpu`` / ``.numpy``
(which do not go through the dispatcher on CPU) are wrapped while it is active.

A tensor made from Python data (``torch.tensor(list, device=...)``, the ``lift_fresh`` operator) is counted
apart as ``host tensor``: on a GPU it is a blocking host-to-device copy (ATen's non-blocking-free copy
synchronises the stream), not a device-to-host read, but as costly in a hot loop.

Used by tests/ranks/test_expert_parallel.py and tests/ranks/test_moe_model.py to hold an MoE layer to its
budget of host syncs per micro-batch; ``sync_name`` is also the device lint's definition of a sync
(``refimpl.distributed.device_lint``: the trainer's syncs per step). For CPU runs: on CUDA a ``.cpu()``
is counted twice (the call and its copy).
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MAY_SYNC", "HostSyncCounter", "SyncEvent", "sync_name"]

aten = torch.ops.aten

_DATA_DEPENDENT = {  # aten overload packet -> the name reported
    aten._local_scalar_dense: "item",  # .item(), int(t), float(t), bool(t)
    aten.nonzero: "nonzero",
    aten.masked_select: "masked_select",
    aten.bincount: "bincount",
    aten._unique2: "unique",
    aten.unique_dim: "unique",
    aten.unique_consecutive: "unique",
    aten.equal: "equal",
}
MAY_SYNC = frozenset({*_DATA_DEPENDENT, aten.repeat_interleave, aten.index, aten.index_put, aten.index_put_,
                      aten._to_copy, aten.lift_fresh})
"""The overload packets ``sync_name`` may name (a cheap first test for a caller that sees every op)."""
_WRAPPED = ("tolist", "cpu", "numpy")
_HERE = str(Path(__file__).resolve())
_ROOT = str(Path(__file__).resolve().parents[1])  # refimpl/


@dataclass(frozen=True)
class SyncEvent:
    """One synchronising call: ``what`` (``item``, ``tolist``, ``bincount``, ...) and ``where`` (the
    innermost ``refimpl`` frame, ``file.py:line``, or the innermost frame outside torch)."""

    what: str
    where: str


def _bool_index(indices) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


# a dispatch over the ops that synchronise: one return per kind
def sync_name(func, args, kwargs) -> str | None:  # noqa: PLR0911
    """The reported name when ``func(*args, **kwargs)`` would synchronise on a GPU, else None."""
    packet = func.overloadpacket
    if packet in _DATA_DEPENDENT:
        return _DATA_DEPENDENT[packet]
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
        return "repeat_interleave"
    if packet is aten.index and _bool_index(args[1]):
        return "bool index"
    if packet in (aten.index_put, aten.index_put_) and _bool_index(args[1]):
        return "bool index_put"
    if packet is aten._to_copy and kwargs.get("device") is not None and kwargs["device"].type == "cpu":
        return "to cpu"
    if packet is aten.lift_fresh:
        return "host tensor"
    return None


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if f.filename != _HERE]
    ours = [f for f in frames if f.filename.startswith(_ROOT)]
    outside_torch = [f for f in frames if "/torch/" not in f.filename]
    frame = (ours or outside_torch or frames)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}"


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as c: ...`` records ``SyncEvent`` s in ``c.events`` (module
    docstring); ``c.count`` their number, ``c.by_place()`` a ``Counter`` of ``"what @ where"``.
    ``host_tensors=False`` leaves ``torch.tensor(...)`` out of the count (it is no device-to-host read)."""

    def __init__(self, *, host_tensors: bool = True) -> None:
        super().__init__()
        self.host_tensors = host_tensors
        self.events: list[SyncEvent] = []
        self._saved: dict[str, object] = {}

    @property
    def count(self) -> int:
        return len(self.events)

    def by_place(self) -> Counter:
        return Counter(f"{e.what} @ {e.where}" for e in self.events)

    def _record(self, what: str) -> None:
        if what != "host tensor" or self.host_tensors:
            self.events.append(SyncEvent(what, _where()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = sync_name(func, args, kwargs)
        if name is not None:
            self._record(name)
        return func(*args, **kwargs)

    def _wrap(self, name: str):
        original = getattr(torch.Tensor, name)

        def wrapped(tensor, *args, **kwargs):
            self._record(name)
            return original(tensor, *args, **kwargs)

        return wrapped

    def __enter__(self) -> HostSyncCounter:
        for name in _WRAPPED:  # what torch.Tensor itself defines (else inherited from TensorBase)
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name))
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for name, own in self._saved.items():
                if own is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, own)
            self._saved.clear()
