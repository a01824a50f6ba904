"""Bytes of model state a rank holds, counted from the tensors themselves (chapters 01 and 04).

Process memory (RSS) mixes the interpreter, libraries, activations and allocator slack; a ZeRO claim is
about three things only: **parameters, gradients and optimizer state**. ``state_bytes`` adds up the
storages behind them, each storage once (tied weights, views of one flat buffer and optimizer shards that
alias the parameters are not counted twice), and unwraps DTensors (FSDP2) to the local shard.

``StateMemory`` is the one record of such bytes in refimpl: what is measured here and what the
planner predicts (``refimpl.planner.state_memory``, ``refimpl.planner.zero_memory``; Rajbhandari
et al. 2020, "ZeRO", section 5) are the same class, so a chapter compares them with ``==``.
``refimpl.measure.peak.PeakStateBytes`` follows the same count through a whole step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["StateMemory", "local_tensor", "state_bytes", "storage_bytes", "tensors_in"]


@dataclass(frozen=True, kw_only=True)
class StateMemory:
    """Bytes of model state held by one device: ``weights``, ``grads`` and ``optimizer`` state."""

    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's memory: a DTensor's local shard, else ``t`` itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _storage_key(t: torch.Tensor) -> tuple[str, int, int] | None:
    s = local_tensor(t).untyped_storage()
    if s.nbytes() == 0:
        return None
    return (str(s.device), s.data_ptr(), s.nbytes())


def storage_bytes(tensors: Iterable[torch.Tensor | None], *, exclude: set | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped; freed storages count 0).

    ``exclude`` is a set of storages already counted elsewhere; the storages counted here are added to it.
    """
    seen = exclude if exclude is not None else set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = _storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += key[2]
    return total


def tensors_in(obj: object) -> list[torch.Tensor]:
    """Every tensor inside nested dicts / lists / tuples (an optimizer's ``state``)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


def state_bytes(
    params: nn.Module | Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra_params: Iterable[torch.Tensor] = (),
    extra_grads: Iterable[torch.Tensor | None] = (),
) -> StateMemory:
    """Parameter, gradient and optimizer-state bytes held now by this rank.

    Parameters are those of ``params`` (a module or tensors), those the optimizer steps (the shards of a
    sharded optimizer alias the parameters and are then not counted again) and ``extra_params``; gradients
    are their ``.grad`` plus ``extra_grads``; optimizer state is every tensor in ``optimizer.state``.
    Each storage is counted once, in the first category it appears in.
    """
    tensors = list(params.parameters() if isinstance(params, nn.Module) else params)
    if optimizer is not None:
        tensors += [p for g in optimizer.param_groups for p in g["params"]]
        inner = getattr(optimizer, "optimizer", None)  # a wrapper (ShardedOptimizer) steps these
        if isinstance(inner, torch.optim.Optimizer):
            tensors += [p for g in inner.param_groups for p in g["params"]]
    tensors += list(extra_params)
    seen: set = set()
    weights = storage_bytes(tensors, exclude=seen)
    grads = storage_bytes([t.grad for t in tensors] + list(extra_grads), exclude=seen)
    opt = storage_bytes(tensors_in(dict(optimizer.state)) if optimizer is not None else [], exclude=seen)
    return StateMemory(weights=weights, grads=grads, optimizer=opt)
