"""Ring reduce-scatter, all-gather and all-reduce built from ``isend``/``irecv`` only (chapter 02).

The ranks of a group of size ``n`` stand in a ring: rank ``r`` sends to ``r + 1`` and receives from
``r - 1`` (mod ``n``). The tensor, viewed flat with ``S`` elements, is cut into ``n`` contiguous chunks by
``torch.tensor_split`` (sizes ``ceil(S/n)`` for the first ``S mod n`` chunks, ``floor(S/n)`` for the
rest, so any length works, even ``S < n``: some chunks are then empty).

* **Reduce-scatter**, ``n - 1`` steps. At step ``s`` rank ``r`` sends its partial sum of chunk
  ``(r - s - 1) mod n`` and receives chunk ``(r - s - 2) mod n``, which it adds to its own copy. A partial
  sum travels once round the ring, picking up one rank's contribution per hop; after the last step rank
  ``r`` holds chunk ``r`` summed over all ranks.
* **All-gather**, ``n - 1`` steps. At step ``s`` rank ``r`` sends chunk ``(r - s) mod n`` (the one it got at
  the previous step, its own at step 0) and receives chunk ``(r - s - 1) mod n``.
* **All-reduce** = reduce-scatter then all-gather: ``2(n - 1)`` steps.

Cost. Each step a rank sends one chunk, so over a reduce-scatter it sends every chunk but its own:
``S - c_r`` elements, ``(n - 1)/n S`` when ``n`` divides ``S``; all-gather the same; all-reduce
``2(n - 1)/n S`` per rank, within a factor ``2(n - 1)/n < 2`` of the tensor itself whatever ``n`` is. Every
link carries the same load at the same time, which makes the ring bandwidth-optimal (Patarasuk & Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009; brought to deep
learning by Baidu's "ring-allreduce", Gibiansky 2017, then Horovod and NCCL). Under the alpha-beta model
(``refimpl.planner.time_model``) the time is ``2(n - 1) alpha + 2(n - 1)/n S / beta``: the latency term
grows with ``n``, which is why small messages prefer trees. ``naive_all_reduce`` is the lesson's
foil: everything through rank 0, which sends ``(n - 1) S`` bytes, growing with ``n``.

Each step's send to the right and receive from the left are posted as **one**
``refimpl.comm.ops.batch_isend_irecv`` group: at ``n = 2`` the right and the left neighbour are the same
rank, and an unbatched ``irecv`` then ``isend`` on both would hang on NCCL, which runs a pair's calls in
order (each receive waits for a send queued behind the peer's own receive; strict mode,
``refimpl.comm.ops``, shows it on gloo). A ``CommTracer`` books each op of the group as an ``isend``
/ ``irecv`` with its bytes measured from the tensors (chapter 02 compares that measurement with the formulas
above).
Only the sum is implemented; a mean is ``sum / n``. ``group`` is a process group (default: the world);
peers are addressed by their *global* rank, as ``torch.distributed`` point-to-point calls require.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.comm import ops

__all__ = [
    "chunk_sizes",
    "naive_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
]


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Sizes of the ``n`` chunks ``torch.tensor_split`` cuts ``numel`` elements into (longer first)."""
    q, rem = divmod(numel, n)
    return [q + 1 if i < rem else q for i in range(n)]


def _rank_and_size(group) -> tuple[int, int]:
    """(this rank's rank in ``group``, group size); (0, 1) when there is no process group at all."""
    if group is None and not dist.is_initialized():
        return 0, 1
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the group")
    return rank, n


def _global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (p2p calls take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _exchange(send: torch.Tensor, recv: torch.Tensor, *, right: int, left: int, group) -> None:
    """One ring step: ``send`` to ``right`` and ``recv`` from ``left`` as one group, waited."""
    for w in ops.batch_isend_irecv([ops.P2POp(dist.isend, send, right, group),
                                    ops.P2POp(dist.irecv, recv, left, group)]):
        w.wait()


def _ring_reduce_scatter_(chunks: list[torch.Tensor], rank: int, n: int, group) -> None:
    """In place on ``chunks`` (n contiguous views): afterwards ``chunks[rank]`` is the sum over the ring."""
    right, left = _global_rank(group, (rank + 1) % n), _global_rank(group, (rank - 1) % n)
    for s in range(n - 1):
        send_i, recv_i = (rank - s - 1) % n, (rank - s - 2) % n
        buf = torch.empty_like(chunks[recv_i])                    # (c_recv,)
        _exchange(chunks[send_i], buf, right=right, left=left, group=group)  # send: (c_send,) partial sum
        chunks[recv_i] += buf                                     # add our contribution, pass it on next step


def _ring_all_gather_(chunks: list[torch.Tensor], rank: int, n: int, group) -> None:
    """In place on ``chunks``: rank ``r`` starts with ``chunks[r]`` valid and ends with all of them."""
    right, left = _global_rank(group, (rank + 1) % n), _global_rank(group, (rank - 1) % n)
    for s in range(n - 1):
        send_i, recv_i = (rank - s) % n, (rank - s - 1) % n
        _exchange(chunks[send_i], chunks[recv_i], right=right, left=left, group=group)  # recv: in place


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's chunk of the sum over the group of ``tensor`` (viewed flat, cut by ``tensor_split``).

    ``tensor``: any shape, ``S`` elements, the same shape on every rank; it is not modified. Returns a new
    1-D tensor of ``chunk_sizes(S, n)[rank]`` elements: ``torch.tensor_split(sum_r tensor_r.flatten(),
    n)[rank]``. ``n - 1`` steps; this rank sends ``S - c_rank`` elements. Chapter 02.
    """
    rank, n = _rank_and_size(group)
    work = tensor.detach().flatten().clone()                      # (S,) our working copy
    chunks = list(torch.tensor_split(work, n))                    # n x (c_i,) views into work
    if n > 1:
        _ring_reduce_scatter_(chunks, rank, n, group)
    return chunks[rank]


def ring_all_gather(shard: torch.Tensor, numel: int, group=None) -> torch.Tensor:
    """The concatenation over the group of every rank's ``shard``: a new 1-D tensor of ``numel`` elements.

    Rank ``i``'s shard must have ``chunk_sizes(numel, n)[i]`` elements (the chunks of
    ``torch.tensor_split(x, n)`` for ``x`` of ``numel`` elements), so the result is ``x`` on every rank.
    ``n - 1`` steps; this rank sends ``numel - c_(rank + 1)`` elements. Chapter 02.
    """
    rank, n = _rank_and_size(group)
    sizes = chunk_sizes(numel, n)
    if shard.numel() != sizes[rank]:
        raise ValueError(f"rank {rank} of {n}: shard has {shard.numel()} elements, expected {sizes[rank]} "
                         f"(chunk {rank} of tensor_split({numel}, {n}))")
    out = torch.empty(numel, dtype=shard.dtype, device=shard.device)  # (S,)
    chunks = list(torch.tensor_split(out, n))                      # n x (c_i,) views into out
    chunks[rank].copy_(shard.reshape(-1))
    if n > 1:
        _ring_all_gather_(chunks, rank, n, group)
    return out


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the group in place, like ``dist.all_reduce(tensor)``; returns ``tensor``.

    Ring reduce-scatter then ring all-gather on the flattened tensor: ``2(n - 1)`` steps, and this rank
    sends ``2(n - 1)/n S`` elements when ``n`` divides ``S`` (exactly
    ``refimpl.planner.ring_bytes_sent``). Equal to
    ``dist.all_reduce`` bit for bit on integer-valued data; on floats up to the order of the additions
    (each chunk is summed in ring order starting at a different rank). Chapter 02.
    """
    rank, n = _rank_and_size(group)
    if n == 1:
        return tensor
    flat = tensor.detach().reshape(-1)           # (S,) a view of tensor when it is contiguous, else a copy
    chunks = list(torch.tensor_split(flat, n))   # n x (c_i,) views into flat
    _ring_reduce_scatter_(chunks, rank, n, group)  # chunks[rank] is now the sum
    _ring_all_gather_(chunks, rank, n, group)      # every chunk is the sum
    if not tensor.is_contiguous():
        tensor.detach().copy_(flat.view(tensor.shape))
    return tensor


def naive_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce through rank 0 of the group, from ``send``/``recv``: the baseline the ring beats.

    Every other rank sends its whole tensor to rank 0, which sums them and sends the result back to each:
    rank 0 receives and sends ``(n - 1) S`` bytes (growing with ``n``), the others ``S`` each, and the
    ``2(n - 1)`` transfers all queue at rank 0. In place, returns ``tensor``. Chapter 02.
    """
    rank, n = _rank_and_size(group)
    if n == 1:
        return tensor
    root = _global_rank(group, 0)
    flat = tensor.detach().reshape(-1)  # (S,) a view of tensor when it is contiguous, else a copy
    if rank == 0:
        buf = torch.empty_like(flat)
        for src in range(1, n):                        # reduce: in rank order, so the sum is deterministic
            ops.recv(buf, src=_global_rank(group, src), group=group)
            flat += buf
        for dst in range(1, n):                        # broadcast the sum back
            ops.send(flat, dst=_global_rank(group, dst), group=group)
    else:
        ops.send(flat, dst=root, group=group)
        ops.recv(flat, src=root, group=group)
    if not tensor.is_contiguous():
        tensor.detach().copy_(flat.view(tensor.shape))
    return tensor
