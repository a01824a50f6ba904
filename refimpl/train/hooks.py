"""What a caller of :func:`refimpl.train.train` can run inside the loop: :class:`TrainHooks`.

The trainer calls each hook at one documented point of a step, so that a measurement (chapter 10's
:class:`refimpl.measure.run_measurement.TrainerProbe`) or an equivalence test reads what it needs without
replacing the trainer's functions, the ops or the pipeline executor's clock. For step ``step``, in order:

1. ``around_step(step, setup)``: a context manager entered before the step's forward and exited after its
   optimizer step (around :func:`refimpl.train.step.train_step` only: not the loss all-reduce, the record or
   the checkpoint);
2. ``after_first_loss(step, setup, loss)``: inside the first micro-batch, once its loss is computed (the
   forward's saved tensors all held; not called under pipeline parallelism, whose schedule interleaves the
   micro-batches);
3. ``before_optimizer_step(step, setup)``: the gradients reduced, before the loss scaler's check, clipping
   and AdamW; then ``gradient_probe(step, shards)`` with those gradients as boxes of the plain GPT's
   tensors (:func:`refimpl.train.gradients.gradient_shards`; read them there, the step changes them after);
4. ``clock()``: the pipeline executor's clock (seconds), read at every action's start, ready and end
   (default :func:`refimpl.comm.tracer.now`); a hook that samples something at those points returns the
   same clock after sampling.

The run's own probes stay the trainer's: fault injection (``options.faults``) and the heartbeat before the
step and between the first forward and its loss, the heartbeat again after ``gradient_probe``, and the
per-step :class:`~refimpl.comm.CommTracer` around the whole step (a hook's own tracer nests inside it).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from refimpl.distributed.placement import LocalShard

__all__ = ["Hooks", "TrainHooks"]


class Hooks(Protocol):
    """What :func:`refimpl.train.train` reads of its ``hooks``: the five attributes of :class:`TrainHooks`,
    each a callable or None. Any object with them will do (a measurement such as
    :class:`refimpl.measure.run_measurement.TrainerProbe` is one, without importing the trainer)."""

    @property
    def around_step(self) -> Callable[[int, Any], AbstractContextManager[object]] | None: ...

    @property
    def after_first_loss(self) -> Callable[[int, Any, torch.Tensor], None] | None: ...

    @property
    def before_optimizer_step(self) -> Callable[[int, Any], None] | None: ...

    @property
    def gradient_probe(self) -> Callable[[int, dict[str, LocalShard]], None] | None: ...

    @property
    def clock(self) -> Callable[[], float] | None: ...


@dataclass(frozen=True, kw_only=True)
class TrainHooks:
    """Optional callables the trainer calls (module docstring for when); ``setup`` is the run's built
    setup (:func:`refimpl.train.setup.build_setup`), ``step`` the step's index in the run."""

    around_step: Callable[[int, Any], AbstractContextManager[object]] | None = None
    after_first_loss: Callable[[int, Any, torch.Tensor], None] | None = None
    before_optimizer_step: Callable[[int, Any], None] | None = None
    gradient_probe: Callable[[int, dict[str, LocalShard]], None] | None = None
    clock: Callable[[], float] | None = None
