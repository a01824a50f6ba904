"""How ZeRO cuts a tensor into N shards, and packs many tensors into one collective (chapter 04).

Every parameter is split along dim 0 into chunks of ``ceil(rows / N)`` rows, rank ``r`` owning chunk ``r``
(FSDP2's ``Shard(0)``; the last ranks may own fewer rows or none): ``ShardSpec``, with the row
ranges of ``refimpl.distributed.placement.chunk_range``, the rule the planner counts bytes with too.

A collective over several tensors packs them side by side: the input of a reduce-scatter is an ``[N, S]``
matrix whose row ``r`` holds chunk ``r`` of every tensor, each padded to ``ceil(rows / N)`` rows, so one
collective serves many tensors of uneven sizes (``pack_for_reduce_scatter``,
``unpack_reduce_scatter``, ``pack_for_all_gather``, ``copy_out_all_gather``). The padding lives
only in these transient buffers: what a rank keeps is its exact shard (``shard_of``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refimpl.distributed.placement import Box, chunk_range


@dataclass(frozen=True)
class ShardSpec:
    """Where ``rank``'s shard of a tensor of ``shape`` lies: rows ``[start, end)`` of dim 0.

    ``chunk`` rows per rank (``ceil(rows / N)``), so ``padded_numel = chunk * row_numel`` is what each rank
    contributes to a collective and ``numel`` (possibly 0) what it keeps.
    """

    shape: torch.Size
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if len(self.shape) == 0:
            raise ValueError("0-d parameters cannot be sharded along dim 0; reshape them to [1]")

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return self.shape[1:].numel()

    @property
    def chunk(self) -> int:
        return -(-self.rows // self.world_size)

    @property
    def start(self) -> int:
        return chunk_range(self.rows, self.rank, self.world_size)[0]

    @property
    def end(self) -> int:
        return chunk_range(self.rows, self.rank, self.world_size)[1]

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.end - self.start, *self.shape[1:]))

    @property
    def numel(self) -> int:
        return (self.end - self.start) * self.row_numel

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.row_numel

    @property
    def box(self) -> Box:
        """This rank's rows as a ``refimpl.distributed.placement.Box`` of the full tensor."""
        return Box.full(self.shape).narrow(0, self.start, self.end - self.start)

    def rows_of(self, rank: int) -> tuple[int, int]:
        return chunk_range(self.rows, rank, self.world_size)


def shard_of(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``rank``'s rows of ``full``: a view (it shares memory with ``full``)."""
    return full[spec.start : spec.end]


def pack_for_all_gather(shards: Sequence[torch.Tensor], specs: Sequence[ShardSpec]) -> torch.Tensor:
    """This rank's all-gather input: its shards side by side, each padded to ``chunk`` rows. ``[S]``."""
    total = sum(s.padded_numel for s in specs)
    out = shards[0].new_zeros(total) if shards else torch.zeros(0)
    offset = 0
    for shard, spec in zip(shards, specs, strict=True):
        out[offset : offset + spec.numel].copy_(shard.reshape(-1))
        offset += spec.padded_numel
    return out


def copy_out_all_gather(
    gathered: torch.Tensor, specs: Sequence[ShardSpec], fulls: Sequence[torch.Tensor]
) -> None:
    """Scatter an all-gather output ``[N * S]`` into the full tensors ``fulls`` (written in place).

    Row ``r`` of ``gathered.view(N, S)`` is rank ``r``'s packed shards: tensor ``i`` sits at the same
    offset in every row, its first ``rows_of(r)`` rows valid, the rest padding.
    """
    n = specs[0].world_size if specs else 1
    rows_by_rank = gathered.view(n, -1)  # [N, S]
    offset = 0
    for spec, full in zip(specs, fulls, strict=True):
        dst = full.view(spec.rows, spec.row_numel)  # [rows, row_numel]
        for r in range(n):
            start, end = spec.rows_of(r)
            block = rows_by_rank[r, offset : offset + (end - start) * spec.row_numel]
            dst[start:end].copy_(block.view(end - start, spec.row_numel))
        offset += spec.padded_numel


def pack_for_reduce_scatter(grads: Sequence[torch.Tensor], specs: Sequence[ShardSpec]) -> torch.Tensor:
    """The reduce-scatter input ``[N, S]``: row ``r`` holds chunk ``r`` of every gradient, zero-padded."""
    n = specs[0].world_size if specs else 1
    total = sum(s.padded_numel for s in specs)
    out = grads[0].new_zeros(n, total) if grads else torch.zeros(n, 0)
    offset = 0
    for grad, spec in zip(grads, specs, strict=True):
        rows = grad.reshape(spec.rows, spec.row_numel)  # [rows, row_numel]
        for r in range(n):
            start, end = spec.rows_of(r)
            out[r, offset : offset + (end - start) * spec.row_numel].copy_(rows[start:end].reshape(-1))
        offset += spec.padded_numel
    return out


def unpack_reduce_scatter(reduced: torch.Tensor, specs: Sequence[ShardSpec]) -> list[torch.Tensor]:
    """This rank's gradient shards (views into the reduce-scatter output ``[S]``), padding dropped."""
    out, offset = [], 0
    for spec in specs:
        out.append(reduced[offset : offset + spec.numel].view(spec.local_shape))
        offset += spec.padded_numel
    return out
