"""The ring's exchange of K/V blocks (and of their gradients) between neighbours (chapter 07).

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context")
stands the ``n`` ranks of a context-parallel group in a ring: at each step rank ``r`` sends the block it
holds to ``r + 1`` and receives the next one from ``r - 1`` (mod ``n``), while it computes with the block it
already has. After ``n - 1`` steps every rank has seen every block. ``ring_exchange`` is one such step:
it posts the transfers and returns at once, with a ``RingTransfer`` whose ``RingTransfer.wait``
hands back the received tensors; the caller computes between the two, which is the overlap of compute and
transfer the paper relies on (a block's attention costs ``O(c^2 d)``, its transfer ``O(c d)``).

Bytes. One exchange of tensors of ``B`` bytes in all makes this rank send exactly ``B`` bytes (and receive
``B``); ``n - 1`` exchanges of a K/V block of ``s/n`` tokens send ``(n - 1)/n`` of the whole sequence's K and
V. One step's sends and receives are posted as **one** ``refimpl.comm.ops.batch_isend_irecv`` group
(the tracer still books, and measures, each ``isend`` / ``irecv`` of it): at ``cp = 2`` the right and the
left neighbour are the same rank, and an unbatched ``irecv`` then ``isend`` on both ranks hangs on NCCL,
which runs a pair's calls in order (each receive waits for a send queued behind the peer's own receive;
Megatron-LM and picotron batch the ring's exchange for this reason). Point-to-point calls address peers by
their **global** rank: the group's ranks are mapped with ``torch.distributed.get_global_rank``. Every
rank posts its groups in the same order, so the ``k``-th message one rank sends to its right is the
``k``-th its right neighbour receives from its left (two groups in flight, the backward's K/V and its
dK/dV, are posted in the same order on every rank).

A rank that never sends does not hang its neighbour: the wait fails after the process group's timeout, and
``RingTransfer.wait`` re-raises it as a one-line ``RuntimeError`` naming the peer and the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size

Group = dist.ProcessGroup | None


def cp_size(group: Group) -> int:
    """Ranks in the context-parallel ``group`` (1 when ``group`` is None and no process group exists)."""
    return group_rank_size(group)[1]


def cp_rank(group: Group) -> int:
    """This rank's index in ``group`` (0 when ``group`` is None and no process group exists)."""
    return group_rank_size(group)[0]


def _global(group: Group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def ring_neighbours(*, group: Group) -> tuple[int, int]:
    """``(right, left)``: the **global** ranks of group ranks ``r + 1`` and ``r - 1`` (mod ``n``)."""
    r, n = cp_rank(group), cp_size(group)
    if r < 0:
        raise ValueError("this rank is not a member of the context-parallel group")
    return _global(group, (r + 1) % n), _global(group, (r - 1) % n)


@dataclass
class RingTransfer:
    """One posted ring step: ``received`` fill in from ``src`` while ``sent`` travel to ``dst``."""

    received: tuple[torch.Tensor, ...]
    sent: tuple[torch.Tensor, ...]
    works: list
    src: int
    dst: int
    step: int

    def wait(self) -> tuple[torch.Tensor, ...]:
        """Block until every send and receive of this step is done; the received tensors, in order."""
        for w in self.works:
            try:
                w.wait()
            except RuntimeError as e:  # gloo / NCCL timeouts and lost peers are RuntimeErrors
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise RuntimeError(f"ring exchange step {self.step}: the block from rank {self.src} (or our "
                                   f"send to rank {self.dst}) did not complete: {first}") from None
        self.works, self.sent = [], ()
        return self.received


def ring_exchange(tensors: Sequence[torch.Tensor], *, group: Group, step: int = 0) -> RingTransfer:
    """Post one ring step: ``isend`` each of ``tensors`` to the right neighbour, ``irecv`` as many tensors of
    the same shapes and dtypes from the left one. Returns at once; ``.wait()`` gives the received tensors.

    ``tensors`` are not modified and must not be modified before ``wait`` returns (they are on the wire).
    ``step`` only labels error messages. This rank sends exactly ``sum(t.nbytes)`` bytes.
    """
    right, left = ring_neighbours(group=group)
    outgoing = [t.contiguous() for t in tensors]
    received = tuple(torch.empty_like(t) for t in outgoing)
    works = ops.batch_isend_irecv([ops.P2POp(dist.irecv, buf, left, group) for buf in received]
                                  + [ops.P2POp(dist.isend, t, right, group) for t in outgoing])  # one group
    return RingTransfer(received=received, sent=tuple(outgoing), works=works, src=left, dst=right, step=step)


__all__ = ["RingTransfer", "cp_rank", "cp_size", "ring_exchange", "ring_neighbours"]
