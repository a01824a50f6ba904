"""``torch.distributed`` calls as refimpl makes them: the same signatures, recorded by :class:`CommTracer`.

Every collective and point-to-point call in refimpl goes through this module, so a tracer sees all of
the library's calls (chapter 02). The payload of each call is measured from the tensors handed to it; the
bytes a point-to-point call sends are measured too (the tensor itself), those of a collective are the ring
model (:func:`refimpl.comm.tracer.wire_bytes`): the backend does not say what it sends. Without an
active tracer each function is the plain ``torch.distributed`` call. An async call (``async_op=True``,
``isend``, ``irecv``) returns a :class:`TracedWork` whose ``wait()`` stamps the end time of its event.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.comm.tracer import P2P_OPS, CommEvent, active_tracers, now, wire_bytes

ReduceOp = dist.ReduceOp
# torch 2.13 renamed the flat-tensor forms (the old names warn); older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TracedWork:
    """A ``torch.distributed.Work`` whose ``wait()`` records when the op was seen complete."""

    def __init__(self, work: dist.Work, events: list[CommEvent]) -> None:
        self.work = work
        self.events = events

    def wait(self, timeout=None) -> bool:
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        t = now()
        for e in self.events:
            if e.end is None:
                e.end = t
        return ok

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self):
        return self.work.get_future()


def _call(op: str, payload: int, group, peer, async_op: bool, fn):
    tracers = active_tracers()
    if not tracers:
        return fn()
    n = dist.get_world_size(group)
    measured = op in P2P_OPS
    if measured:  # a send puts exactly its tensor on the wire, a receive sends nothing
        sent = float(payload) if op in ("send", "isend") else 0.0
    else:         # the backend does not tell: book the ring model
        sent = wire_bytes(op, payload, n)
    start = now()
    events = [
        CommEvent(op=op, nbytes=payload, wire_bytes=sent, group_size=n, peer=peer, start=start, end=None,
                  step=t.current_step, async_op=async_op, measured=measured,
                  group_id=None if group is None else id(group))
        for t in tracers
    ]
    result = fn()
    if async_op:
        result = TracedWork(result, events) if result is not None else None
    else:
        end = now()
        for e in events:
            e.end = end
    for t, e in zip(tracers, events, strict=True):
        t.record(e)
    return result


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _call("all_reduce", _nbytes(tensor), group, None, async_op,
                 lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    return _call("reduce_scatter", _nbytes(input), group, None, async_op,
                 lambda: _reduce_scatter(output, input, op=op, group=group, async_op=async_op))


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    return _call("all_gather", _nbytes(output), group, None, async_op,
                 lambda: _all_gather(output, input, group=group, async_op=async_op))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    """List form, for shards of unequal size."""
    return _call("all_gather", sum(_nbytes(t) for t in tensor_list), group, None, async_op,
                 lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    return _call("broadcast", _nbytes(tensor), group, src, async_op,
                 lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _call("reduce", _nbytes(tensor), group, dst, async_op,
                 lambda: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    return _call("all_to_all", _nbytes(input), group, None, async_op,
                 lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op))


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    _call("send", _nbytes(tensor), group, dst, False, lambda: dist.send(tensor, dst=dst, group=group))


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    _call("recv", _nbytes(tensor), group, src, False, lambda: dist.recv(tensor, src=src, group=group))


def isend(tensor: torch.Tensor, dst: int, group=None):
    """Non-blocking send. On gloo use plain isend/irecv, not batch_isend_irecv (it can hang on CPU)."""
    return _call("isend", _nbytes(tensor), group, dst, True, lambda: dist.isend(tensor, dst=dst, group=group))


def irecv(tensor: torch.Tensor, src: int, group=None):
    return _call("irecv", _nbytes(tensor), group, src, True, lambda: dist.irecv(tensor, src=src, group=group))


def barrier(group=None) -> None:
    _call("barrier", 0, group, None, False, lambda: dist.barrier(group=group))
