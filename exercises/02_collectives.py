"""Chapter 02 exercises: the ring all-reduce, built from ``isend`` and ``irecv`` only.

Grade with ``make grade CH=02`` (or ``python -m exercises.grade 02``). Three tasks:

1. ``ring_reduce_scatter``: ``n - 1`` steps; rank ``r`` ends with chunk ``r`` of the sum.
2. ``ring_all_gather``: ``n - 1`` steps; every rank ends with every chunk.
3. ``ring_all_reduce``: both phases, in place, like ``dist.all_reduce``.

The ring: ``n = dist.get_world_size(group)`` ranks, rank ``r = dist.get_rank(group)`` sends to ``(r + 1) % n``
and receives from ``(r - 1) % n``. The tensor, viewed flat (``S`` elements), is cut into ``n`` chunks with
``torch.tensor_split(flat, n)``: views, of sizes that differ by at most one, some empty when ``S < n``.

Rules (the grader checks them with a tracer):

* communicate only with the ``isend`` and ``irecv`` imported below (refimpl's traced versions, same
  signatures as ``torch.distributed``'s); each returns a handle: ``wait()`` on it before you read the
  received buffer or change the sent one;
* one ``isend`` per step, so ``n - 1`` per phase, and no other communication: a rank then sends exactly
  ``(n - 1)/n S`` elements per phase when ``n`` divides ``S``;
* every length must work, including ``S`` not divisible by ``n`` and ``S < n``;
* with ``n == 1`` there is nothing to send (and there may be no process group at all).

The checks run your functions on 2 and 3 ranks and compare with ``torch.distributed``. You may ignore
``group`` (the checks use the default group); peers in a sub-group are addressed by their global rank
(``dist.get_global_rank(group, r)``), see ``refimpl/comm/ring.py``, the solution: do not peek before trying.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)

from refimpl.comm.ops import irecv, isend  # noqa: F401  (you will need them)


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Return this rank's chunk of the sum over the ranks of ``tensor``; do not modify ``tensor``.

    Work on a flat copy cut into ``chunks = list(torch.tensor_split(work, n))``. At step ``s = 0 .. n-2``
    rank ``r`` sends ``chunks[(r - s - 1) % n]`` to the right and receives, from the left, a partial sum of
    chunk ``(r - s - 2) % n`` into a fresh buffer, which it adds to its own ``chunks[(r - s - 2) % n]``.
    After the last step ``chunks[r]`` is complete: return it, a 1-D tensor equal to
    ``torch.tensor_split(sum_over_ranks(tensor).flatten(), n)[r]``.
    """
    raise NotImplementedError("exercise 02.1: ring_reduce_scatter")


def ring_all_gather(shard: torch.Tensor, numel: int, group=None) -> torch.Tensor:
    """Return the concatenation of every rank's ``shard``: a new 1-D tensor of ``numel`` elements.

    Rank ``i``'s shard is chunk ``i`` of ``torch.tensor_split`` of a ``numel``-element tensor. Allocate the
    output, cut it into chunks (views), copy ``shard`` into ``chunks[r]``; at step ``s = 0 .. n-2`` send
    ``chunks[(r - s) % n]`` to the right and receive ``chunks[(r - s - 1) % n]`` from the left, straight into
    its place in the output.
    """
    raise NotImplementedError("exercise 02.2: ring_all_gather")


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks **in place** and return it, like ``dist.all_reduce(tensor)``.

    A ring reduce-scatter followed by a ring all-gather on the chunks of ``tensor`` itself (its flat view):
    ``2(n - 1)`` ``isend`` calls in all, ``2(n - 1)/n S`` elements sent per rank.
    """
    raise NotImplementedError("exercise 02.3: ring_all_reduce")
