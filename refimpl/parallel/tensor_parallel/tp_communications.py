"""The conjugate collectives of tensor and sequence parallelism, as autograd functions (chapter 06).

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (section 3): a layer split across the ``t`` ranks of a tensor-parallel group needs only two
operators, conjugate to each other, around each pair of matrix multiplies:

* ``f`` = ``copy_to_tensor_parallel_region``: forward ``y = x`` (every rank already holds ``x``),
  backward ``dx = sum_r dy_r`` (all-reduce: each rank's branch contributed a part of the gradient);
* ``g`` = ``reduce_from_tensor_parallel_region``: forward ``y = sum_r x_r`` (all-reduce of the partial
  sums of a row-parallel matmul), backward ``dx = dy`` (identity: the sum's gradient reaches every term).

and their split / gather forms along the **last dim** (the hidden features of a column-parallel output):

* ``scatter_to_tensor_parallel_region``: forward keeps my chunk ``x[..., r*h/t:(r+1)*h/t]``,
  backward all-gathers the chunks of the gradient along the last dim;
* ``gather_from_tensor_parallel_region``: forward all-gathers along the last dim, backward keeps my
  chunk of the gradient.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (sequence
parallelism): outside the tensor-parallel matmuls (layer norms, dropout) each rank keeps ``s/t`` of the
sequence. Our activations are ``[batch, seq, hidden]``, so the **sequence is dim 1** (Megatron's layout is
``[seq, batch, hidden]``, dim 0; we move dim 1 to the front for the collective and back, a copy):

* ``scatter_to_sequence_parallel_region``: forward keeps my chunk of dim 1, backward all-gathers dim 1;
* ``gather_from_sequence_parallel_region`` (``g-bar`` of the paper's figure 5): forward all-gathers
  dim 1, backward reduce-scatters dim 1 (each rank's branch saw the whole sequence);
* ``reduce_scatter_to_sequence_parallel_region`` (``g`` of SP): forward reduce-scatters dim 1 (the
  row-parallel partial sums, each rank receiving its chunk of the sum), backward all-gathers dim 1.

An all-gather and a reduce-scatter together move what one all-reduce moves, ``2(t-1)/t`` of the tensor per
rank: sequence parallelism replaces each all-reduce by such a pair at the same bytes; what it adds is one
all-gather per column layer in backward, which re-gathers the ``s/t`` input chunk it saved instead of the
whole sequence (``.sequence_parallel_linear``).

Each wrapper is ``fn(x, group)``; ``group`` is the tensor-parallel process group (``None`` means the default
group, or no-op when no process group is initialised). A group of size 1 is the identity, forward and
backward, with no collective. Chunks are equal: a dim that does not divide by ``t`` is a one-line
``ValueError``. Every collective goes through ``refimpl.comm.ops``, so a
``refimpl.comm.CommTracer`` sees exactly the collective each docstring names. Forward inputs are never
modified in place (the all-reduce works on a copy): autograd may have saved them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size

SEQUENCE_DIM = 1
"""The sequence dim of our ``[batch, seq, hidden]`` activations, the dim sequence parallelism splits."""

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    """Ranks in ``group`` (1 when ``group`` is None and no process group is initialised)."""
    return group_rank_size(group)[1]


def group_rank(group: Group) -> int:
    """This rank's index in ``group`` (0 when ``group`` is None and no process group is initialised)."""
    return group_rank_size(group)[0]


def _check_divides(size: int, t: int, dim: int, what: str) -> int:
    if size % t:
        raise ValueError(f"{what}: dim {dim} of size {size} does not divide into {t} equal chunks")
    return size // t


# ---- the primitives: no autograd, each one collective through refimpl.comm.ops ----------------------------


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``sum_r x_r`` on every rank, into a fresh tensor (``x`` untouched)."""
    out = x.clone(memory_format=torch.contiguous_format)
    ops.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """My chunk of ``dim``: ``x.narrow(dim, r*n/t, n/t)``, contiguous. No communication."""
    t = group_size(group)
    dim = dim % x.dim()
    chunk = _check_divides(x.shape[dim], t, dim, "split")
    return x.narrow(dim, group_rank(group) * chunk, chunk).contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """The chunks of every rank concatenated in rank order along ``dim`` (one all-gather)."""
    t = group_size(group)
    dim = dim % x.dim()
    front = x.movedim(dim, 0).contiguous()                         # [n/t, *rest]
    out = front.new_empty((t * front.shape[0], *front.shape[1:]))  # [n, *rest], rank r's chunk at rows r*n/t
    ops.all_gather_into_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()                        # dim back in place: [..., n, ...]


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """My chunk of ``dim`` of ``sum_r x_r`` (one reduce-scatter)."""
    t = group_size(group)
    dim = dim % x.dim()
    chunk = _check_divides(x.shape[dim], t, dim, "reduce-scatter")
    front = x.movedim(dim, 0).contiguous()                         # [n, *rest]
    out = front.new_empty((chunk, *front.shape[1:]))               # [n/t, *rest]
    ops.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()                        # [..., n/t, ...]


def _check_seq(x: torch.Tensor, what: str) -> None:
    if x.dim() < 2:
        raise ValueError(f"{what}: needs [batch, seq, ...] activations (sequence = dim 1), got shape "
                         f"{tuple(x.shape)}")


# ---- the conjugate pairs as autograd functions -------------------------------------------------------------


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """``f``: identity forward, all-reduce backward (Megatron's ``_CopyToModelParallelRegion``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _all_reduce(dy, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward (Megatron's ``_ReduceFromModelParallelRegion``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep my chunk of the last dim forward, all-gather the last dim backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _all_gather(dy, -1, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the last dim forward, keep my chunk of the last dim backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _split(dy, -1, ctx.group), None


class _GatherFromTensorParallelRegionSumGrads(torch.autograd.Function):
    """All-gather the last dim forward, reduce-scatter the last dim backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _reduce_scatter(dy, -1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep my chunk of the sequence (dim 1) forward, all-gather dim 1 backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _split(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _all_gather(dy, SEQUENCE_DIM, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence (dim 1) forward, reduce-scatter dim 1 backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _reduce_scatter(dy, SEQUENCE_DIM, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter the sequence (dim 1) forward, all-gather dim 1 backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _all_gather(dy, SEQUENCE_DIM, ctx.group), None


# ---- the wrappers: fn(x, group), identity on a group of one ------------------------------------------------


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``f`` (Megatron-LM, Shoeybi et al. 2019): ``y = x``; backward ``dx = all_reduce(dy)`` (sum)."""
    if group_size(group) == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``g`` (Megatron-LM, Shoeybi et al. 2019): ``y = all_reduce(x)`` (sum); backward ``dx = dy``."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``y = x[..., r*h/t:(r+1)*h/t]`` (no communication); backward ``dx`` = all-gather of ``dy`` along
    the last dim. ``h`` must divide by ``t``."""
    if group_size(group) == 1:
        return x
    return _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group, *,
                                       sum_grads: bool = False) -> torch.Tensor:
    """``y = cat_r(x_r, dim=-1)`` (one all-gather); backward ``dx = dy[..., r*h/t:(r+1)*h/t]`` (no
    communication): every rank computes the same thing from ``y``, so its ``dy`` is already the whole
    gradient. ``sum_grads``: the ranks use ``y`` differently (each its own heads of it), so the gradient of
    ``x_r`` is the sum of every rank's: backward is my chunk of ``sum_r dy_r`` (one reduce-scatter;
    Megatron's ``tensor_parallel_output_grad``). Keeping only one's own ``dy`` there is the replica-gradient
    bug of grouped-query attention under tensor parallelism (chapter 06)."""
    if group_size(group) == 1:
        return x
    if sum_grads:
        return _GatherFromTensorParallelRegionSumGrads.apply(x, group)
    return _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence parallelism (Korthikanti et al. 2022): ``y = x[:, r*s/t:(r+1)*s/t]``, my chunk of the
    sequence = dim 1 of ``[batch, seq, hidden]`` (no communication); backward all-gathers ``dy`` along
    dim 1."""
    _check_seq(x, "scatter_to_sequence_parallel_region")
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence parallelism (Korthikanti et al. 2022): ``y = cat_r(x_r, dim=1)`` (one all-gather of the
    sequence, dim 1); backward ``dx`` = my chunk of dim 1 of ``sum_r dy_r`` (one reduce-scatter)."""
    _check_seq(x, "gather_from_sequence_parallel_region")
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence parallelism (Korthikanti et al. 2022): ``y`` = my chunk of dim 1 (the sequence) of
    ``sum_r x_r`` (one reduce-scatter); backward ``dx = cat_r(dy_r, dim=1)`` (one all-gather)."""
    _check_seq(x, "reduce_scatter_to_sequence_parallel_region")
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


__all__ = [
    "SEQUENCE_DIM",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "group_rank",
    "group_size",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
]
