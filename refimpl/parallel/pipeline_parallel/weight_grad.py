"""The weight gradient split off the backward (chapter 08; Qi et al. 2023, "Zero Bubble Pipeline
Parallelism").

A linear layer ``Y = X W^T + b`` has two gradients: ``dX = dY W``, which the previous stage waits for, and
``dW = dY^T X``, which no one needs before the optimizer step. Zero-bubble schedules run them as two
actions, ``B`` (input gradient) and ``W`` (weight gradient), and place the ``W`` s in the bubble.
:func:`defer_weight_gradients` makes every ``nn.Linear`` of a stage compute ``dX`` (and the cheap bias
gradient) in backward and queue ``dW`` in a :class:`WeightGradStore` under the key the executor is running
(``(stage, microbatch)``); :meth:`WeightGradStore.flush` of that key, the ``W`` action, adds them to the
weights' ``.grad``. The LayerNorm and embedding gradients (``O(h)`` per token, no matmul) stay in ``B``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WeightGradStore", "defer_weight_gradients", "linear_deferred_weight"]


class WeightGradStore:
    """Queued weight-gradient computations by key; :meth:`capture` sets the key of a backward."""

    def __init__(self) -> None:
        self._pending: dict[object, list[Callable[[], None]]] = {}
        self._key: object | None = None

    @contextlib.contextmanager
    def capture(self, key: object) -> Iterator[None]:
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def push(self, fn: Callable[[], None]) -> None:
        if self._key is None:  # outside a captured backward: the plain backward, at once
            fn()
        else:
            self._pending.setdefault(self._key, []).append(fn)

    def flush(self, key: object) -> int:
        """Run the weight gradients queued under ``key``; returns how many."""
        fns = self._pending.pop(key, [])
        for fn in fns:
            fn()
        return len(fns)

    def __len__(self) -> int:
        return sum(len(v) for v in self._pending.values())


@torch.no_grad()
def _accumulate(weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    grad = dy.t().mm(x).to(weight.dtype)  # dW = dY^T X: [out, tokens] @ [tokens, in] -> [out, in]
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


class _LinearDeferredWeight(torch.autograd.Function):
    """``F.linear`` whose backward returns dX and db and queues dW. Under autocast the matmul runs in the
    autocast dtype (``compute``); the gradients are computed in it and cast back to each input's dtype, as
    autograd does through autocast's casts."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        y = F.linear(x, weight, bias)  # autocast (if on) picks the dtype
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.bias_dtype, ctx.compute = store, None if bias is None else bias.dtype, y.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.to(ctx.compute)
        dx = (dy @ weight.to(ctx.compute)).to(x.dtype)          # [..., out] @ [out, in] -> [..., in]
        db = None if ctx.bias_dtype is None else dy.flatten(0, -2).sum(0).to(ctx.bias_dtype)  # [out]
        dy2, x2 = dy.flatten(0, -2), x.detach().to(ctx.compute).flatten(0, -2)  # [tokens, out], [tokens, in]
        ctx.store.push(lambda: _accumulate(weight, dy2, x2))
        return dx, None, db, None


def linear_deferred_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           store: WeightGradStore) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward gives ``dX = dY W`` and the bias gradient and queues
    ``dW = dY^T X`` in ``store`` (under the key of the running :meth:`WeightGradStore.capture`)."""
    return _LinearDeferredWeight.apply(x, weight, bias, store)


def defer_weight_gradients(module: nn.Module, store: WeightGradStore) -> nn.Module:
    """Make every ``nn.Linear`` in ``module`` queue its weight gradient in ``store`` (in place)."""
    for linear in module.modules():
        if isinstance(linear, nn.Linear):
            def forward(x: torch.Tensor, _lin: nn.Linear = linear) -> torch.Tensor:
                return linear_deferred_weight(x, _lin.weight, _lin.bias, store)

            linear.forward = forward
    return module
