"""``torch.distributed`` calls as refimpl makes them: the same signatures, recorded by ``CommTracer``.

Every collective and point-to-point call in refimpl goes through this module, so a tracer sees all of
the library's calls (chapter 02). The payload of each call is measured from the tensors handed to it; the
bytes a point-to-point call sends are measured too (the tensor itself), those of a collective are the ring
model (``refimpl.comm.tracer.wire_bytes``): the backend does not say what it sends. Without an
active tracer each function is the plain ``torch.distributed`` call. An async call (``async_op=True``,
``isend``, ``irecv``, ``batch_isend_irecv``) returns ``TracedWork`` s whose ``wait()`` stamps the end
time of their events (device time on CUDA: ``TracedWork``).

Point-to-point and NCCL (chapters 02, 07, 08). NCCL runs a pair's point-to-point calls in order on one
stream, and an unbatched send or receive completes only once the peer has posted its match. A pair of ranks
that both post ``irecv`` then ``isend`` to each other therefore hangs on GPUs: each receive waits for a send
queued behind the peer's own receive (gloo, which runs each call on its own, never shows it). The rule: a
paired exchange is posted as **one** ``batch_isend_irecv`` of ``P2POp`` s (NCCL fuses the group,
its sends and receives progress together; Megatron-LM and picotron do the same), and sends whose receive
the peer posts at another time go out in an order both ranks' programs agree on (the pipeline executor's
rounds). On gloo (torch 2.13) ``batch_isend_irecv`` runs each op as its own async call, which is fine.

**Strict point-to-point mode** (``REFIMPL_STRICT_P2P=1`` in the environment, read at every call, so it
reaches forked ranks and torchrun's children; ``strict_p2p`` says whether it is on): every plain
``isend``/``irecv`` waits for its own completion before it returns, which is NCCL's unbatched behaviour
made visible on gloo (a gloo send completes when the peer has posted the receive); a
``batch_isend_irecv`` group is posted whole and then its handles are waited, before it returns, as
NCCL runs the fused group before anything queued behind it. Code that finishes under strict mode on gloo
does not deadlock on NCCL for that reason; code that only works because gloo lets calls overtake each
other hangs (tests/ranks/cli/serial/test_p2p_strict.py, a negative control included). Strict mode adds no
state: the environment is the switch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from refimpl.comm.device_clock import raw_stamp
from refimpl.comm.tracer import P2P_OPS, CommEvent, active_tracers, now, wire_bytes

ReduceOp = dist.ReduceOp
P2POp = dist.P2POp  # P2POp(dist.isend | dist.irecv, tensor, peer (global rank), group), for batch_isend_irecv
STRICT_P2P_ENV = "REFIMPL_STRICT_P2P"
# torch 2.13 renamed the flat-tensor forms (the old names warn); older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TracedWork:
    """A ``torch.distributed.Work`` whose ``wait()`` stamps the end of its events. Waiting twice returns
    at once the second time (a gloo send or receive waited twice would wait for another one).

    The end is a stamp of ``refimpl.comm.tracer.now`` taken after ``work.wait()``: on gloo the CPU
    has waited, so ``perf_counter`` then is the completion; on NCCL ``wait()`` only makes the current
    stream wait for the collective and returns at once, and the stamp is a CUDA event recorded on that
    stream after the wait, which completes when the collective has (read after a synchronize)."""

    def __init__(self, work: dist.Work, events: list[CommEvent]) -> None:
        self.work = work
        self.events = events
        self.done = False

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        self.done = True
        t = now()  # after the wait: on CUDA the current stream reaches it once the collective is done
        for e in self.events:
            if raw_stamp(e, "end") is None:  # unread: reading a CUDA stamp here would synchronize
                e.end = t
        return ok

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self):
        return self.work.get_future()


def strict_p2p() -> bool:
    """Whether strict point-to-point mode is on (``REFIMPL_STRICT_P2P=1``; module docstring)."""
    return os.environ.get(STRICT_P2P_ENV, "0") not in ("", "0")


def _events(tracers, op: str, payload: int, group, peer, async_op: bool, *, batched: bool = False,
            wire: float | None = None):
    n = dist.get_world_size(group)
    measured = op in P2P_OPS
    if measured:  # a send puts exactly its tensor on the wire, a receive sends nothing
        sent = float(payload) if op in ("send", "isend") else 0.0
    elif wire is not None:  # the caller knows what leaves this rank (an all-to-all's rows for other ranks)
        sent = float(wire)
    else:         # the backend does not tell: book the ring model
        sent = wire_bytes(op, payload, n)
    start = now()  # posted: on CUDA the collective's stream starts no earlier than the current one is here
    return [CommEvent(op=op, nbytes=payload, wire_bytes=sent, group_size=n, peer=peer, start=start, end=None,
                      step=t.current_step, async_op=async_op, measured=measured, batched=batched,
                      group_id=None if group is None else id(group))
            for t in tracers]


def _call(op: str, payload: int, group, peer, async_op: bool, fn, *, sent: torch.Tensor | None = None,
          wire: float | None = None):
    tracers = active_tracers()
    if not tracers:
        return fn()
    for t in tracers:
        if sent is not None and t.on_send is not None:
            t.on_send(sent)
    events = _events(tracers, op, payload, group, peer, async_op, wire=wire)
    result = fn()
    if async_op:
        result = TracedWork(result, events) if result is not None else None
    else:  # returned: on NCCL the current stream was made to wait, so its stamp here is the completion
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


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None, async_op: bool = False):
    """Rows of ``input`` (dim 0) to every rank of ``group``, equal blocks or ``input_split_sizes`` (uneven
    and zero sizes work on gloo and NCCL). With split sizes the wire bytes are exact, not the ring model:
    every row but those this rank keeps leaves it (chapter 09)."""
    wire = None
    if input_split_sizes is not None:
        me = dist.get_rank(group)
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        wire = (input.shape[0] - input_split_sizes[me]) * row
    return _call("all_to_all", _nbytes(input), group, None, async_op,
                 lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                group=group, async_op=async_op), wire=wire)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    _call("send", _nbytes(tensor), group, dst, False, lambda: dist.send(tensor, dst=dst, group=group),
          sent=tensor)


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    _call("recv", _nbytes(tensor), group, src, False, lambda: dist.recv(tensor, src=src, group=group))


def isend(tensor: torch.Tensor, dst: int, group=None):
    """Non-blocking send of ``tensor`` to global rank ``dst``. Unbatched: pair it with the peer's receive
    by order (module docstring); under strict mode it returns only once the peer has received it."""
    work = _call("isend", _nbytes(tensor), group, dst, True, lambda: dist.isend(tensor, dst=dst, group=group),
                 sent=tensor)
    return _strict_wait([work])[0]


def irecv(tensor: torch.Tensor, src: int, group=None):
    """Non-blocking receive into ``tensor`` from global rank ``src``; under strict mode it returns only once
    the tensor has arrived."""
    work = _call("irecv", _nbytes(tensor), group, src, True, lambda: dist.irecv(tensor, src=src, group=group))
    return _strict_wait([work])[0]


def _strict_wait(works: list) -> list:
    """Under strict mode: wait for ``works`` now, and hand back handles whose ``wait()`` returns at once."""
    if not strict_p2p():
        return works
    works = [w if w is None or isinstance(w, TracedWork) else TracedWork(w, []) for w in works]
    for w in works:
        if w is not None:
            w.wait()
    return works


def batch_isend_irecv(p2p_ops: list[P2POp]) -> list[TracedWork | dist.Work]:
    """Post ``p2p_ops`` (``P2POp`` s of ``dist.isend`` / ``dist.irecv``, one process group) as one
    group, like ``dist.batch_isend_irecv``; returns its handles. The tracer books one ``isend`` / ``irecv``
    event per op (``batched=True``): a send's ``wire_bytes`` its tensor's bytes, measured, a receive's 0.
    On NCCL the group is one fused launch, so its sends and receives progress together: a paired exchange
    posted this way cannot deadlock. Ops between one pair in one direction match in list order. Under
    strict mode the group is posted whole, then its handles are waited before this returns."""
    if not p2p_ops:
        return []
    tracers = active_tracers()
    events: list[list[CommEvent]] = []
    for p in p2p_ops:
        op = "isend" if p.op is dist.isend else "irecv"
        if op == "isend":
            for t in tracers:
                if t.on_send is not None:
                    t.on_send(p.tensor)
        group = None if p.group is dist.group.WORLD else p.group  # P2POp fills in the default group
        events.append(_events(tracers, op, _nbytes(p.tensor), group, p.peer, True, batched=True)
                      if tracers else [])
    works = dist.batch_isend_irecv(p2p_ops)
    if not tracers:
        return _strict_wait(works)
    for t, evs in zip(tracers, zip(*events, strict=True), strict=True):
        for e in evs:
            t.record(e)
    if len(works) == len(p2p_ops):  # one handle per op (gloo)
        traced = [TracedWork(w, evs) for w, evs in zip(works, events, strict=True)]
    else:                           # one coalesced handle for the group (NCCL)
        traced = [TracedWork(w, [e for evs in events for e in evs]) for w in works]
    return _strict_wait(traced)


def barrier(group=None) -> None:
    _call("barrier", 0, group, None, False, lambda: dist.barrier(group=group))
