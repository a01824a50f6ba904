"""Chapter 04 exercises: ZeRO, from the partition of a tensor to the gather/free around a unit.

Grade with ``make grade CH=04`` (or ``python -m exercises.grade 04``). Six tasks:

1. ``shard_rows``: which rows of a tensor's dim 0 a rank owns (chunks of ``ceil(rows / N)``).
2. ``sharded_step``: the ZeRO-1/2 step: reduce-scatter the gradients, step the shard, all-gather.
3. ``unshard_`` / ``reshard_``: ZeRO-3's gather before a unit runs and free after it, without breaking the
   tensors autograd saved.
4. ``install_unit_hooks``: ZeRO-3's schedule over a chain of units, around forward *and* backward: each
   unit holds memory only while it computes.
5. ``install_unit_hooks(..., prefetch=True)``: the next unit's gather issued before it is needed.
6. ``rows_of_2d_shard``: which rows of a column-parallel weight a rank holds under ZeRO-3 over tensor
   parallelism (2-D sharding, FSDP + TP).

Make every collective through ``refimpl.comm.ops`` (same signatures as ``torch.distributed``), so that the
grader's tracer sees them. Chapter 04 explains each piece; ``refimpl/parallel/zero/`` is the solution, do
not peek before trying.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)
from torch import nn

from refimpl.comm import ops  # noqa: F401  (you will need it)


def shard_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a tensor with ``rows`` rows (its dim 0) that ``rank`` owns.

    Every rank gets a chunk of ``ceil(rows / world_size)`` rows, in rank order; the last ranks get what is
    left, possibly nothing (``start == end == rows``). This is how ``torch.chunk`` and FSDP2 split:

    >>> [shard_rows(9, r, 4) for r in range(4)]
    [(0, 3), (3, 6), (6, 9), (9, 9)]

    Raise ``ValueError`` if ``rank`` is not in ``[0, world_size)``.
    """
    raise NotImplementedError("exercise 04.1: shard_rows")


def sharded_step(
    params: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
    group: Any = None,
) -> None:
    """One ZeRO-1/2 optimizer step on this rank.

    ``params`` are full parameters whose ``.grad`` holds this rank's *local* gradient (not averaged).
    ``shards[i]`` is this rank's rows of ``params[i]`` (``params[i].detach()[start:end]`` with your
    ``shard_rows``: a view, so changing the shard changes the parameter), and ``optimizer`` was built over
    the shards. For each parameter with a gradient:

    * **reduce-scatter** the gradient so that ``shards[i].grad`` becomes the *mean over ranks* of this
      rank's rows (shape of the shard). ``ops.reduce_scatter_tensor(out, inp)`` needs every rank's chunk to
      have the same size: pad the gradient to ``world_size * chunk`` rows with zeros first;
    * then ``optimizer.step()`` (it updates the shards, hence this rank's rows of the parameters);
    * then **all-gather** the updated rows into every rank's full parameter (again padded:
      ``ops.all_gather_into_tensor`` on chunks of ``chunk`` rows, then drop the padding), and set
      ``shards[i].grad = None``.

    No all-reduce: reduce-scatter + all-gather move exactly what one all-reduce would.
    """
    raise NotImplementedError("exercise 04.2: sharded_step")


def unshard_(
    fulls: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], group: Any = None
) -> None:
    """ZeRO-3, before a unit runs: fill the full parameters ``fulls`` from every rank's ``shards``.

    The full tensors are *the same tensor objects* every time (autograd saved them, or views of them like
    ``weight.t()``, in the forward pass), but their memory was freed by ``reshard_``: their storage has 0
    bytes. So:

    * re-allocate each storage in place: ``t.untyped_storage().resize_(t.numel() * t.element_size())``;
    * all-gather the rows of each parameter (padded as in ``sharded_step``) and write them into the full
      tensor **through** ``t.data`` (``t.data.copy_(...)``): writing to ``t`` itself, even under
      ``torch.no_grad()``, bumps its version counter and the backward pass then refuses the saved tensor
      ("modified by an inplace operation"); assigning ``t.data = new_tensor`` gives ``t`` a new storage
      that the saved views never see.
    """
    raise NotImplementedError("exercise 04.3: unshard_")


def reshard_(fulls: Sequence[torch.Tensor]) -> None:
    """ZeRO-3, after a unit ran: free the full parameters' memory but keep the tensors.

    ``t.untyped_storage().resize_(0)`` for each: the tensor object (and autograd's references to it) stays,
    its bytes are returned.
    """
    raise NotImplementedError("exercise 04.3: reshard_")


def install_unit_hooks(
    units: Sequence[nn.Module], fulls: Sequence[Sequence[torch.Tensor]],
    shards: Sequence[Sequence[torch.Tensor]], group: Any = None, *, prefetch: bool = False,
) -> list:
    """ZeRO-3 over a chain of units: install hooks (module and autograd hooks) that gather and free them.

    ``units[u]`` is the ``u``-th module to run in forward (``units[0]`` first, each used once per forward);
    ``fulls[u]`` are the full parameters registered in its modules, their storage freed (0 bytes) on entry;
    ``shards[u]`` this rank's rows of them, in the same order. Return the hook handles. The contract, for
    every training step (forward of the chain, then backward of a loss of its output):

    * while unit ``u``'s forward computes, its full parameters hold their true values, and no other unit
      holds memory; with ``prefetch=True`` unit ``u + 1`` (if any) is gathered too, and no other;
    * after the forward of the chain no unit holds memory;
    * while unit ``u``'s backward computes, it is gathered and no other unit is; with ``prefetch=True``
      unit ``u - 1`` (if any) is gathered too;
    * after backward no unit holds memory, and every full parameter's ``.grad`` is this rank's local
      gradient (no reduction in this exercise);
    * every unit is all-gathered exactly twice per step, prefetch or not, through your ``unshard_`` (so
      through ``refimpl.comm.ops``); the hooks keep working step after step.

    Traps: a module's forward hooks run again every forward, but an autograd hook on a tensor lives as long
    as that tensor: whatever you attach to an output belongs to that step only. The gradient of a unit's
    output arrives before any gradient of its parameters; a unit is done when *all* its parameters have
    their gradient, not the first. A prefetched unit is already gathered when its turn comes.
    """
    raise NotImplementedError("exercise 04.4: install_unit_hooks")


def rows_of_2d_shard(out_features: int, *, tp_rank: int, tp_size: int, dp_rank: int,
                     dp_size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a column-parallel weight ``[out_features, in]`` that the rank at ``tp_rank``
    of its tensor-parallel group and ``dp_rank`` of its data-parallel group holds under ZeRO-3 over tensor
    parallelism (2-D sharding, chapter 04 section 7), in row numbers of the **full** weight.

    Tensor parallelism gives each tp rank a block of the output rows; ZeRO-3 then shards, over the
    ``dp_size`` ranks of the dp group, the tensor that tp rank holds, along the same dim 0. Both cut as
    ``shard_rows`` does (chunks of ``ceil(rows / n)`` rows in rank order, the last ones smaller, possibly
    empty). An empty shard is ``(e, e)``, ``e`` the end of the tp rank's block:

    >>> [rows_of_2d_shard(8, tp_rank=t, tp_size=2, dp_rank=d, dp_size=2) for t in range(2) for d in range(2)]
    [(0, 2), (2, 4), (4, 6), (6, 8)]

    Trap: when the rows divide evenly, several wrong rules give these same answers. Raise ``ValueError``
    if ``tp_rank`` or ``dp_rank`` lies outside its group.
    """
    raise NotImplementedError("exercise 04.6: rows_of_2d_shard")
