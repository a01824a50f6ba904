"""One optimizer step, read top to bottom (as in nanoGPT's ``train.py``): ``train_step`` branches once,
for the pipeline, and calls four functions in order (chapter 12 walks them for one layout):

1. ``forward_backward``: the rank's shard of the global batch in micro-batches, each forward and backward
   under ``no_sync`` but the last (chapter 03: the last backward launches the bucketed all-reduces); or,
   under pipeline parallelism (chapter 08), ``pipeline_forward_backward``: one call of the stages' ``step``
   runs the schedule's forwards and backwards of every micro-batch;
2. ``reduce_gradients``: the wait for those reductions, sequence parallelism's sum over the tp group, an
   MoE model's expert load (chapter 09);
3. the caller's ``before_optimizer_step`` (``StepPoints``);
4. ``optimizer_step``: the checked step of the mixed-precision driver (chapter 05: unscale, skip on
   inf/NaN under fp16, clip, AdamW) and ``zero_grad``.

With ``A`` micro-batches of ``b`` sequences each loss is the micro-batch mean divided by ``A``; summed over
the micro-batches and averaged over equal-sized data-parallel ranks it is the mean over the global batch.
An MoE model's loss includes its blocks' balance losses (scaled alike; under pipeline parallelism each
stage's, backpropagated in that stage). What a layout changes is inside ``setup``
(``refimpl.train.setup.build_setup``): the wrapper the batch goes through, the loss (vocab-parallel under
tp), the reductions, the clipping norm (over shards), the optimizer (sharded under ZeRO).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refimpl.comm.device_clock import Stamp
from refimpl.train.setup import _Setup


def _nothing(*_: object) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class StepPoints:
    """Where one step lets its caller in (the trainer binds its hooks here, ``refimpl.train.hooks``; each
    does nothing by default): ``after_first_forward()`` inside the first micro-batch, between its forward
    and its backward (under pipeline parallelism once the schedule's forwards and backwards are done);
    ``after_first_loss(loss)`` once the first micro-batch's loss is computed (not under pipeline
    parallelism); ``before_optimizer_step()`` once the gradients are reduced; ``after_unscale()`` once
    they are unscaled (fp16), before clipping and AdamW; ``clock``: the pipeline executor's clock."""

    after_first_forward: Callable[[], None] = _nothing
    after_first_loss: Callable[[torch.Tensor], None] = _nothing
    before_optimizer_step: Callable[[], None] = _nothing
    after_unscale: Callable[[], None] = _nothing
    clock: Callable[[], Stamp] | None = None


NO_POINTS = StepPoints()


def train_step(setup: _Setup, inputs: torch.Tensor, labels: torch.Tensor, *, accumulation: int, micro: int,
               grad_clip: float | None, points: StepPoints = NO_POINTS) -> torch.Tensor:
    """One optimizer step over ``inputs``/``labels`` (``[accumulation x micro, s]``: this rank's shard, on
    its device); returns this rank's loss (the sum of the scaled micro-batch losses, detached, not
    reduced). The module docstring walks it; ``points``: where the caller comes in (``StepPoints``)."""
    if setup.pipeline is not None:  # chapter 08: the schedule runs every micro-batch's forward and backward
        loss = pipeline_forward_backward(setup, inputs, labels, accumulation=accumulation, points=points)
    else:  # chapter 03: the micro-batches one after the other, each backward accumulating into .grad
        loss = forward_backward(setup, inputs, labels, accumulation=accumulation, micro=micro, points=points)
    reduce_gradients(setup, accumulation=accumulation)  # data parallelism's wait, SP's sum, MoE's load
    points.before_optimizer_step()
    optimizer_step(setup, grad_clip=grad_clip, after_unscale=points.after_unscale)  # unscale, clip, AdamW
    return loss


def forward_backward(setup: _Setup, inputs: torch.Tensor, labels: torch.Tensor, *, accumulation: int,
                     micro: int, points: StepPoints) -> torch.Tensor:
    """Each micro-batch's forward, loss and backward, under ``no_sync`` but the last (chapter 03: the last
    backward launches the bucketed all-reduces); the loss of each is its mean / ``accumulation``."""
    loss_sum = torch.zeros((), device=inputs.device)
    for i in range(accumulation):
        x, y = inputs[i * micro : (i + 1) * micro], labels[i * micro : (i + 1) * micro]  # [micro, s] each
        last = i == accumulation - 1
        # no_sync must wrap the forward too: the wrapper (like DDP) reads the flag in forward
        # (chapter 03's trap). The last micro-batch's backward launches the bucket all-reduces.
        sync = setup.parallel.sync  # ZeRO-0 over several ranks: the bucketed wrapper, else None
        with contextlib.nullcontext() if sync is None or last else sync.no_sync():
            with setup.mp.autocast():
                logits = setup.forward(x)
            if i == 0:
                points.after_first_forward()
            # The per-rank mean over the rank's micro-batch, / accumulation; the gradients are then
            # averaged over equal-sized ranks, which gives the mean over the global batch.
            loss = setup.parallel.loss(logits, y)  # under TP: the vocab-parallel loss
            if i == 0:
                points.after_first_loss(loss)
            loss = loss / accumulation
            setup.mp.backward(loss)
        loss_sum += loss.detach()
    return loss_sum


def pipeline_forward_backward(setup: _Setup, inputs: torch.Tensor, labels: torch.Tensor, *, accumulation: int,
                              points: StepPoints) -> torch.Tensor:
    """The pipeline's ``accumulation`` micro-batches through its schedule (chapter 08): one call of the
    stages' ``step`` runs every forward and backward; an MoE stage adds its balance losses (chapter 09)."""
    assert setup.pipeline is not None  # train_step's branch

    def share(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return setup.parallel.loss(logits, y) / accumulation

    def balance(stage: torch.nn.Module) -> torch.Tensor | None:  # an MoE stage's own loss, / accumulation
        return setup.parallel.stage_balance_loss(stage, micro_batches=accumulation)

    mp = setup.mp
    with mp.autocast():
        loss_sum = setup.pipeline.step(inputs, labels, num_microbatches=accumulation, loss_fn=share,
                                       scale_loss=None if mp.scaler is None else mp.scaler.scale,
                                       clock=points.clock,
                                       aux_loss=None if setup.experts is None else balance)
    points.after_first_forward()  # the step's forwards and backwards are done; the reduction is not
    return loss_sum


def reduce_gradients(setup: _Setup, *, accumulation: int) -> None:
    """What completes the gradients after the backwards: the wait for data parallelism's bucketed
    all-reduces (chapter 03; ZeRO's reductions are its optimizer's), sequence parallelism's sum of the
    replicated weights' ``s/t``-token gradients over the tp group (chapter 06), and for an MoE model the
    step's expert load summed over dp x cp with DeepSeek-V3's bias update (chapter 09)."""
    if setup.parallel.sync is not None:
        setup.parallel.sync.finish_gradient_synchronization()
    setup.optim.finish_gradients()  # nothing where the layout needs nothing more
    if setup.experts is not None:
        setup.experts.finish_step(accumulation)  # its figures: setup.experts.figures


def optimizer_step(setup: _Setup, *, grad_clip: float | None, after_unscale: Callable[[], None]) -> None:
    """The mixed-precision driver's checked step (chapter 05: unscale, skip on inf/NaN under fp16, clip the
    global norm, AdamW), then ``zero_grad``."""
    setup.optim.step(setup.mp, grad_clip=grad_clip, after_unscale=after_unscale)
