"""Exercises of chapter 05: mixed precision and activation checkpointing.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=05`` (or
``python -m exercises.grade 05``) to see your score per task. The grader compares your loss-scale rule
with ``torch.amp.GradScaler`` step by step (scale and growth counter after every step, on a sequence of
overflows and finite steps, with growth and backoff factors that are not powers of two), checks Megatron's
hysteresis and minimum scale on a hand-computed trace, runs your overflow agreement on 2 ranks (one rank
sees an inf or a NaN: every rank must say so), and runs a small GPT whose block you checkpoint: same
gradients bit for bit, fewer saved bytes, the block's forward run again during backward.

You may use anything from ``torch``, ``math`` and ``struct``; do not call ``refimpl.precision.update_scale``
``refimpl.precision.loss_scaler.overflow_on_any_rank`` or
``refimpl.parallel.activation_checkpoint`` (that is the answer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from refimpl.precision.loss_scaler import LossScalerConfig, ScalerState


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


def overflow_on_any_rank(
    grads: list[torch.Tensor], *, device: torch.device, group: dist.ProcessGroup | None = None
) -> bool:
    """True when any tensor of ``grads`` on **any** rank of ``group`` holds an inf or a NaN.

    Called by every rank of ``group`` in the same step, each with the gradients it checks (under ZeRO its
    own shard, so ranks see different tensors). Contract:

    * every rank returns the same answer: one rank's overflow makes every rank skip the step, so that the
      ranks keep the same weights and the same loss scale;
    * ``+inf``, ``-inf`` and NaN all count, in any dtype of ``grads``;
    * a rank may hold no gradients at all (an empty list) and must still take part;
    * the ranks exchange one number per call, not the gradients, with ``refimpl.comm.ops`` (so the tracer
      of the grader sees it), on ``device``, where the gradients live: NCCL reduces only GPU tensors.

    Traps: a rank that stops at its own first inf without joining the others leaves them waiting forever;
    ``x == float("nan")`` is never true.
    """
    raise NotImplementedError("overflow_on_any_rank: decide together whether anybody overflowed")


def checkpoint_block(block: nn.Module) -> nn.Module:
    """Make ``block`` (a ``refimpl.models.TransformerBlock``) use activation checkpointing; return it.

    After the call, ``block(x)`` saves only ``x`` for backward and runs the block's forward a second time
    during backward to rebuild the rest; the gradients are the plain block's, bit for bit. The block is
    changed in place and returned: its parameter names, and so the model's ``state_dict``, stay the same.

    Traps: a detached input gives no gradient to the layers below the block; wrapping the block in a new
    module renames its parameters; calling ``block.forward`` from inside your new forward calls itself.
    """
    raise NotImplementedError("checkpoint_block: wrap the block's forward in torch.utils.checkpoint")
