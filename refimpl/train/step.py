"""One optimizer step, read top to bottom (as in nanoGPT's ``train.py``): the rank's shard of the global
batch in micro-batches, each forward and backward under ``no_sync`` but the last (chapter 03: the last
backward launches the bucketed all-reduces), the wait for those reductions, then the checked step of the
mixed-precision driver (chapter 05: unscale, skip on inf/NaN under fp16, clip, AdamW) and ``zero_grad``.

With ``A`` micro-batches of ``b`` sequences each loss is the micro-batch mean divided by ``A``; summed over
the micro-batches and averaged over equal-sized data-parallel ranks it is the mean over the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from refimpl.train.setup import _Setup


def train_step(setup: _Setup, inputs: torch.Tensor, labels: torch.Tensor, *, accumulation: int, micro: int,
               device: torch.device, grad_clip: float | None,
               after_first_forward: Callable[[], None] | None = None,
               before_optimizer_step: Callable[[], None] | None = None) -> torch.Tensor:
    """Forward, backward and step over ``inputs``/``labels`` (``[accumulation x micro, s]``: this rank's
    shard). Returns this rank's loss (the sum of the scaled micro-batch losses, detached, not reduced).
    ``after_first_forward`` runs inside the first micro-batch, between its forward and its backward (the
    trainer's fault injection and heartbeat); ``before_optimizer_step`` once the gradients are reduced."""
    mp, dp = setup.mp, setup.dp
    loss_sum = torch.zeros((), device=device)
    for i in range(accumulation):
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
            loss = setup.loss(logits, y) / accumulation  # under TP: the vocab-parallel loss
            mp.backward(loss)
        loss_sum += loss.detach()
    if dp is not None:
        dp.finish_gradient_synchronization()  # wait for the buckets before clipping and stepping
    if setup.finish_gradients is not None:
        setup.finish_gradients()  # sequence parallelism: sum the s/t-token gradients over the tp group
    if before_optimizer_step is not None:
        before_optimizer_step()
    mp.step(setup.optimizer, grad_clip=grad_clip, params=setup.grad_params, clip_fn=setup.clip_fn)
    setup.optimizer.zero_grad(set_to_none=True)
    return loss_sum
