"""What a trainer run holds, measured inside the run itself: ``TrainerProbe`` (chapter 12).

The planner's prediction of a run (``refimpl.planner.run_prediction.predict_run``) is checked against
three measurements of a different source, taken in one step of ``refimpl.train.train`` (the
trainer's own setup, batch and schedule):

* **state**: ``refimpl.measure.state.state_bytes`` of the rank's parameters (its pipeline stages, its
  tensor-parallel shards), their ``.grad`` and the optimizer's state, read just before the optimizer
  step (the gradients reduced; the optimizer state from the step before);
* **activations without pipeline parallelism**: ``refimpl.measure.activations.SavedTensorMeter`` on
  the model over the step's first micro-batch, read once its loss is computed (its backward frees them
  before the next micro-batch's forward);
* **activations under pipeline parallelism**: the bytes saved for backward and kept for sends that are
  alive between the schedule's actions, at their most (each storage once, parameters and autocast's weight
  copies left out; a saved tensor counts until autograd frees it, a sent one until its storage is freed,
  whoever kept it: the runtime's send, or the stage output the backward needs), read whenever the executor
  reads its clock (an action's start, ready and end), as tests/planner/ranks/test_planner_pp.py counts them
  for chapter 08. The sent tensors are seen through ``refimpl.comm.CommTracer``'s ``on_send`` (every send,
  plain or in a ``batch_isend_irecv`` group), not by patching the ops; under zbh1 what each queued weight
  gradient keeps until its ``W`` (the seam declares it) through its store's ``on_push``.

Both activation meters know a storage by its identity (``refimpl.measure.activations.storage_key``),
not its address, and take every saved ``nn.Parameter`` for a parameter: under ZeRO-3 the weights a unit
gathers for its forward are ``nn.Parameter`` objects the module's ``parameters()`` do not list (those are
the shards), freed after the forward by shrinking their storage to 0 bytes, whose address the allocator
then gives to an activation; keyed by address the meters skipped that activation and counted the gathered
LayerNorm weights (saved as themselves) as activations (tests/planner/ranks/test_planner_zero3.py, with and
without pipeline parallelism). Under ZeRO-3 the **state** is the rank's shards (the model's parameters when
the step begins), their gradients and the optimizer's state: the gathered full weights and gradients, freed
once the gradients are reduce-scattered (per unit, or under pipeline parallelism after the schedule), are
not parameters of the module and are not counted; tests/planner/ranks/test_planner_zero3.py measures them
freed there.

The probe is a set of the trainer's hooks (``train(..., hooks=probe)``): nothing of the trainer, the
ops or the executor is replaced.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

from refimpl.comm.device_clock import Stamp
from refimpl.comm.tracer import CommTracer, now

if TYPE_CHECKING:
    from refimpl.measure.activations import SavedTensorMeter

__all__ = ["LiveTensorBytes", "StepMeasurement", "TrainerProbe"]


@dataclass(frozen=True, kw_only=True)
class StepMeasurement:
    """One measured step of one rank: ``state`` (weights, grads, optimizer bytes) and ``activations``
    (saved bytes held at the peak, see the module docstring)."""

    state: tuple[int, int, int]
    activations: int


class _Seen(TypedDict, total=False):
    """What the measured step has read so far: the ``StepMeasurement`` fields."""

    state: tuple[int, int, int]
    activations: int


class _Held:
    """What a saved tensor is packed into: dropped when autograd frees the saved tensor."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class LiveTensorBytes:
    """Bytes of the tensors handed to ``hold`` that are alive now (each storage once, by identity:
    ``refimpl.measure.activations.storage_key``; the parameters left out, ``params``' storages and any
    ``nn.Parameter``, ZeRO-3's gathered weights too, and, with ``skip_weight_copies``, autocast's casts of
    them), the most at any time (``peak``) and the most at a ``sample`` (``between``). ``pack`` is a
    ``saved_tensors_hooks`` pack hook (unpack: ``lambda held: held.t``): a saved tensor counts until
    autograd frees it. A counted storage stays alive until it is released (the held tensor, or the storage
    itself, keeps it), so its key is not reused meanwhile."""

    def __init__(self, params, *, skip_weight_copies: bool = True) -> None:
        from refimpl.measure.activations import storage_key

        self.params = {storage_key(q) for q in params}
        self.skip_weight_copies = skip_weight_copies
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.now = self.peak = self.between = 0

    def sample(self) -> None:
        self.between = max(self.between, self.now)

    def hold(self, obj: object, t: torch.Tensor) -> None:
        """Count ``t``'s storage until ``obj`` is garbage."""
        from refimpl.measure.activations import _is_parameter, _is_weight, storage_key

        storage = t.untyped_storage()
        key = storage_key(t)
        if (storage.nbytes() == 0 or _is_parameter(t, self.params)
                or (self.skip_weight_copies and _is_weight(t, self.params))):
            return
        if not self.refs.get(key):
            self.size[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1
        weakref.finalize(obj, self.release, key)

    def release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.now -= self.size.pop(key)

    def hold_storage(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until the storage itself is freed (whichever tensors keep it)."""
        self.hold(t.untyped_storage(), t)

    def sends(self) -> CommTracer:
        """A tracer that counts every tensor this rank sends (``hold_storage``) while it is active:
        ``with live.sends(): ...``."""
        return CommTracer(on_send=self.hold_storage)

    def hold_queued(self, fn: object, held: tuple[torch.Tensor, ...]) -> None:
        """Count what a queued weight gradient ``fn`` keeps until its ``W`` (a
        ``refimpl.parallel.pipeline_parallel.WeightGradStore``'s ``on_push``)."""
        for t in held:
            self.hold(fn, t)

    def pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        self.hold(held, t)
        return held


class TrainerProbe:
    """``probe = TrainerProbe(step=1); train(config, ctx, options, hooks=probe)``; then
    ``probe.measured`` (a ``StepMeasurement`` of step ``step`` of the run, counted from the run's first
    step). The probe is a set of the trainer's hooks (``refimpl.train.hooks.Hooks``): the
    step's meters entered around it (``around_step``), the first micro-batch's saved bytes read once its
    loss is computed (``after_first_loss``), the state read before the optimizer step, and under pipeline
    parallelism the executor's clock reads (``clock``) as the sampling points."""

    def __init__(self, *, step: int = 1) -> None:
        self.step = step
        self.measured: StepMeasurement | None = None
        self._first: int | None = None  # the run's first step
        self._params: list | None = None  # set while the measured step runs
        self._seen: _Seen = {}
        self._meter: SavedTensorMeter | None = None  # the SavedTensorMeter of the measured step (no pipeline)
        self._live: LiveTensorBytes | None = None  # the live bytes of the measured step (pipeline)
        self.gradient_probe = None  # the trainer's hooks: around_step, after_first_loss,
        # before_optimizer_step and clock below (refimpl.train.hooks.Hooks)

    @contextlib.contextmanager
    def around_step(self, step: int, setup) -> Iterator[None]:
        if self._first is None:
            self._first = step
        if step - self._first != self.step:
            yield
            return
        from refimpl.measure.activations import SavedTensorMeter

        self._params = list((setup.pipeline if setup.pipeline is not None else setup.model).parameters())
        self._seen = {}
        try:
            if setup.pipeline is None:  # every micro-batch's forward and loss saves alike: one's share
                with SavedTensorMeter(setup.model) as self._meter:
                    yield
            else:
                self._live = live = LiveTensorBytes(self._params)
                store = setup.pipeline.store  # zbh1: what each queued weight gradient keeps until its W
                if store is not None:
                    store.on_push = live.hold_queued
                saved = torch.autograd.graph.saved_tensors_hooks(live.pack, lambda held: held.t)
                try:
                    with live.sends(), saved:
                        yield
                finally:
                    if store is not None:
                        store.on_push = None
                self._seen["activations"] = live.between
        finally:
            self._params, self._meter, self._live = None, None, None
        self.measured = StepMeasurement(state=self._seen["state"], activations=self._seen["activations"])

    def after_first_loss(self, step: int, setup, loss: torch.Tensor) -> None:
        if self._meter is not None:  # the first micro-batch, forward done
            self._seen.setdefault("activations", self._meter.report.total)

    def before_optimizer_step(self, step: int, setup) -> None:
        if self._params is not None:
            from refimpl.measure.state import state_bytes

            st = state_bytes(self._params, setup.optimizer)
            self._seen["state"] = (st.weights, st.grads, st.optimizer)

    def clock(self) -> Stamp:
        if self._live is not None:  # the executor's clock reads are the sampling points
            self._live.sample()
        return now()
