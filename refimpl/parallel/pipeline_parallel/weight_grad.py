"""The weight gradient split off the backward (chapter 08; Qi et al. 2023, "Zero Bubble Pipeline
Parallelism").

A linear layer ``Y = X W^T + b`` has two gradients: ``dX = dY W``, which the previous stage waits for, and
``dW = dY^T X``, which no one needs before the optimizer step. Zero-bubble schedules run them as two
actions, ``B`` (input gradient) and ``W`` (weight gradient), and place the ``W`` s in the bubble.
``defer_weight_gradients`` makes every linear layer of a stage compute ``dX`` (and the cheap bias
gradient) in backward and queue ``dW`` in a ``WeightGradStore`` under the key the executor is running
(``(stage, microbatch)``); ``WeightGradStore.flush`` of that key, the ``W`` action, adds them to the
weights' ``.grad``. The LayerNorm and embedding gradients (``O(h)`` per token, no matmul) stay in ``B``.

A gradient added in a ``W`` action is added outside autograd, so no gradient hook sees it: what must
follow it (ZeRO-2's reduce-scatter of the weights' gradients, which its hooks do in backward) is
``WeightGradStore.after_flush``, called with the weights each ``W`` action updated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from refimpl.nn.linear import WeightGradQueue, linear_with_grad

__all__ = ["WeightGradStore", "defer_weight_gradients", "linear_deferred_weight"]


class WeightGradStore:
    """Queued weight-gradient computations by key; ``capture`` sets the key of a backward."""

    def __init__(self) -> None:
        self._pending: dict[object, list[Callable[[], torch.Tensor]]] = {}
        self._key: object | None = None
        # called after each W action with the weights whose .grad it changed (ZeRO-2: reduce-scatter them)
        self.after_flush: Callable[[list[torch.Tensor]], None] | None = None
        # called when a weight gradient is queued, with it and the tensors it keeps until its W (a meter's
        # hook: refimpl.measure.run_measurement.TrainerProbe counts them)
        self.on_push: Callable[[Callable[[], torch.Tensor], tuple[torch.Tensor, ...]], None] | None = None

    @contextlib.contextmanager
    def capture(self, key: object) -> Iterator[None]:
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def push(self, fn: Callable[[], torch.Tensor], held: tuple[torch.Tensor, ...] = ()) -> None:
        """Queue ``fn`` under the captured key (outside a capture: run it now); ``held``: the tensors it
        keeps until its ``W``, handed to ``on_push``."""
        if self._key is None:  # outside a captured backward: the plain backward, at once
            fn()
        else:
            self._pending.setdefault(self._key, []).append(fn)
            if self.on_push is not None:
                self.on_push(fn, held)

    def flush(self, key: object) -> int:
        """Run the weight gradients queued under ``key`` (then ``after_flush`` on their weights, each
        once, in the order they were queued); returns how many."""
        fns = self._pending.pop(key, [])
        updated = list({id(w): w for w in (fn() for fn in fns)}.values())
        if self.after_flush is not None and updated:
            self.after_flush(updated)
        return len(fns)

    def __len__(self) -> int:
        return sum(len(v) for v in self._pending.values())


def linear_deferred_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           store: WeightGradStore) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward gives ``dX = dY W`` and the bias gradient and queues
    ``dW = dY^T X`` in ``store`` (under the key of the running ``WeightGradStore.capture``): the one
    linear seam, ``refimpl.nn.linear.linear_with_grad``, with a store."""
    return linear_with_grad(x, weight, bias, weight_grad_store=store)


@runtime_checkable
class _DefersWeightGradients(Protocol):
    """A linear layer of the seam that takes a store for its weight gradients (``refimpl.nn.Linear``, the
    tensor-parallel ``ColumnParallelLinear`` and ``RowParallelLinear``): any module with the attribute."""

    weight_grad_store: WeightGradQueue | None


def defer_weight_gradients(module: nn.Module, store: WeightGradStore) -> nn.Module:
    """Make every linear layer in ``module`` queue its weight gradient in ``store`` (in place): the seam's
    layers (``refimpl.nn.Linear``, the tensor-parallel ``ColumnParallelLinear`` and
    ``RowParallelLinear``: anything with a ``weight_grad_store`` attribute) are given the store, and a plain
    ``nn.Linear`` has its forward replaced by ``linear_deferred_weight``."""
    for linear in module.modules():
        if isinstance(linear, _DefersWeightGradients):
            linear.weight_grad_store = store
        elif isinstance(linear, nn.Linear):
            def forward(x: torch.Tensor, _lin: nn.Linear = linear) -> torch.Tensor:
                return linear_deferred_weight(x, _lin.weight, _lin.bias, store)

            # the ignore: the instance's forward replaces the class's on purpose (torch calls self.forward)
            linear.forward = forward  # type: ignore[method-assign,assignment]
    return module
