"""Megatron's two parallel linears: ``ColumnParallelLinear`` and ``RowParallelLinear`` (chapter 06).

Shoeybi et al. 2019, "Megatron-LM" (section 3): a linear ``Y = X A^T + b`` with ``A`` of shape
``[out, in]`` is split across the ``t`` ranks of a tensor-parallel group in one of two ways.

* **Column parallel** (split the output features): rank ``r`` holds rows ``A_r = A[r*out/t:(r+1)*out/t]``
  and ``b_r``, and computes ``Y_r = X A_r^T + b_r``, its block of the output features. The input must be
  whole on every rank: ``f`` (``copy_to_tensor_parallel_region``, all-reduce in backward) in front, or
  under sequence parallelism (Korthikanti et al. 2022) an all-gather of the sequence (dim 1) in front and a
  reduce-scatter in backward; then only the ``s/t`` input chunk is saved and backward all-gathers it again
  (``.sequence_parallel_linear``, Megatron's way). ``gather_output=True`` all-gathers ``Y`` along the
  last dim.
* **Row parallel** (split the input features): rank ``r`` holds columns ``A[:, r*in/t:(r+1)*in/t]`` and
  computes the partial sum ``X_r A_r^T``; ``g`` (``reduce_from_tensor_parallel_region``, all-reduce)
  sums them, or under sequence parallelism a reduce-scatter along the sequence (dim 1). The bias is whole
  on every rank and added once, after the reduction. ``input_is_parallel=False`` first keeps this rank's
  chunk of the last dim of a whole input.

A column layer followed by a row layer (the MLP ``Y = GeLU(X A^T) B^T``) needs one all-reduce forward (the
row layer's ``g``) and one backward (the column layer's ``f``); with sequence parallelism an all-gather and
a reduce-scatter each way instead, the same bytes, plus the column layer's second all-gather in backward.

Under sequence parallelism the row layer's bias sees only this rank's ``s/t`` tokens, so its gradient is a
partial sum. Megatron marks such a parameter with a tensor attribute (``sequence_parallel = True``); a
tensor attribute does not survive a wrapper that replaces parameters (ZeRO-3's shards), so here the
*module* declares them: ``sequence_parallel_parameters()`` names the parameters whose gradients cover
``s/t`` tokens (the row layer's bias; ``SequenceParallelLayerNorm``'s weight and bias), and
``allreduce_sequence_parallel_grads`` sums those gradients over the group (one all-reduce each).

Rank ``r`` holds the ``r``-th contiguous block in ``.weight`` / ``.bias`` (equal blocks: a size that does not
divide by ``t`` is a ``ValueError``); ``from_linear`` shards a full ``nn.Linear`` that way, and
``local_shards()`` declares the boxes for the checkpoint (``refimpl.distributed.placement``), under the
names a plain ``nn.Linear`` has, so a checkpoint saved at one TP size loads at another or into a dense layer.

Both matmuls go through the one linear seam (``refimpl.nn.linear.linear_with_grad``):
``weight_grad_store`` (None by default; set by
``refimpl.parallel.pipeline_parallel.defer_weight_gradients``) queues this rank's ``dW_r = dY_r^T X``
(column) or ``dY^T X_r`` (row) for zero-bubble's ``W`` action, so zbh1 composes with tensor parallelism:
each rank defers the gradient of the block it holds. ``matmul`` (None: ``F.linear``) is the seam's pluggable
product of this rank's block: ``--precision fp8`` sets it to the fp8 GEMMs
(``refimpl.precision.fp8.apply_float8_training``, chapter 10), which read ``split_features`` (``"out"``
column, ``"in"`` row) and ``tp_group`` to agree the fp8 scales over the group.

``tp_comm_overlap`` (Megatron's ``--tp-comm-overlap``; False by default, set by
``apply_tensor_parallel(..., tp_comm_overlap=True)``): under sequence parallelism the column layer's
all-gather and the row layer's reduce-scatter become rings that hide each transfer behind the matmul of a
sequence chunk (``.collective_matmul``, Wang et al. 2023). The ring's products are ``F.linear``'s, so such a
layer takes neither a pluggable ``matmul`` nor a ``weight_grad_store`` (a ``ValueError`` in forward; the
support table refuses the flag with fp8 and the zero-bubble schedules).
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch
from torch import nn

from refimpl.comm import ops
from refimpl.distributed.placement import Box, LocalShard
from refimpl.nn.linear import Matmul, WeightGradQueue, linear_with_grad
from refimpl.parallel.tensor_parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from refimpl.parallel.tensor_parallel.sequence_parallel_linear import linear_with_sequence_parallel_gather
from refimpl.parallel.tensor_parallel.tp_communications import (
    Group,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)


def _divide(size: int, t: int, what: str, layer: str) -> int:
    if size % t:
        raise ValueError(f"{layer}: {what} {size} does not divide by the tensor-parallel size {t}")
    return size // t


def _init_uniform_(t: torch.Tensor, fan_in: int) -> None:
    """``nn.Linear``'s default init, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, with the *full* fan-in."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(t, -bound, bound)



def _check_overlap(layer: ColumnParallelLinear | RowParallelLinear) -> None:
    """A collective-matmul layer computes its products itself (module docstring): no seam to plug."""
    if layer.matmul is not None or layer.weight_grad_store is not None:
        raise ValueError(f"{type(layer).__name__}: tp_comm_overlap runs the collective matmul's own "
                         "products; it takes no pluggable matmul (fp8) and no deferred weight gradient "
                         "(zero-bubble schedules)")


_ParallelLinear = TypeVar("_ParallelLinear", "ColumnParallelLinear", "RowParallelLinear")


def _sharded_from(cls: type[_ParallelLinear], linear: nn.Linear, *, tp_group: Group, **kw) -> _ParallelLinear:
    """A ``cls`` layer of ``linear``'s sizes whose tensors are copied from the boxes it declares."""
    layer = cls(linear.in_features, linear.out_features, tp_group=tp_group, bias=linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype, **kw)
    with torch.no_grad():
        for name, shard in layer.local_shards().items():  # the source viewed as the declared global shape
            shard.tensor.copy_(getattr(linear, name).reshape(shard.box.global_shape)[shard.box.slices()])
    return layer


class ColumnParallelLinear(nn.Module):
    """``Y_r = X A_r^T + b_r``: this rank's block ``r`` of the ``out_features`` (Megatron-LM).

    ``weight``: ``[out_features / t, in_features]``, ``bias``: ``[out_features / t]``. Input
    ``[..., in_features]`` whole (or ``[batch, seq / t, in_features]`` under ``sequence_parallel``);
    output ``[..., out_features / t]`` (``[..., out_features]`` with ``gather_output``).

    ``chunks = k``: the ``out_features`` are ``k`` stacked projections (a fused ``q|k|v``), each split over
    the group: the rank holds rows ``[r n/t, (r+1) n/t)`` of each chunk (``n = out_features / k``), chunk
    after chunk, and declares them as a box of the ``[k, n, in_features]`` view of the weight.
    """

    split_features = "out"  # the dim of [out, in] split over the group (fp8's scales read it)
    matmul: Matmul | None = None  # the seam's product of this rank's block (module docstring)
    tp_comm_overlap = False  # under sequence parallelism: the ring all-gather-matmul (module docstring)

    def __init__(self, in_features: int, out_features: int, *, tp_group: Group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, chunks: int = 1,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if gather_output and (sequence_parallel or chunks > 1):
            raise ValueError("ColumnParallelLinear: gather_output and sequence_parallel (or chunks) exclude "
                             "each other")
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        self.in_features, self.out_features, self.chunks = in_features, out_features, chunks
        if chunks < 1 or out_features % chunks:
            raise ValueError(f"{type(self).__name__}: out_features {out_features} are not {chunks} equal "
                             "chunks")
        self.out_per_rank = chunks * _divide(out_features // chunks, self.tp_size, "out_features",
                                             type(self).__name__)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight_grad_store: WeightGradQueue | None = None  # zero-bubble's deferred dW (module docstring)
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, device=device, dtype=dtype)) if bias else None
        with torch.no_grad():
            _init_uniform_(self.weight, in_features)
            if self.bias is not None:
                _init_uniform_(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, tp_group: Group, **kw) -> ColumnParallelLinear:
        """This rank's block of rows of ``linear.weight`` (and of ``linear.bias``; of each chunk), copied."""
        return _sharded_from(cls, linear, tp_group=tp_group, **kw)

    def local_shards(self) -> dict[str, LocalShard]:
        """Rows ``[r*out/t, (r+1)*out/t)`` of the ``[out, in]`` weight and of the ``[out]`` bias; with
        ``chunks = k`` rows ``[r n/t, (r+1) n/t)`` of each chunk, a box of the ``[k, n, ...]`` view."""
        tensors = {"weight": self.weight} if self.bias is None else {"weight": self.weight, "bias": self.bias}
        out = {}
        for name, tensor in tensors.items():
            whole = (self.out_features, *tensor.shape[1:])
            if self.chunks == 1:
                out[name] = LocalShard(tensor, Box.chunk(whole, 0, self.tp_rank, self.tp_size))
                continue
            k = self.chunks
            # [out/t, ...] -> [k, n/t, ...] of the [k, n, ...] view of the whole
            view = tensor.view(k, self.out_per_rank // k, *tensor.shape[1:])
            out[name] = LocalShard(view, Box.chunk((k, self.out_features // k, *whole[1:]), 1,
                                                   self.tp_rank, self.tp_size))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.tp_comm_overlap:  # [b, s/t, in] -> [b, s, out/t], a ring
            _check_overlap(self)
            return all_gather_matmul(x, self.weight, self.bias, group=self.tp_group)
        if self.sequence_parallel:  # [b, s/t, in] all-gathered to [b, s, in]; only [b, s/t, in] is saved
            return linear_with_sequence_parallel_gather(x, self.weight, self.bias, self.tp_group,
                                                        weight_grad_store=self.weight_grad_store,
                                                        matmul=self.matmul)
        x = copy_to_tensor_parallel_region(x, self.tp_group)            # f: all-reduce in backward
        y = linear_with_grad(x, self.weight, self.bias,                 # [..., out/t]
                             weight_grad_store=self.weight_grad_store, matmul=self.matmul)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp_group)    # [..., out]
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_per_rank} on rank {self.tp_rank} of {self.tp_size}), chunks={self.chunks}, "
                f"bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = sum_r X_r A_r^T + b``: this rank holds block ``r`` of the ``in_features`` (Megatron-LM).

    ``weight``: ``[out_features, in_features / t]``, ``bias``: ``[out_features]`` whole. Input
    ``[..., in_features / t]`` (``input_is_parallel``) or ``[..., in_features]``; output
    ``[..., out_features]`` whole, or ``[batch, seq / t, out_features]`` under ``sequence_parallel``.
    """

    split_features = "in"  # the dim of [out, in] split over the group (fp8's scales read it)
    matmul: Matmul | None = None  # the seam's product of this rank's block (module docstring)
    tp_comm_overlap = False  # under sequence parallelism: the ring matmul-reduce-scatter (module docstring)

    def __init__(self, in_features: int, out_features: int, *, tp_group: Group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _divide(in_features, self.tp_size, "in_features", type(self).__name__)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight_grad_store: WeightGradQueue | None = None  # zero-bubble's deferred dW (module docstring)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        with torch.no_grad():
            _init_uniform_(self.weight, in_features)
            if self.bias is not None:
                _init_uniform_(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, tp_group: Group, **kw) -> RowParallelLinear:
        """This rank's block of columns of ``linear.weight`` and the whole ``linear.bias``, copied."""
        return _sharded_from(cls, linear, tp_group=tp_group, **kw)

    def local_shards(self) -> dict[str, LocalShard]:
        """Columns ``[r*in/t, (r+1)*in/t)`` of the ``[out, in]`` weight; the bias whole."""
        out = {"weight": LocalShard(self.weight, Box.chunk((self.out_features, self.in_features), 1,
                                                           self.tp_rank, self.tp_size))}
        if self.bias is not None:
            out["bias"] = LocalShard.full(self.bias)
        return out

    def sequence_parallel_parameters(self) -> tuple[str, ...]:
        """The bias under sequence parallelism: added to this rank's ``s/t`` tokens, its gradient is a
        partial sum over the group (module docstring)."""
        return ("bias",) if self.sequence_parallel and self.bias is not None else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)         # [..., in] -> [..., in/t]
        if self.sequence_parallel and self.tp_comm_overlap:
            _check_overlap(self)
            y = matmul_reduce_scatter(x, self.weight, group=self.tp_group)  # [b, s, in/t] -> [b, s/t, out]
            return y if self.bias is None else y + self.bias
        y = linear_with_grad(x, self.weight,                                # [..., out], a partial sum
                             weight_grad_store=self.weight_grad_store, matmul=self.matmul)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)  # [b, s, out] -> [b, s/t, out]
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)        # g: all-reduce
        return y if self.bias is None else y + self.bias                    # once, after the reduction

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} on rank {self.tp_rank} of "
                f"{self.tp_size}), out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm between the tensor-parallel regions under sequence parallelism: it normalizes this
    rank's ``s/t`` tokens, so the gradients of its (replicated) weight and bias are partial sums over the
    group. The same parameters as the ``nn.LayerNorm`` it replaces (``from_layernorm`` shares them)."""

    @classmethod
    def from_layernorm(cls, norm: nn.LayerNorm) -> SequenceParallelLayerNorm:
        new = cls(norm.normalized_shape, eps=norm.eps, elementwise_affine=False, bias=False)
        new.elementwise_affine = norm.elementwise_affine
        new.weight, new.bias = norm.weight, norm.bias  # the same Parameter objects: nothing copied
        return new

    def sequence_parallel_parameters(self) -> tuple[str, ...]:
        return tuple(n for n in ("weight", "bias") if getattr(self, n) is not None)


def sequence_parallel_names(module: nn.Module) -> list[str]:
    """The names (in ``module``) of the parameters its submodules declare as sequence-parallel
    (``sequence_parallel_parameters()``): replicated parameters applied to ``s/t`` tokens per rank
    (Korthikanti et al. 2022), whose gradients must be summed over the tensor-parallel group."""
    out = []
    for prefix, m in module.named_modules():
        declare = getattr(m, "sequence_parallel_parameters", None)
        if callable(declare):
            out += [f"{prefix}.{n}" if prefix else n for n in declare()]
    return out


def allreduce_sequence_parallel_grads(module: nn.Module, group: Group) -> int:
    """Sum over ``group`` the gradients of ``module``'s sequence-parallel parameters
    (``sequence_parallel_names``): one all-reduce each, after backward. Returns how many were
    reduced."""
    if group_size(group) == 1:
        return 0
    params = dict(module.named_parameters(remove_duplicate=False))
    n = 0
    for name in sequence_parallel_names(module):
        grad = params[name].grad
        if grad is not None:
            ops.all_reduce(grad, group=group)
            n += 1
    return n


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SequenceParallelLayerNorm",
           "allreduce_sequence_parallel_grads", "sequence_parallel_names"]
