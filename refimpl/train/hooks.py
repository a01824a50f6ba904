"""What runs inside the loop of ``refimpl.train.train``, at documented points: ``TrainHooks``,
and ``compose``, which makes one hooks object of several.

The trainer calls each hook at one point of a step, so that a measurement (chapter 12's
``refimpl.measure.run_measurement.TrainerProbe``), an equivalence test or the run's own probes
(``refimpl.train.probes.RunProbes``: fault injection, the test sleep, the heartbeat) read or do what
they need without replacing the trainer's functions, the ops or the pipeline executor's clock. For step
``step``, in order:

1. ``before_step(step, setup)``: the step begins, before its learning rate, its batch and ``around_step``;
2. ``around_step(step, setup)``: a context manager entered before the step's forward and exited after its
   optimizer step (around ``refimpl.train.step.train_step`` only: not the loss all-reduce, the record or
   the checkpoint);
3. ``after_first_forward(step, setup)``: inside the first micro-batch, between its forward and its loss
   (before any backward); under pipeline parallelism once the schedule's forwards and backwards are done,
   before the data-parallel reduction;
4. ``after_first_loss(step, setup, loss)``: inside the first micro-batch, once its loss is computed (the
   forward's saved tensors all held; not called under pipeline parallelism, whose schedule interleaves the
   micro-batches);
5. ``before_optimizer_step(step, setup)``: the gradients reduced, before the loss scaler's check, clipping
   and AdamW;
6. ``gradient_probe(step, shards)``: the gradients the optimizer receives, once the loss scaler has
   unscaled and checked them (fp16), as boxes of the plain GPT's tensors
   (``refimpl.train.gradients.gradient_shards``, computed only when some hook has this point; read
   them there, clipping and the step change them after);
7. ``after_gradient_probe(step, setup)``: the last point before clipping and AdamW (called with or without
   a ``gradient_probe``); then ``around_step`` exits, the loss is averaged over the ranks and the step's
   record written;
8. ``before_checkpoint(step, setup)``: after that, when a save is due (on the schedule, at the end, on
   SIGTERM), just before it.

Besides the steps:

- ``on_failure(step, setup, exc)``: an exception (not ``refimpl.train.Preempted``: a preemption saved
  and stops) leaves the steps during step ``step``; it propagates once every hook has run;
- ``clock()``: the pipeline executor's clock (seconds), read at every action's start, ready and end
  (default ``refimpl.comm.tracer.now``); a hook that samples something at those points returns the
  same clock after sampling.

**Composition.** The trainer calls one object, ``compose(RunProbes(...), hooks)``: at each point the run's
own probes, then the caller's hooks, in the same way. ``compose`` calls its members in order at every
point; ``around_step`` nests them (the first outermost: entered first, exited last); ``clock`` reads every
member's clock in order and returns the last one's reading (each sampler samples; with one clock, that
clock). The members' attributes are read once, when composed (the trainer: when the steps begin); an
attribute a member lacks reads as None (``getattr(member, name, None)``), so an object that has only the
five points the trainer offered first (``around_step``, ``after_first_loss``, ``before_optimizer_step``,
``gradient_probe``, ``clock``: ``refimpl.measure.run_measurement.TrainerProbe``) still works.

So, within a step: the heartbeat's "forward" and a planned preemption come before the caller's
``before_step``; a planned kill or hang, the test sleep and the heartbeat's "backward and gradient
reduction" before the caller's ``after_first_forward``; the heartbeat's "optimizer step" after the caller's
``gradient_probe`` (it is the run's ``after_gradient_probe``), its "checkpoint" before the caller's
``before_checkpoint``, and the failure report (naming the rank behind, in ``failures.jsonl``) before the
caller's ``on_failure``. The per-step ``refimpl.comm.CommTracer`` (the bytes in ``metrics.jsonl``)
stays the trainer's, around the whole step (a hook's own tracer nests inside it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from refimpl.comm.device_clock import Stamp
from refimpl.distributed.placement import LocalShard

__all__ = ["POINTS", "Hooks", "TrainHooks", "compose"]


class Hooks(Protocol):
    """What ``refimpl.train.train`` reads of its ``hooks``: the attributes of ``TrainHooks``, each
    a callable or None. Any object with them will do (a measurement such as
    ``refimpl.measure.run_measurement.TrainerProbe`` is one, without importing the trainer); an
    attribute it lacks reads as None (``compose`` reads each with ``getattr(hooks, name, None)``): every
    point is optional in practice, though a type checker would ask for all of them."""

    @property
    def before_step(self) -> Callable[[int, Any], None] | None: ...

    @property
    def around_step(self) -> Callable[[int, Any], AbstractContextManager[object]] | None: ...

    @property
    def after_first_forward(self) -> Callable[[int, Any], None] | None: ...

    @property
    def after_first_loss(self) -> Callable[[int, Any, torch.Tensor], None] | None: ...

    @property
    def before_optimizer_step(self) -> Callable[[int, Any], None] | None: ...

    @property
    def gradient_probe(self) -> Callable[[int, dict[str, LocalShard]], None] | None: ...

    @property
    def after_gradient_probe(self) -> Callable[[int, Any], None] | None: ...

    @property
    def before_checkpoint(self) -> Callable[[int, Any], None] | None: ...

    @property
    def on_failure(self) -> Callable[[int, Any, BaseException], None] | None: ...

    @property
    def clock(self) -> Callable[[], Stamp] | None: ...


@dataclass(frozen=True, kw_only=True)
class TrainHooks:
    """Optional callables the trainer calls (module docstring for when); ``setup`` is the run's built
    setup (``refimpl.train.setup.build_setup``), ``step`` the step's index in the run."""

    before_step: Callable[[int, Any], None] | None = None
    around_step: Callable[[int, Any], AbstractContextManager[object]] | None = None
    after_first_forward: Callable[[int, Any], None] | None = None
    after_first_loss: Callable[[int, Any, torch.Tensor], None] | None = None
    before_optimizer_step: Callable[[int, Any], None] | None = None
    gradient_probe: Callable[[int, dict[str, LocalShard]], None] | None = None
    after_gradient_probe: Callable[[int, Any], None] | None = None
    before_checkpoint: Callable[[int, Any], None] | None = None
    on_failure: Callable[[int, Any, BaseException], None] | None = None
    clock: Callable[[], Stamp] | None = None


POINTS = tuple(f.name for f in fields(TrainHooks))  # the points, in the order of a step; then the others


def compose(*hooks: Hooks | None) -> TrainHooks:
    """One ``TrainHooks`` that runs ``hooks`` (None entries skipped) in order at every point; nested
    ``around_step``, the last clock's reading (module docstring). A point no member has stays None."""
    members = [h for h in hooks if h is not None]
    chosen = {}
    for name in POINTS:
        found = [f for h in members if (f := getattr(h, name, None)) is not None]
        if len(found) <= 1:
            chosen[name] = found[0] if found else None
        elif name == "around_step":
            chosen[name] = _nested(found)
        elif name == "clock":
            chosen[name] = _last_reading(found)
        else:
            chosen[name] = _in_order(found)
    return TrainHooks(**chosen)


def _in_order(calls: list[Callable[..., None]]) -> Callable[..., None]:
    def call(*args: Any) -> None:
        for f in calls:
            f(*args)

    return call


def _nested(managers: list[Callable[[int, Any], AbstractContextManager[object]]]):
    @contextmanager
    def around_step(step: int, setup: Any) -> Iterator[None]:
        with ExitStack() as stack:  # the first entered first, exited last (an exception passes through all)
            for manager in managers:
                stack.enter_context(manager(step, setup))
            yield

    return around_step


def _last_reading(clocks: list[Callable[[], Stamp]]) -> Callable[[], Stamp]:
    def clock() -> Stamp:
        for read in clocks[:-1]:
            read()
        return clocks[-1]()

    return clock
