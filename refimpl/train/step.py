"""One optimizer step, read top to bottom (as in nanoGPT's ``train.py``): the rank's shard of the global
batch in micro-batches, each forward and backward under ``no_sync`` but the last (chapter 03: the last
backward launches the bucketed all-reduces), the wait for those reductions, then the checked step of the
mixed-precision driver (chapter 05: unscale, skip on inf/NaN under fp16, clip, AdamW) and ``zero_grad``.

With ``A`` micro-batches of ``b`` sequences each loss is the micro-batch mean divided by ``A``; summed over
the micro-batches and averaged over equal-sized data-parallel ranks it is the mean over the global batch.
Under pipeline parallelism (chapter 08) the ``A`` micro-batches are the pipeline's: one call of the stages'
``step`` runs the schedule's forwards and backwards, and the data-parallel average follows once. An MoE
model's loss includes its blocks' balance losses (scaled alike; under pipeline parallelism each stage's,
backpropagated in that stage), and once the gradients are reduced the
step's expert load is summed over the ranks and DeepSeek-V3's expert bias updated (chapter 09).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from refimpl.comm.device_clock import Stamp
from refimpl.train.setup import _Setup


def train_step(setup: _Setup, inputs: torch.Tensor, labels: torch.Tensor, *, accumulation: int, micro: int,
               device: torch.device, grad_clip: float | None,
               after_first_forward: Callable[[], None] | None = None,
               before_optimizer_step: Callable[[], None] | None = None,
               after_unscale: Callable[[], None] | None = None,
               after_first_loss: Callable[[torch.Tensor], None] | None = None,
               clock: Callable[[], Stamp] | None = None) -> torch.Tensor:
    """Forward, backward and step over ``inputs``/``labels`` (``[accumulation x micro, s]``: this rank's
    shard). Returns this rank's loss (the sum of the scaled micro-batch losses, detached, not reduced).
    ``after_first_forward`` runs inside the first micro-batch, between its forward and its backward (the
    trainer's fault injection and heartbeat); ``after_first_loss(loss)`` once the first micro-batch's loss is
    computed (not under pipeline parallelism); ``before_optimizer_step`` once the gradients are reduced,
    ``after_unscale`` once they are unscaled (fp16), before clipping and AdamW;
    ``clock``: the pipeline executor's clock (``refimpl.train.hooks.TrainHooks``)."""
    mp, dp = setup.mp, setup.dp
    loss_sum = torch.zeros((), device=device)
    if setup.pipeline is not None:  # chapter 08: the schedule runs every micro-batch's forward and backward
        def share(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return setup.loss(logits, y) / accumulation

        aux_loss: Callable[[torch.nn.Module], torch.Tensor | None] | None = None
        if (stage_loss := setup.stage_loss) is not None:
            def balance(stage: torch.nn.Module) -> torch.Tensor | None:  # an MoE stage's loss, / accumulation
                return stage_loss(stage, micro_batches=accumulation)

            aux_loss = balance

        with mp.autocast():
            loss_sum = setup.pipeline.step(inputs.to(device), labels.to(device),
                                           num_microbatches=accumulation, loss_fn=share,
                                           scale_loss=None if mp.scaler is None else mp.scaler.scale,
                                           clock=clock, aux_loss=aux_loss)
        if after_first_forward is not None:
            after_first_forward()  # the step's forwards and backwards are done; the reduction is not
    for i in range(0 if setup.pipeline is not None else accumulation):
        x = inputs[i * micro : (i + 1) * micro].to(device)
        y = labels[i * micro : (i + 1) * micro].to(device)
        last = i == accumulation - 1
        # no_sync must wrap the forward too: the wrapper (like DDP) reads the flag in forward
        # (chapter 03's trap). The last micro-batch's backward launches the bucket all-reduces.
        sync = contextlib.nullcontext() if dp is None or last else dp.no_sync()
        with sync:
            with mp.autocast():
                logits = setup.forward(x)
            if i == 0 and after_first_forward is not None:
                after_first_forward()
            # The per-rank mean over the rank's micro-batch, / accumulation; the gradients are then
            # averaged over equal-sized ranks, which gives the mean over the global batch.
            loss = setup.loss(logits, y)  # under TP: the vocab-parallel loss
            if i == 0 and after_first_loss is not None:
                after_first_loss(loss)
            loss = loss / accumulation
            mp.backward(loss)
        loss_sum += loss.detach()
    if dp is not None:
        dp.finish_gradient_synchronization()  # wait for the buckets before clipping and stepping
    if setup.finish_gradients is not None:
        setup.finish_gradients()  # sequence parallelism: sum the s/t-token gradients over the tp group
    if setup.moe_step is not None:  # MoE: the step's load over dp x cp, DeepSeek-V3's bias update, figures
        setup.moe_metrics = setup.moe_step(accumulation)
    if before_optimizer_step is not None:
        before_optimizer_step()
    mp.step(setup.optimizer, grad_clip=grad_clip, params=setup.grad_params, clip_fn=setup.clip_fn,
            after_unscale=after_unscale)
    setup.optimizer.zero_grad(set_to_none=True)
    return loss_sum
