"""What pipeline stages send each other (chapter 08): activations forward, their gradients backward, with
plain ``isend`` / ``irecv`` from :mod:`refimpl.comm.ops` (so :class:`refimpl.comm.CommTracer` counts them;
never ``batch_isend_irecv``, which can hang on gloo).

Shapes are agreed up front: every stage boundary carries a ``[b, s, h]`` tensor of the activation dtype, so a
receiver allocates its buffer without asking. Messages between two ranks are matched in order (gloo and NCCL
deliver the messages of one pair first in, first out): the schedules of :mod:`.schedules` post, per pair, the
receives in the order the sends were made, which the simulator (:mod:`.simulator`) checks. Sends do not block
the sender: a stage output's send is waited for at the backward of its micro-batch (its gradient came back, so
the next stage used it long ago), so a rank holds the outputs of its micro-batches in flight only; an input
gradient's send at the end of the step (no later action of this rank depends on its peer having it). Receives
block the action that needs them, and a peer that never sends fails after the process group's timeout with a
one-line error naming the action.

Tied embeddings: :func:`sync_tied_embeddings` adds the gradients of the first stage's embedding and of the
last stage's copy with one exchange between their two ranks (``a + b`` on one, ``b + a`` on the other: the
same bits, since floating-point addition commutes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.comm import ops

__all__ = ["PendingSends", "recv_tensor", "send_tensor", "sync_tied_embeddings"]

Group = dist.ProcessGroup | None


def _global(group: Group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class PendingSends:
    """The sends of one step in flight (their tensors must stay alive until sent): :meth:`release` one by
    its key once the peer has certainly received it, :meth:`wait` for the rest at the end of the step."""

    def __init__(self) -> None:
        self._works: dict[object, tuple[object, torch.Tensor, str]] = {}

    def add(self, work: object, tensor: torch.Tensor, what: str, *, key: object | None = None) -> None:
        self._works[key if key is not None else object()] = (work, tensor, what)

    def release(self, key: object) -> None:
        """Wait for the send under ``key`` (done already when the caller knows the peer used it) and drop
        the reference to its tensor."""
        work, _, what = self._works.pop(key)
        _wait(work, what)

    def wait(self) -> None:
        for work, _, what in self._works.values():
            _wait(work, what)
        self._works.clear()


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # gloo / NCCL timeouts and lost peers
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimeError(f"pipeline {what} did not complete: {first}") from None


def send_tensor(tensor: torch.Tensor, *, peer: int, group: Group, pending: PendingSends, what: str,
                key: object | None = None) -> None:
    """Post the send of ``tensor`` to pipeline rank ``peer`` (a group rank); waited for in ``pending``
    (under ``key``, to release it early)."""
    t = tensor.detach().contiguous()
    pending.add(ops.isend(t, dst=_global(group, peer), group=group), t, what, key=key)


def recv_tensor(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device, peer: int, group: Group,
                what: str) -> torch.Tensor:
    """Receive a ``shape`` tensor from pipeline rank ``peer`` (blocking, with the group's timeout)."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    _wait(ops.irecv(buf, src=_global(group, peer), group=group), what)
    return buf


def sync_tied_embeddings(weight: torch.Tensor, *, peer: int, group: Group) -> None:
    """Add this rank's ``weight.grad`` and the peer's (the other end of a tied embedding), in place."""
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    theirs = torch.empty_like(grad)
    works = [ops.irecv(theirs, src=_global(group, peer), group=group),
             ops.isend(grad.contiguous(), dst=_global(group, peer), group=group)]
    for w in works:
        _wait(w, "tied-embedding gradient exchange")
    weight.grad = grad + theirs
