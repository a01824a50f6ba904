"""The one linear seam: every linear layer of the course goes through ``linear_with_grad`` (chapters
06 and 08).

``Y = gather(X) W^T + b`` with ``W: [out, in]``. Its backward has three products:

* ``dX = dY W`` (reduce-scattered back along the sequence when the forward gathered it), which the layer
  below waits for;
* ``db = sum_tokens dY``;
* ``dW = dY^T X`` (``X`` the gathered input), which no one needs before the optimizer step.

This is Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` pattern: one autograd function
that owns the linear's backward, so the three places that need to change it change it here:

* **sequence parallelism** (Korthikanti et al. 2022, chapter 06): ``sequence_gather`` all-gathers the
  ``[b, s/t, in]`` input along the sequence for the forward; only the local ``X_r`` is saved and backward
  gathers it again (one more all-gather) and reduce-scatters ``dX``, so the activation saved is ``s/t`` of
  the tokens, not ``s`` (``refimpl.parallel.tensor_parallel.sequence_parallel_linear``);
* **a deferred weight gradient** (Qi et al. 2023, zero-bubble's ``W``, chapter 08): with
  ``weight_grad_store`` the backward returns ``dX`` and ``db`` and queues ``dW`` in the store
  (``refimpl.parallel.pipeline_parallel.WeightGradStore``, anything with ``push(fn, held)``, ``held``
  the tensors ``dW`` keeps until then, which a memory meter counts), whose ``W`` action adds it to
  ``weight.grad`` later (with a sequence gather too, the queued ``dW`` keeps the gathered
  ``X`` until then: no collective runs in ``W``). The weight it adds to is held by reference, not read
  back from the saved tensors: under ``saved_tensors_hooks`` (activation checkpointing, a memory meter)
  those come back as other tensor objects, and a ``.grad`` set on one of them reaches no Parameter;
* **a pluggable matmul** (``matmul(x, weight, bias) -> y``, ``F.linear`` by default): where a low-precision
  kernel (fp8, chapter 10) goes. With neither a gather nor a store it is called as it is and autograd (or
  the kernel's own autograd) differentiates it; with either, it is the forward product of this function,
  and a matmul that also has ``input_grad(dY, W) -> dX`` and ``weight_grad(dY, X) -> DeferredProduct``
  (``SplitMatmul``: the fp8 GEMMs of ``refimpl.precision.fp8.Float8Matmul``) computes the two
  backward products too, so a sequence-parallel or deferred layer stays the kernel's in all three GEMMs
  (``weight_grad`` prepares its operands in ``B``, casts and their collectives included, and the returned
  function multiplies, in ``W`` when deferred).
  Such a matmul reads the tensors as they are (no autocast pre-cast: fp8 casts the fp32 master weight
  once, not through bf16), so under autocast its sequence gather moves the input in its own dtype.

With none of the three the seam is ``F.linear`` itself (autograd's own backward, bitwise the plain layer).
Under autocast the forward matmul runs in the autocast dtype; backward computes in the dtype of the output
and returns each gradient in its input's dtype, as autograd does through autocast's casts.

This module imports nothing from refimpl: the gather is passed in (``SequenceGather``), so the model
(below the communication layer) can use the seam too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DeferredProduct", "Linear", "SequenceGather", "SplitMatmul", "linear_with_grad"]

Matmul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class WeightGradQueue(Protocol):
    """Where a deferred ``dW`` goes: ``push(fn, held)`` runs ``fn`` now or at the key's ``W``; ``fn()`` adds
    ``dW`` to the weight's ``.grad`` and returns the weight; ``held``: the tensors ``fn`` keeps until then
    (what a memory meter counts while it waits)."""

    def push(self, fn: Callable[[], torch.Tensor], held: tuple[torch.Tensor, ...] = ()) -> None: ...


@dataclasses.dataclass(frozen=True)
class DeferredProduct:
    """A product prepared now and computed when called: ``fn()``, and ``held``, the tensors it keeps."""

    fn: Callable[[], torch.Tensor]
    held: tuple[torch.Tensor, ...] = ()

    def __call__(self) -> torch.Tensor:
        return self.fn()


class SplitMatmul(Protocol):
    """A pluggable matmul that owns its backward products too (module docstring): ``__call__`` is the
    forward ``x W^T + b``; ``input_grad(dy [..., out], weight) -> dx [..., in]`` and
    ``weight_grad(dy [tokens, out], x [tokens, in])``, which prepares its operands now and returns the
    ``DeferredProduct`` computing ``dW [out, in]``; both results in ``dy``'s dtype."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def input_grad(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def weight_grad(self, dy: torch.Tensor, x: torch.Tensor) -> DeferredProduct: ...


def _splits(matmul: Matmul) -> TypeGuard[SplitMatmul]:
    """Whether ``matmul`` computes its backward products itself (``SplitMatmul``)."""
    return callable(getattr(matmul, "input_grad", None)) and callable(getattr(matmul, "weight_grad", None))


def _weight_grad(matmul: Matmul, dy: torch.Tensor, x: torch.Tensor) -> DeferredProduct:
    """``dW = dY^T X`` (``[tokens, out]^T @ [tokens, in] -> [out, in]``) to compute; by ``matmul`` if it
    splits (its operands prepared now)."""
    if _splits(matmul):
        return matmul.weight_grad(dy, x)
    return DeferredProduct(lambda: dy.t().matmul(x), held=(dy, x))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceGather:
    """The sequence-parallel pair: ``all_gather`` ``[b, s/t, ...] -> [b, s, ...]`` and its adjoint
    ``reduce_scatter`` ``[b, s, ...] -> [b, s/t, ...]`` (the sum over the group, my chunk)."""

    all_gather: Callable[[torch.Tensor], torch.Tensor]
    reduce_scatter: Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def _accumulate(weight: torch.Tensor, weight_grad: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Add ``dW = weight_grad()`` to ``weight.grad`` (a deferred weight gradient); returns ``weight``, whose
    gradient changed (its reduction, ZeRO-2's reduce-scatter, may follow: ``WeightGradQueue``)."""
    grad = weight_grad().to(weight.dtype)  # dW = dY^T X: [out, in]
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad
    return weight


class _LinearWithGrad(torch.autograd.Function):
    @staticmethod  # autograd.Function.apply passes the inputs positionally
    def forward(ctx, x, weight, bias, gather, store, matmul):  # noqa: PLR0917
        ctx.save_for_backward(x, weight)                              # x: [..., in] (SP: [b, s/t, in])
        full = x if gather is None else gather.all_gather(x)          # [..., in] (SP: [b, s, in])
        y = matmul(full, weight, bias)                                # autocast (if on) picks the dtype
        ctx.gather, ctx.store, ctx.compute, ctx.matmul = gather, store, y.dtype, matmul
        # the tensor whose .grad a deferred dW goes to, held as itself: a saved tensor comes back from
        # saved_tensors_hooks (a meter's, checkpointing's) as another tensor object, whose .grad is no one's
        ctx.grad_holder = weight if store is not None else None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y                                                      # [..., out]

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        mm, split = ctx.matmul, _splits(ctx.matmul)
        dy = dy.to(ctx.compute)
        full = x.detach() if ctx.gather is None else ctx.gather.all_gather(x)  # gathered again (SP)
        if split:                                                     # the kernel's own dX (it casts)
            dx = mm.input_grad(dy, weight)                            # [..., out] @ [out, in] -> [..., in]
        else:
            full = full.to(ctx.compute)
            dx = dy.matmul(weight.to(ctx.compute))                    # [..., out] @ [out, in] -> [..., in]
        if ctx.gather is not None:
            dx = ctx.gather.reduce_scatter(dx)                        # a partial sum: my s/t of the sum
        dy2 = dy.reshape(-1, dy.shape[-1])                            # [tokens, out]
        x2 = full.reshape(-1, full.shape[-1])                         # [tokens, in]
        db = None if ctx.bias_dtype is None else dy2.sum(0).to(ctx.bias_dtype)  # [out]
        weight_grad = _weight_grad(mm, dy2, x2)
        if ctx.store is not None:                                     # zero-bubble's W: dW later
            holder = ctx.grad_holder
            ctx.store.push(lambda: _accumulate(holder, weight_grad), held=weight_grad.held)
            dw = None
        else:
            dw = weight_grad().to(weight.dtype)                       # [out, in]
        return dx.to(x.dtype), dw, db, None, None, None


def linear_with_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     sequence_gather: SequenceGather | None = None,
                     weight_grad_store: WeightGradQueue | None = None,
                     matmul: Matmul | None = None) -> torch.Tensor:
    """``gather(x) @ weight.T + bias`` with the backward of the module docstring: ``[..., in] -> [..., out]``
    (with ``sequence_gather``: ``[b, s/t, in] -> [b, s, out]``, saving only the local ``x``; with
    ``weight_grad_store``: ``dW`` queued there, not returned)."""
    mm = F.linear if matmul is None else matmul
    if sequence_gather is None and weight_grad_store is None:
        return mm(x, weight, bias)  # autograd's own backward: the plain layer, bitwise
    if sequence_gather is not None:
        if x.dim() < 2:
            raise ValueError("sequence-parallel linear: needs [batch, seq, ...] input, got shape "
                             f"{tuple(x.shape)}")
        if weight_grad_store is None and not _splits(mm) and torch.is_autocast_enabled(x.device.type):
            # the forward matmul in the autocast dtype, the gather too (the casts' own backward casts back)
            dtype = torch.get_autocast_dtype(x.device.type)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
            x = x.to(dtype)
    # a deferred dW is added to the Parameter itself, so under autocast the casts happen inside (in mm)
    return _LinearWithGrad.apply(x, weight, bias, sequence_gather, weight_grad_store, mm)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, init and state-dict names) whose forward is ``linear_with_grad``;
    ``weight_grad_store`` (None: ``dW`` in backward) and ``matmul`` (None: ``F.linear``) may be set on it."""

    weight_grad_store: WeightGradQueue | None = None
    matmul: Matmul | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_with_grad(x, self.weight, self.bias, weight_grad_store=self.weight_grad_store,
                                matmul=self.matmul)
