"""What pipeline stages send each other (chapter 08): activations forward, their gradients backward, posted
in groups (``refimpl.comm.ops.batch_isend_irecv``, so ``refimpl.comm.CommTracer`` still books and
measures each ``isend`` / ``irecv``), at the boundaries ``.p2p_plan`` chooses so that no schedule can
deadlock on NCCL (which runs a pair's calls in order and completes a send only once its receive is posted).

Shapes are agreed up front: every stage boundary carries a ``[b, s, h]`` tensor of the activation dtype, so a
receiver allocates its buffer without asking. Messages between two ranks in one direction are matched in
order; the plan posts them, per pair, in the order they are sent. ``PostedGroup`` is one posted group:
its ``PostedGroup.wait`` (the executor calls it before its next action computes) hands the received
tensors over and drops the sent ones, so a sent tensor is kept no longer than the action after its send
(a stage output lives on anyway until its backward, which needs it). A peer that never sends fails after
the process group's timeout with a one-line error naming the boundary.

Tied embeddings: ``sync_tied_embeddings`` adds the gradients of the first stage's embedding and of the
last stage's copy with one exchange between their two ranks (``a + b`` on one, ``b + a`` on the other: the
same bits, since floating-point addition commutes), posted as one group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.parallel.pipeline_parallel.schedules import P2PAction

__all__ = ["PostedGroup", "post_group", "sync_tied_embeddings"]

Group = dist.ProcessGroup | None
Message = tuple[str, int, int]  # (activation | grad, producing stage, micro-batch)


def _global(group: Group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def message(t: P2PAction) -> Message:
    """What a transfer carries: ``(activation | grad, producing stage, micro-batch)``."""
    return t.kind.split("_")[1], t.stage, t.microbatch


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # gloo / NCCL timeouts and lost peers
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimeError(f"pipeline {what} did not complete: {first}") from None


class PostedGroup:
    """One posted group of a boundary: the handles, the tensors sent (alive until ``wait``) and the
    buffers being received, by message."""

    def __init__(self, works: list, sent: list[torch.Tensor], received: dict[Message, torch.Tensor],
                 what: str) -> None:
        self.works, self.sent, self.received, self.what = works, sent, received, what

    def wait(self) -> dict[Message, torch.Tensor]:
        """Block until every op of the group is done; the received tensors by message."""
        for w in self.works:
            _wait(w, self.what)
        self.works, self.sent = [], []
        return self.received


def post_group(transfers: list[P2PAction], *, outgoing: Callable[[Message], torch.Tensor],
               shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group: Group,
               what: str) -> PostedGroup | None:
    """Post ``transfers`` (``send_*`` / ``recv_*`` with the peer's pipeline rank) as one group; a send's
    tensor is ``outgoing(message)``, a receive gets a new ``shape`` buffer. None when there is nothing."""
    if not transfers:
        return None
    p2p, sent, received = [], [], {}
    for t in transfers:
        peer = _global(group, t.peer)
        if t.kind.startswith("send"):
            x = outgoing(message(t)).detach().contiguous()
            sent.append(x)
            p2p.append(ops.P2POp(dist.isend, x, peer, group))
        else:
            buf = received[message(t)] = torch.empty(shape, dtype=dtype, device=device)
            p2p.append(ops.P2POp(dist.irecv, buf, peer, group))
    return PostedGroup(ops.batch_isend_irecv(p2p), sent, received, what)


def sync_tied_embeddings(weight: torch.Tensor, *, peer: int, group: Group) -> None:
    """Add this rank's ``weight.grad`` and the peer's (the other end of a tied embedding), in place."""
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    theirs = torch.empty_like(grad)
    works = ops.batch_isend_irecv([ops.P2POp(dist.irecv, theirs, _global(group, peer), group),  # one group:
                                   ops.P2POp(dist.isend, grad.contiguous(), _global(group, peer), group)])
    for w in works:  # (unbatched, a receive first on both ends would hang on NCCL)
        _wait(w, "tied-embedding gradient exchange")
    weight.grad = grad + theirs
