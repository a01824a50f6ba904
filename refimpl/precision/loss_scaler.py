"""A dynamic loss scaler written from scratch, decision for decision equal to ``torch.amp.GradScaler``.

Chapter 05. fp16 has a narrow range (smallest normal 6.1e-5): small gradients flush to zero. Loss scaling
(Micikevicius et al. 2018, "Mixed Precision Training", section 3.2) multiplies the loss by S, divides the
gradients by S in fp32 before the step, and on an inf/NaN skips the step and shrinks S; after
``growth_interval`` clean steps S grows again. Megatron-LM adds hysteresis and a minimum scale. Under data
parallelism or ZeRO the overflow flag is all-reduced (MAX) so that every rank skips the same steps.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from refimpl.comm import ops

# --------------------------------------------------------------------------------------------------------
# The dynamic loss scaler


class LossScaleError(FloatingPointError):
    """Too many consecutive steps overflowed: no loss scale makes the gradients finite."""


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32, as GradScaler's float32 scale tensor does."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range
        return math.copysign(math.inf, x)


@dataclass(frozen=True, kw_only=True)
class LossScalerConfig:
    """The knobs of ``DynamicLossScaler`` (defaults: GradScaler's, plus Megatron's min scale).

    ``hysteresis``: how many overflows are tolerated before the scale shrinks (Megatron-LM); the count
    refills when the scale grows. 1 (shrink on every overflow) is GradScaler's rule. The run aborts after
    ``max_consecutive_skips`` skipped steps in a row (None: never).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_consecutive_skips: int | None = 30

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
            raise ValueError(f"init_scale must be positive and finite, got {self.init_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError("growth_interval and hysteresis must be >= 1")
        if not 0.0 <= self.min_scale <= self.init_scale:
            raise ValueError(f"min_scale must be in [0, init_scale], got {self.min_scale}")
        if self.max_consecutive_skips is not None and self.max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1 or None, got {self.max_consecutive_skips}")


class ScalerState(NamedTuple):
    """What the update rule carries from step to step."""

    scale: float
    growth_tracker: int  # finite steps since the last overflow or growth
    hysteresis_tracker: int  # overflows still tolerated before the scale shrinks


def update_scale(state: ScalerState, found_inf: bool, config: LossScalerConfig) -> ScalerState:
    """One step of the dynamic loss-scale rule (GradScaler's ``_amp_update_scale_`` + Megatron's hysteresis).

    On an overflow: the growth count restarts, one unit of hysteresis is spent, and once none is left the
    scale is multiplied by ``backoff_factor`` (not below ``min_scale``). After ``growth_interval`` finite
    steps in a row: the scale is multiplied by ``growth_factor`` (kept if that overflows float32) and the
    hysteresis refills. Scales are float32 numbers, as in GradScaler.
    """
    if found_inf:
        hysteresis = state.hysteresis_tracker - 1
        scale = state.scale
        if hysteresis <= 0:
            scale = max(_f32(scale * config.backoff_factor), _f32(config.min_scale))
        return ScalerState(scale, 0, hysteresis)
    growth = state.growth_tracker + 1
    if growth == config.growth_interval:
        grown = _f32(state.scale * config.growth_factor)
        return ScalerState(grown if math.isfinite(grown) else state.scale, 0, config.hysteresis)
    return ScalerState(state.scale, growth, state.hysteresis_tracker)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor for a collective must live when there is no gradient to take it from (NCCL: GPU)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _grads(params_or_optimizer: Iterable[torch.Tensor] | torch.optim.Optimizer) -> list[torch.Tensor]:
    if isinstance(params_or_optimizer, torch.optim.Optimizer):
        params = [p for g in params_or_optimizer.param_groups for p in g["params"]]
    else:
        params = list(params_or_optimizer)
    return [p.grad for p in params if p.grad is not None]


def _local_overflow(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-d float32 flag on ``device``: 1.0 when any of ``grads`` holds an inf or a NaN (no sync)."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        # A tensor holds an inf or a NaN exactly when its min or max is not finite (NaN propagates through
        # both; +inf is the max, -inf the min): one pass per tensor.
        extremes = [e.float() for g in grads if g.numel() for e in torch.aminmax(g)]
        if extremes:
            found = torch.isfinite(torch.stack(extremes)).all().logical_not().float()
    return found


def _agree_(found: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-reduce the flag (MAX) over ``group`` when there is more than one rank: one number per step."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # gloo reduces CPU tensors, NCCL device tensors: the flag lives where the grads live
        ops.all_reduce(found, op=ops.ReduceOp.MAX, group=group)


def overflow_on_any_rank(
    grads: Iterable[torch.Tensor], *, device: torch.device | str, group: dist.ProcessGroup | None = None
) -> bool:
    """True when any of ``grads`` on any rank of ``group`` holds an inf or a NaN; the same answer everywhere.

    Every rank must call it, also a rank with no gradients (it contributes "no overflow"); the flag is one
    number all-reduced with MAX on ``device`` (the gradients' device: NCCL reduces only GPU tensors).
    """
    found = _local_overflow(list(grads), torch.device(device))
    _agree_(found, group)
    return bool(found.item())


class DynamicLossScaler:
    """Dynamic loss scaling written from scratch; the same decisions as ``torch.amp.GradScaler``.

    Per step::

        scaler.scale(loss).backward()
        found_inf = scaler.unscale_(optimizer)   # grads /= S in fp32; inf/NaN anywhere, on any rank?
        if not found_inf:
            clip_grad_norm_(...)                 # on the true (unscaled) gradients
        scaler.step(optimizer)                   # skipped when found_inf
        scaler.update()                          # the rule of ``update_scale``

    ``unscale_`` takes an optimizer or the parameters whose gradients this rank owns (a ZeRO shard). The
    overflow flag is all-reduced (MAX) over ``group`` (default: the world when a process group exists),
    so every rank skips the same steps and keeps the same scale; ``agree_across_ranks=False`` turns that
    off (the negative control of chapter 05). Raises ``LossScaleError`` after
    ``config.max_consecutive_skips`` skipped steps in a row.
    """

    def __init__(
        self,
        config: LossScalerConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        agree_across_ranks: bool = True,
        **overrides: Any,
    ) -> None:
        self.config = dataclasses.replace(config or LossScalerConfig(), **overrides)
        self.group = group
        self.agree_across_ranks = agree_across_ranks
        self._state = ScalerState(_f32(self.config.init_scale), 0, self.config.hysteresis)
        self.consecutive_skips = 0
        self.num_skipped = 0
        self.num_updates = 0
        self._found_inf: bool | None = None  # set by unscale_, consumed by update
        self._stepped = False

    # -- the scale ----------------------------------------------------------------------------------------
    def get_scale(self) -> float:
        return self._state.scale

    @property
    def state(self) -> ScalerState:
        return self._state

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (backward of it gives S times the gradients)."""
        return loss * self._state.scale

    # -- per step -----------------------------------------------------------------------------------------
    def unscale_(self, params_or_optimizer: Iterable[torch.Tensor] | torch.optim.Optimizer) -> bool:
        """Divide the gradients by S in place; return True when any is inf/NaN on any rank of ``group``.

        The test looks at the scaled gradients (as GradScaler does); the division multiplies by the
        float32 reciprocal of S computed in float64, so the unscaled gradients are bit-identical to
        GradScaler's. fp16 gradients are refused: unscaling them in place would underflow again (keep
        fp32 gradients: autocast, or ``MasterWeights``).
        """
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called this step; call update() first")
        grads = _grads(params_or_optimizer)
        if any(g.dtype == torch.float16 for g in grads):
            raise ValueError("refusing to unscale fp16 gradients in place; keep fp32 gradients (autocast "
                             "over fp32 weights, or MasterWeights.copy_grads_to_master())")
        device = grads[0].device if grads else _collective_device(self.group)
        inv_scale = torch.tensor(1.0 / self._state.scale, dtype=torch.float64).float().to(device)
        found = _local_overflow(grads, device)  # tested on the scaled gradients, as GradScaler does
        if grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, inv_scale)
        if self.agree_across_ranks:
            _agree_(found, self.group)
        self._found_inf = bool(found.item())
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """``optimizer.step()`` unless this step overflowed (unscales first if not done); True if stepped."""
        if self._found_inf is None:
            self.unscale_(optimizer)
        self._stepped = not self._found_inf
        if self._stepped:
            optimizer.step(*args, **kwargs)
        return self._stepped

    def update(self) -> None:
        """Apply ``update_scale`` with this step's overflow flag; abort after too many skips."""
        if self._found_inf is None:
            raise RuntimeError("update() needs unscale_() or step() first in this step")
        found_inf, self._found_inf = self._found_inf, None
        self._state = update_scale(self._state, found_inf, self.config)
        self.num_updates += 1
        if found_inf:
            self.num_skipped += 1
            self.consecutive_skips += 1
            limit = self.config.max_consecutive_skips
            if limit is not None and self.consecutive_skips >= limit:
                raise LossScaleError(
                    f"{self.consecutive_skips} consecutive steps had inf/NaN gradients (loss scale now "
                    f"{self._state.scale:g}, minimum {self.config.min_scale:g}): the gradients are not "
                    "finite at any scale. The loss has diverged or the data/model produce NaN; lower the "
                    "learning rate, check the inputs, or train in bf16."
                )
        else:
            self.consecutive_skips = 0

    # -- checkpointing -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (picklable, JSON-able): the trackers, the counters and the config."""
        if self._found_inf is not None:
            raise RuntimeError("state_dict() in the middle of a step; call it after update()")
        return {
            "scale": self._state.scale,
            "growth_tracker": self._state.growth_tracker,
            "hysteresis_tracker": self._state.hysteresis_tracker,
            "consecutive_skips": self.consecutive_skips,
            "num_skipped": self.num_skipped,
            "num_updates": self.num_updates,
            "config": dataclasses.asdict(self.config),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict`` (the saved config wins, as with GradScaler)."""
        self.config = LossScalerConfig(**state["config"])
        self._state = ScalerState(float(state["scale"]), int(state["growth_tracker"]),
                                  int(state["hysteresis_tracker"]))
        self.consecutive_skips = int(state["consecutive_skips"])
        self.num_skipped = int(state["num_skipped"])
        self.num_updates = int(state["num_updates"])
        self._found_inf = None

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self._state.scale:g}, skipped={self.num_skipped}/"
                f"{self.num_updates}, hysteresis={self.config.hysteresis})")


# --------------------------------------------------------------------------------------------------------
# fp32 master weights for a 16-bit model
