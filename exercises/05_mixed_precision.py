"""Exercises of chapter 05: mixed precision and activation checkpointing.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=05`` (or
``python -m exercises.grade 05``) to see your score per task. The grader compares your loss-scale rule
with ``torch.amp.GradScaler`` step by step (scale and growth counter after every step, on a sequence of
overflows and finite steps, with growth and backoff factors that are not powers of two), checks Megatron's
hysteresis and minimum scale on a hand-computed trace, and runs a small GPT whose block you checkpoint:
same gradients bit for bit, fewer saved bytes, the block's forward run again during backward.

You may use anything from ``torch``, ``math`` and ``struct``; do not call ``refimpl.precision.update_scale``
or ``refimpl.activations`` (that is the answer).
"""

from __future__ import annotations

from torch import nn

from refimpl.loss_scaler import LossScalerConfig, ScalerState


def update_scale(state: ScalerState, found_inf: bool, config: LossScalerConfig) -> ScalerState:
    """One step of the dynamic loss-scale rule; return the new ``ScalerState(scale, growth_tracker,
    hysteresis_tracker)``.

    ``found_inf`` says whether this step's gradients held an inf or a NaN (the step was skipped).

    * Overflow: ``growth_tracker`` restarts at 0 and ``hysteresis_tracker`` loses 1. When it is then
      ``<= 0`` the scale is multiplied by ``config.backoff_factor``, but never goes below
      ``config.min_scale``. (It keeps decreasing by one, and the scale keeps backing off, on every further
      overflow until the next growth.)
    * Finite step: ``growth_tracker`` gains 1. When it reaches ``config.growth_interval`` the scale is
      multiplied by ``config.growth_factor``, ``growth_tracker`` restarts at 0 and ``hysteresis_tracker``
      is refilled to ``config.hysteresis``. If the grown scale is not finite in float32 the old scale is
      kept (the trackers are reset all the same).

    The scale is a float32 number, as in GradScaler: round every product to float32
    (``struct.unpack("f", struct.pack("f", x))[0]``, or ``torch.tensor(x, dtype=torch.float32).item()``).
    With ``hysteresis=1`` and ``min_scale=0`` this is exactly ``torch.amp.GradScaler``'s rule.
    """
    raise NotImplementedError("update_scale: back off on overflow (after hysteresis), grow after an interval")


def checkpoint_block(block: nn.Module) -> nn.Module:
    """Make ``block`` (a ``refimpl.model.TransformerBlock``) use activation checkpointing; return it.

    After the call, calling ``block(x)`` must save only ``x`` for backward and run the block's forward a
    second time during backward to rebuild the rest, giving exactly the same gradients. Change the block
    in place (its parameter names, and so the model's ``state_dict``, must stay the same): for example
    give the instance a ``forward`` attribute that calls ``torch.utils.checkpoint.checkpoint`` (with
    ``use_reentrant=False``) on the class's forward, ``type(block).forward``, and the block.
    """
    raise NotImplementedError("checkpoint_block: wrap the block's forward in torch.utils.checkpoint")
