"""The mixed-precision driver the trainer calls: autocast, scaled backward, checked and maybe skipped step.

Chapter 05. A ``refimpl.precision.policy.MixedPrecisionPolicy`` put to work: fp32 master weights
(``refimpl.precision.master_weights.MasterWeights``) when the model itself is 16-bit, a
``refimpl.precision.loss_scaler.DynamicLossScaler`` for fp16 (Micikevicius et al. 2018, sections 3.1
and 3.2). Under data parallelism or ZeRO each rank may see only part of the gradients (its shard), so the
scaler all-reduces the overflow flag (MAX) and every rank skips the same steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from refimpl.precision.master_weights import MasterWeights
from refimpl.precision.policy import MixedPrecisionPolicy


class MixedPrecision:
    """A policy put to work in a training loop: autocast, scaled backward, checked and maybe skipped step.

        mp = MixedPrecision(MixedPrecisionPolicy.from_name("fp16"), model, device=device)
        optimizer = build_optimizer(mp.optimizer_module, config.optim)
        with mp.autocast():
            loss = lm_loss(model(x), y)
        mp.backward(loss)
        stepped = mp.step(optimizer, grad_clip=1.0)   # False: skipped (fp16 overflow), nothing changed

    With ``policy.master_weights`` the model is cast to 16 bits here and the optimizer must own the fp32
    ``optimizer_module``; otherwise that is the model itself. ``scaler_kwargs`` configure the
    ``DynamicLossScaler`` (fp16 only); ``group`` is the process group the overflow flag is agreed on.
    ``wrapper_keeps_master``: a wrapper built with this policy keeps the fp32 master weights itself (ZeRO-3's
    ``refimpl.parallel.zero.FullyShardedDataParallel`` with ``mp_policy``, as FSDP2): no
    ``MasterWeights`` here, and no autocast (the wrapper hands the model 16-bit weights).
    """

    def __init__(
        self,
        policy: MixedPrecisionPolicy,
        model: nn.Module,
        *,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        wrapper_keeps_master: bool = False,
        **scaler_kwargs: Any,
    ) -> None:
        self.policy = policy
        self.model = model
        self.device = torch.device(device)
        own_master = policy.master_weights and not wrapper_keeps_master
        self.master = MasterWeights(model, policy.param_dtype) if own_master else None
        self.scaler = policy.make_scaler(group=group, **scaler_kwargs)

    @classmethod
    def from_name(
        cls, name: str, model: nn.Module, *, device: torch.device | str, **kwargs: Any
    ) -> MixedPrecision:
        return cls(MixedPrecisionPolicy.from_name(name), model, device=device, **kwargs)

    @property
    def optimizer_module(self) -> nn.Module:
        """The module whose (fp32) parameters the optimizer updates."""
        return self.master.master if self.master is not None else self.model

    @property
    def scale(self) -> float:
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.policy.autocast(self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_clip: float | None = None,
        params: Iterable[torch.Tensor] | None = None,
        clip_fn: Callable[[list[torch.Tensor]], object] | None = None,
        after_unscale: Callable[[], None] | None = None,
    ) -> bool:
        """Unscale and check (fp16), clip, step, update the scale; False when the step was skipped.

        ``params`` (default: the optimizer's) are the parameters whose gradients this rank checks and
        clips, e.g. a ZeRO shard; ``clip_fn(params)`` replaces ``clip_grad_norm_`` (a sharded norm).
        ``after_unscale()`` runs once the gradients are unscaled and checked, before clipping (skipped step
        or not): the gradients the optimizer receives, unclipped (the trainer's gradient probe).
        """
        if self.master is not None:
            self.master.copy_grads_to_master()
        if params is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
        params = list(params)
        stepped = True
        if self.scaler is not None:
            stepped = not self.scaler.unscale_(params)
        if after_unscale is not None:
            after_unscale()
        if stepped:
            if clip_fn is not None:
                clip_fn(params)
            elif grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            optimizer.step()
        if self.scaler is not None:
            self.scaler.update()  # may raise LossScaleError after too many skips in a row
        if self.master is not None and stepped:
            self.master.copy_master_to_model()
        return stepped

    def state_dict(self) -> dict[str, Any]:
        scaler = None if self.scaler is None else self.scaler.state_dict()
        return {"policy": self.policy.name, "scaler": scaler}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
