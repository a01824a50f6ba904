"""Mixed precision from scratch: the policy, fp32 master weights, a dynamic loss scaler (chapter 05).

Three dtypes describe a mixed-precision run (the same three as FSDP2's ``MixedPrecisionPolicy``):

* ``param_dtype``: the dtype the model's weights are held in for compute. ``float32`` means the autocast
  path (the weights stay fp32 and ``torch.autocast`` makes a low-precision copy of each for its matmul);
  ``float16``/``bfloat16`` means the master-weights path of Micikevicius et al. 2018 ("Mixed Precision
  Training", section 3.1): the model holds 16-bit copies, the optimizer an fp32 master copy
  (:class:`MasterWeights`);
* ``compute_dtype``: the dtype of the matrix multiplies (what autocast casts to);
* ``reduce_dtype``: the dtype gradients travel in during the data-parallel all-reduce. A 16-bit
  ``reduce_dtype`` halves the bytes; :func:`low_precision_all_reduce_` still sums in fp32.

fp16 has a narrow range (smallest normal 6.1e-5, max 65504): small gradients flush to zero. The cure is
loss scaling (Micikevicius et al. 2018, section 3.2): multiply the loss by S so the gradients are S times
larger, divide them by S in fp32 before the step, and when a gradient overflows skip the step and shrink
S. :class:`~refimpl.loss_scaler.DynamicLossScaler` does that, with the update rule of
``torch.amp.GradScaler`` plus Megatron-LM's
hysteresis and minimum scale. Under data parallelism or ZeRO each rank may see only part of the gradients
(its shard), so the overflow flag is all-reduced (MAX) and every rank skips the same steps. bf16 has fp32's
range and needs no scaler.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops
from refimpl.loss_scaler import (  # noqa: F401 - re-exported: the scaler is part of the policy's API
    DynamicLossScaler,
    LossScaleError,
    LossScalerConfig,
    ScalerState,
    update_scale,
)

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` (a dtype passes through)."""
    if isinstance(name, torch.dtype):
        if name not in _NAMES:
            raise ValueError(f"unsupported dtype {name}; expected one of {list(DTYPES.values())}")
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}")
    return DTYPES[name]


# --------------------------------------------------------------------------------------------------------
# The policy


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Parameter, compute and gradient-reduction dtypes of a run; see the module docstring.

    Master weights and optimizer state are always fp32. ``loss_scaling`` is on exactly when something
    computes in fp16.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "reduce_dtype"):
            dtype_from_name(getattr(self, field))
        if self.param_dtype not in (torch.float32, self.compute_dtype):
            raise ValueError(
                f"param_dtype={self.param_dtype} must be float32 (autocast) or equal compute_dtype="
                f"{self.compute_dtype} (16-bit weights with an fp32 master copy)"
            )

    @classmethod
    def from_name(
        cls, name: str, *, master_weights: bool = False, reduce_dtype: str | torch.dtype | None = None
    ) -> MixedPrecisionPolicy:
        """The policy behind ``--precision {fp32,bf16,fp16}``.

        Default: autocast in ``name`` over fp32 weights, gradients reduced in fp32. ``master_weights``
        keeps the model itself in 16 bits (with an fp32 master copy); ``reduce_dtype`` sends gradients in
        16 bits (summed in fp32).
        """
        compute = dtype_from_name(name)
        return cls(
            param_dtype=compute if master_weights else torch.float32,
            compute_dtype=compute,
            reduce_dtype=torch.float32 if reduce_dtype is None else dtype_from_name(reduce_dtype),
        )

    @property
    def name(self) -> str:
        return _NAMES[self.compute_dtype]

    @property
    def loss_scaling(self) -> bool:
        """fp16 needs a loss scaler; bf16 (fp32's exponent range) and fp32 do not."""
        return torch.float16 in (self.compute_dtype, self.param_dtype)

    @property
    def master_weights(self) -> bool:
        return self.param_dtype != torch.float32

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """The forward pass's context: ``torch.autocast`` to ``compute_dtype`` on the autocast path.

        A no-op for fp32, and for 16-bit weights (they already compute in 16 bits).
        """
        if self.compute_dtype == torch.float32 or self.master_weights:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.compute_dtype)

    def make_scaler(self, **kwargs: Any) -> DynamicLossScaler | None:
        """A :class:`DynamicLossScaler` for fp16, None otherwise (``kwargs`` go to the scaler)."""
        return DynamicLossScaler(**kwargs) if self.loss_scaling else None


class MasterWeights:
    """An fp32 master copy of a model whose own weights are cast to ``dtype`` (Micikevicius et al. 2018).

    The model computes forward and backward in 16 bits; build the optimizer on :attr:`master` (an fp32
    twin of the model, tied weights kept tied); per step call :meth:`copy_grads_to_master` after backward
    and :meth:`copy_master_to_model` after the optimizer step. Updates too small for 16 bits (lr x grad
    below half a unit in the last place of the weight) accumulate in the master copy instead of vanishing.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.master = copy.deepcopy(model).float()
        model.to(dtype)
        self.dtype = dtype

    def pairs(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """(fp32 master, 16-bit model) parameter pairs, tied parameters once."""
        return zip(self.master.parameters(), self.model.parameters(), strict=True)

    @torch.no_grad()
    def copy_grads_to_master(self) -> None:
        """master.grad = fp32(model.grad); the 16-bit gradients are freed."""
        for master, p in self.pairs():
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        for master, p in self.pairs():
            p.copy_(master)


# --------------------------------------------------------------------------------------------------------
# Gradient reduction in low precision, summed in fp32


class PendingLowPrecisionReduce:
    """An in-flight :func:`low_precision_all_reduce_`: ``work`` is the all-to-all; ``wait()`` finishes.

    Finishing adds the received chunks in fp32, rounds once, all-gathers (blocking) and writes the result
    into the tensor. Duck-types the ``PendingReduce`` of :mod:`refimpl.parallel.data_parallel`.
    """

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self.work = work
        self._finish = finish

    def wait(self) -> None:
        self.work.wait()
        self._finish()


def start_low_precision_all_reduce_(
    tensor: torch.Tensor,
    *,
    comm_dtype: torch.dtype = torch.bfloat16,
    group: dist.ProcessGroup | None = None,
    average: bool = True,
) -> PendingLowPrecisionReduce:
    """Launch :func:`low_precision_all_reduce_` asynchronously (its all-to-all); ``.wait()`` completes it."""
    if not tensor.is_contiguous():
        raise ValueError("low_precision_all_reduce_ needs a contiguous tensor")
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    if n == 1:
        return PendingLowPrecisionReduce(_NoWork(), lambda: None)
    flat = tensor.view(-1)
    chunk = -(-flat.numel() // n)  # ceil
    send = torch.zeros(n * chunk, dtype=comm_dtype, device=flat.device)
    send[: flat.numel()].copy_(flat)  # [n * chunk], rank j's chunk is send[j*chunk:(j+1)*chunk]
    recv = torch.empty_like(send)  # [n * chunk], row r = rank r's contribution to my chunk
    work = ops.all_to_all_single(recv, send, group=group, async_op=True)

    def finish() -> None:
        mine = recv.view(n, chunk).float().sum(dim=0)  # [chunk] fp32 sum, in rank order
        if average:
            mine /= n
        gathered = torch.empty_like(send)  # [n * chunk]
        ops.all_gather_into_tensor(gathered, mine.to(comm_dtype), group=group)
        flat.copy_(gathered[: flat.numel()])

    return PendingLowPrecisionReduce(work, finish)


class _NoWork:
    def wait(self) -> bool:
        return True


def low_precision_all_reduce_(
    tensor: torch.Tensor,
    *,
    comm_dtype: torch.dtype = torch.bfloat16,
    group: dist.ProcessGroup | None = None,
    average: bool = True,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place sending ``comm_dtype`` on the wire but adding in fp32.

    A plain all-reduce of a bf16 tensor rounds to bf16 after every addition of the ring. Here: each rank
    cuts the tensor into ``n`` chunks, sends chunk ``j`` (cast to ``comm_dtype``) to rank ``j``
    (all-to-all), rank ``j`` adds the ``n`` contributions in fp32 in rank order, divides by ``n`` (when
    ``average``), rounds once to ``comm_dtype`` and all-gathers. Bytes per rank: ``2 (n-1)/n`` x the
    16-bit size, as a ring all-reduce in 16 bits (half of fp32's). The result is
    ``round(sum_r round(x_r) / n)``, the same on every rank. ``tensor`` must be contiguous.
    """
    start_low_precision_all_reduce_(tensor, comm_dtype=comm_dtype, group=group, average=average).wait()
    return tensor


def reduce_gradients_(
    params: Iterable[torch.Tensor], policy: MixedPrecisionPolicy, *, group: dist.ProcessGroup | None = None
) -> None:
    """Average the gradients of ``params`` over ``group`` in ``policy.reduce_dtype`` (one flat buffer)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])  # [total] fp32
    if policy.reduce_dtype == torch.float32:
        ops.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
    else:
        low_precision_all_reduce_(flat, comm_dtype=policy.reduce_dtype, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def ddp_comm_hook(comm_dtype: torch.dtype) -> Callable[[Any, Any], torch.futures.Future]:
    """A ``DistributedDataParallel`` comm hook running :func:`low_precision_all_reduce_` on each bucket.

    ``ddp.register_comm_hook(state=group_or_None, hook=ddp_comm_hook(torch.bfloat16))``; the hook averages.
    """

    def fp32_accumulating_hook(group, bucket):  # no annotations: DDP checks them against dist.GradBucket
        buffer = bucket.buffer()
        low_precision_all_reduce_(buffer, comm_dtype=comm_dtype, group=group)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(buffer)
        return future

    return fp32_accumulating_hook


def fp32_accumulating_comm_hook(
    comm_dtype: torch.dtype = torch.bfloat16,
) -> Callable[[torch.Tensor, Any], PendingLowPrecisionReduce]:
    """A ``comm_hook`` for :class:`refimpl.parallel.data_parallel.DataParallelBucket` (chapter 03).

    ``DataParallelBucket(model, comm_hook=fp32_accumulating_comm_hook(torch.bfloat16))``: each bucket,
    already divided by the world size, is *summed* over the ranks with bf16 on the wire and fp32
    additions; the all-to-all overlaps backward, the rest runs when the bucket is waited on.
    """

    def hook(buffer: torch.Tensor, group: Any) -> PendingLowPrecisionReduce:
        return start_low_precision_all_reduce_(buffer, comm_dtype=comm_dtype, group=group,
                                               average=False)

    hook.__name__ = hook.__qualname__ = f"fp32_accumulating_comm_hook({_NAMES[comm_dtype]})"
    return hook


# --------------------------------------------------------------------------------------------------------
# What the trainer calls


class MixedPrecision:
    """A policy put to work in a training loop: autocast, scaled backward, checked and maybe skipped step.

        mp = MixedPrecision(MixedPrecisionPolicy.from_name("fp16"), model, device=device)
        optimizer = build_optimizer(mp.optimizer_module, config.optim)
        with mp.autocast():
            loss = lm_loss(model(x), y)
        mp.backward(loss)
        stepped = mp.step(optimizer, grad_clip=1.0)   # False: skipped (fp16 overflow), nothing changed

    With ``policy.master_weights`` the model is cast to 16 bits here and the optimizer must own the fp32
    :attr:`optimizer_module`; otherwise that is the model itself. ``scaler_kwargs`` configure the
    :class:`DynamicLossScaler` (fp16 only); ``group`` is the process group the overflow flag is agreed on.
    ``wrapper_keeps_master``: a wrapper built with this policy keeps the fp32 master weights itself (ZeRO-3's
    :class:`~refimpl.parallel.zero.FullyShardedDataParallel` with ``mp_policy``, as FSDP2): no
    :class:`MasterWeights` here, and no autocast (the wrapper hands the model 16-bit weights).
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
    ) -> bool:
        """Unscale and check (fp16), clip, step, update the scale; False when the step was skipped.

        ``params`` (default: the optimizer's) are the parameters whose gradients this rank checks and
        clips, e.g. a ZeRO shard; ``clip_fn(params)`` replaces ``clip_grad_norm_`` (a sharded norm).
        """
        if self.master is not None:
            self.master.copy_grads_to_master()
        if params is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
        params = list(params)
        stepped = True
        if self.scaler is not None:
            stepped = not self.scaler.unscale_(params)
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
