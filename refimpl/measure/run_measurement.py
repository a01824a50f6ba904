"""What a trainer run holds, measured inside the run itself: :class:`TrainerProbe` (chapter 10).

The planner's prediction of a run (:func:`refimpl.planner.run_prediction.predict_run`) is checked against
three measurements of a different source, taken in one step of :func:`refimpl.train.train` (the
trainer's own setup, batch and schedule):

* **state**: :func:`refimpl.measure.state.state_bytes` of the rank's parameters (its pipeline stages, its
  tensor-parallel shards), their ``.grad`` and the optimizer's state, read just before the optimizer
  step (the gradients reduced; the optimizer state from the step before);
* **activations without pipeline parallelism**: :class:`~refimpl.measure.activations.SavedTensorMeter` on
  the model over the step's first micro-batch, read once its loss is computed (its backward frees them
  before the next micro-batch's forward);
* **activations under pipeline parallelism**: the bytes saved for backward and kept for sends that are
  alive between the schedule's actions, at their most (each storage once, parameters and autocast's weight
  copies left out; a saved tensor counts until autograd frees it, a sent one until its storage is freed,
  whoever kept it: the runtime's send, or the stage output the backward needs), read whenever the executor
  reads its clock (an action's start, ready and end), as tests/test_planner_pp.py counts them for chapter
  08. The sent tensors are seen through :class:`refimpl.comm.CommTracer`'s ``on_send`` (every send, plain
  or in a ``batch_isend_irecv`` group), not by patching the ops.

The probe wraps the trainer's ``train_step`` for the duration of a ``with`` block (one process, one run at a
time: the trainer has no other hook for this) and restores it on exit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from refimpl.comm.tracer import CommTracer

__all__ = ["LiveTensorBytes", "StepMeasurement", "TrainerProbe"]


@dataclass(frozen=True, kw_only=True)
class StepMeasurement:
    """One measured step of one rank: ``state`` (weights, grads, optimizer bytes) and ``activations``
    (saved bytes held at the peak, see the module docstring)."""

    state: tuple[int, int, int]
    activations: int


class _Held:
    """What a saved tensor is packed into: dropped when autograd frees the saved tensor."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class LiveTensorBytes:
    """Bytes of the tensors handed to :meth:`hold` that are alive now (each storage once, the parameters
    left out and, with ``skip_weight_copies``, autocast's casts of them), the most at any time (``peak``)
    and the most at a :meth:`sample` (``between``). :meth:`pack` is a ``saved_tensors_hooks`` pack hook
    (unpack: ``lambda held: held.t``): a saved tensor counts until autograd frees it."""

    def __init__(self, params, *, skip_weight_copies: bool = True) -> None:
        self.params = {q.untyped_storage().data_ptr() for q in params}
        self.skip_weight_copies = skip_weight_copies
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.now = self.peak = self.between = 0

    def sample(self) -> None:
        self.between = max(self.between, self.now)

    def hold(self, obj: object, t: torch.Tensor) -> None:
        """Count ``t``'s storage until ``obj`` is garbage."""
        from refimpl.measure.activations import _is_weight

        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.params or (self.skip_weight_copies and _is_weight(t, self.params)):
            return
        if not self.refs.get(ptr):
            self.size[ptr] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        weakref.finalize(obj, self.release, ptr)

    def release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            self.now -= self.size.pop(ptr)

    def hold_storage(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until the storage itself is freed (whichever tensors keep it)."""
        self.hold(t.untyped_storage(), t)

    def sends(self) -> CommTracer:
        """A tracer that counts every tensor this rank sends (:meth:`hold_storage`) while it is active:
        ``with live.sends(): ...``."""
        return CommTracer(on_send=self.hold_storage)

    def pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        self.hold(held, t)
        return held


class TrainerProbe:
    """``with TrainerProbe(step=1) as probe: train(config, ctx, options)``; then ``probe.measured`` (a
    :class:`StepMeasurement` of step ``step`` of the run, counted from the run's first step)."""

    def __init__(self, *, step: int = 1) -> None:
        self.step = step
        self.measured: StepMeasurement | None = None
        self._calls = 0

    def __enter__(self) -> TrainerProbe:
        import refimpl.train.loop as loop

        self._loop, self._original = loop, loop.train_step
        loop.train_step = self._probed
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.train_step = self._original

    def _probed(self, setup, inputs, labels, **kw):
        self._calls += 1
        if self._calls - 1 != self.step:
            return self._original(setup, inputs, labels, **kw)
        from refimpl.measure.state import state_bytes

        params = list((setup.pipeline if setup.pipeline is not None else setup.model).parameters())
        seen: dict[str, object] = {}
        before = kw.get("before_optimizer_step")

        def before_optimizer_step() -> None:
            st = state_bytes(params, setup.optimizer)
            seen["state"] = (st.weights, st.grads, st.optimizer)
            if before is not None:
                before()

        kw |= {"before_optimizer_step": before_optimizer_step}
        if setup.pipeline is None:  # every micro-batch's forward and loss saves alike: one's share
            from refimpl.measure.activations import SavedTensorMeter

            loss_fn = setup.loss

            def first_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                loss = loss_fn(logits, y)
                seen.setdefault("activations", meter.report.total)  # the first micro-batch, forward done
                return loss

            setup.loss = first_loss
            try:
                with SavedTensorMeter(setup.model) as meter:
                    out = self._original(setup, inputs, labels, **kw)
            finally:
                setup.loss = loss_fn
        else:
            live = LiveTensorBytes(params)
            out = self._pipeline_step(live, setup, inputs, labels, kw)
            seen["activations"] = live.between
        self.measured = StepMeasurement(state=seen["state"], activations=seen["activations"])
        return out

    def _pipeline_step(self, live: LiveTensorBytes, setup, inputs, labels, kw):
        import refimpl.parallel.pipeline_parallel.executor as executor

        clock = executor.now

        def sampled_now() -> float:
            live.sample()
            return clock()

        executor.now = sampled_now  # the executor's clock reads are the sampling points
        try:
            with live.sends(), torch.autograd.graph.saved_tensors_hooks(live.pack, lambda held: held.t):
                return self._original(setup, inputs, labels, **kw)
        finally:
            executor.now = clock
