"""Chapter 02 exercises: the ring collectives, built from ``isend`` and ``irecv`` only.

Grade with ``make grade CH=02`` (or ``python -m exercises.grade 02``). Three tasks:

1. ``ring_reduce_scatter``: rank ``r`` ends with chunk ``r`` of the sum, in ``n - 1`` steps;
2. ``ring_all_gather``: every rank ends with every chunk, in ``n - 1`` steps;
3. ``ring_all_reduce``: the sum everywhere, in place, like ``dist.all_reduce``, in ``2(n - 1)`` steps.

The ring: ``n = dist.get_world_size(group)`` ranks; rank ``r = dist.get_rank(group)`` sends only to
``(r + 1) % n`` and receives only from ``(r - 1) % n``. The tensor, viewed flat (``S`` elements), is cut
into ``n`` chunks as ``torch.tensor_split(flat, n)`` cuts it (sizes differ by at most one element, and
some chunks are empty when ``S < n``); "chunk ``i``" always means that chunk.

Rules (the grader checks them with a tracer, which measures every byte you hand to ``isend``):

* communicate only with the ``isend`` and ``irecv`` imported below (refimpl's traced versions, same
  signatures as ``torch.distributed``'s);
* one ``isend`` per step and no other communication, each step sending one chunk: per phase a rank
  sends every chunk but one, ``(n - 1)/n S`` elements when ``n`` divides ``S``, and exactly the bytes of
  ``refimpl.planner.ring_bytes_sent`` otherwise;
* every length must work, including ``S`` not divisible by ``n`` and ``S < n``, for float and integer
  dtypes; with ``n == 1`` there is nothing to send (and there may be no process group at all).

Traps worth knowing before you start:

* ``isend``/``irecv`` return at once. Until you ``wait()`` on a handle, a received buffer holds garbage
  and a sent tensor must not change. Every rank does the same thing at the same time, so a rank that
  waits for its send to finish before it has posted its receive can wait for ever.
* A received partial sum and the chunk it is added to are not the same memory: receiving straight into
  the chunk you hold overwrites your own contribution.
* With uneven chunks the chunk you send and the chunk you receive at a step have different sizes.
* The textbook schedule leaves the complete sum of chunk ``r`` on some rank other than ``r``; the result
  here must be the layout of ``dist.reduce_scatter_tensor``: chunk ``r`` on rank ``r``.

The checks run your functions on 2 and 3 ranks, on lengths 1, 2, 5, 64 and 1001 and a 2-D tensor, and
compare with ``torch.distributed``. You may ignore ``group`` (the checks use the default group); peers of
a sub-group would be addressed by their global rank (``dist.get_global_rank(group, r)``).
``refimpl/comm/ring.py`` is the solution: do not peek before trying.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)

from refimpl.comm.ops import irecv, isend  # noqa: F401  (you will need them)


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's chunk of the sum over the ranks of ``tensor``, by a ring of ``n - 1`` steps.

    ``tensor``: any shape, the same shape on every rank; it must not be modified. Returns a 1-D tensor
    equal to ``torch.tensor_split(sum_over_ranks(tensor).flatten(), n)[r]`` on rank ``r`` (empty when that
    chunk is). Each partial sum must travel round the ring picking up one rank's contribution per hop.
    """
    raise NotImplementedError("exercise 02.1: ring_reduce_scatter")


def ring_all_gather(shard: torch.Tensor, numel: int, group=None) -> torch.Tensor:
    """The concatenation of every rank's ``shard``: a new 1-D tensor of ``numel`` elements, on every rank.

    Rank ``i``'s ``shard`` is chunk ``i`` of ``torch.tensor_split`` of a ``numel``-element tensor (so the
    shards may differ in size by one, and some may be empty). ``n - 1`` steps; each chunk is forwarded,
    not recomputed, and a received chunk has a place in the output waiting for it.
    """
    raise NotImplementedError("exercise 02.2: ring_all_gather")


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks **in place** and return it (the same object), like
    ``dist.all_reduce(tensor)``: ``2(n - 1)`` sends in all, ``2(n - 1)/n S`` elements per rank when ``n``
    divides ``S``. Any shape; equal to ``dist.all_reduce`` bit for bit on integer data.
    """
    raise NotImplementedError("exercise 02.3: ring_all_reduce")
