"""The optimizer of a parallelized model (chapter 12): ``build_optimizer_setup``, which
``Parallelized.build_optimizer`` calls, gives AdamW over this rank's parameters and what the checked step
needs for the layout, as an ``OptimizerSetup``, all read from the parameters' placements
(``refimpl.parallel.placements``):

* one device, DP (ZeRO-0), tensor, context and pipeline parallelism, ZeRO-3: AdamW over the tensors this
  rank holds (ZeRO-3's are already shards);
* ZeRO-1/2 (Rajbhandari et al. 2020, chapter 04): one ``refimpl.parallel.zero.ShardedOptimizer`` over
  the ``dp x cp`` group; the gradients it steps are its row shards (placements narrowed over ``dp x cp``);
* the gradient norm: one ``refimpl.parallel.placements.clip_grad_norm_`` over the held gradients,
  each element of the model counted once (a tensor-parallel replica on tp rank 0, a tied embedding's
  last-stage copy not at all, a ZeRO shard on its rank);
* after the data-parallel reduction (``OptimizerSetup.finish_gradients``): ZeRO-1's reduce-scatter
  into the optimizer's shards (so that the loss scaler unscales and checks what AdamW steps); under
  pipeline parallelism at ZeRO-0 the ``dp x cp`` average once per step (chapter 08), then under sequence
  parallelism the sum over ``tp`` of the gradients placed so
  (``refimpl.parallel.placements.reduce_gradients``);
* expert parallelism (chapter 09): at ZeRO-0 the experts' gradients, left alone by the data-parallel
  wrapper, are summed over the group their placement reduces over (the mesh's ``edp``) and
  divided by ``dp x cp``
  once per step (``refimpl.parallel.expert_parallel_gpt.reduce_expert_gradients``); at ZeRO-1/2 the
  sharded optimizer shards them over ``edp`` with the same divisor (its shard groups) and their optimizer
  shards are placed over ``edp``, the dense ones over ``dp x cp``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from refimpl.config import OptimConfig
from refimpl.optim import adamw_foreach, build_optimizer, param_groups
from refimpl.parallel.placements import DP, EDP, HeldGradient, Placement, clip_grad_norm_, reduce_gradients
from refimpl.precision import MixedPrecision, MixedPrecisionPolicy

if TYPE_CHECKING:
    from refimpl.parallel.zero import ShardedOptimizer


@dataclass(frozen=True, kw_only=True)
class OptimizerSetup:
    """The optimizer and what the checked step needs, built for one layout: the gradients this rank checks
    (``grad_params``, e.g. its ZeRO shards), a clipping function over them (``clip_fn``; None:
    ``torch.nn.utils.clip_grad_norm_``), what completes the gradients after the data-parallel reduction
    (``finish``; None: nothing) and the held gradients with their placements (``held_gradients()``, after
    the step's reductions). A step calls ``finish_gradients()`` then ``step(mp, grad_clip=...)``."""

    optimizer: torch.optim.Optimizer
    grad_params: list[torch.Tensor]
    clip_fn: Callable[[list[torch.Tensor]], object] | None = None
    finish: Callable[[], None] | None = None
    held_gradients: Callable[[], list[HeldGradient]] | None = None

    def finish_gradients(self) -> None:
        """What completes the gradients after the data-parallel reduction (ZeRO-1's reduce-scatter, the
        pipeline's once-per-step average, the experts' sum, sequence parallelism's sum over tp; the module
        docstring); nothing where the layout needs none."""
        if self.finish is not None:
            self.finish()

    def step(self, mp: MixedPrecision, *, grad_clip: float | None,
             after_unscale: Callable[[], None] | None = None) -> bool:
        """The mixed-precision driver's checked step over ``grad_params`` (chapter 05: unscale, skip on
        inf/NaN under fp16, clip by this layout's norm, AdamW), then ``zero_grad``; False when skipped."""
        stepped = mp.step(self.optimizer, grad_clip=grad_clip, params=self.grad_params, clip_fn=self.clip_fn,
                          after_unscale=after_unscale)
        self.optimizer.zero_grad(set_to_none=True)
        return stepped


@dataclass(frozen=True, kw_only=True)
class OptimizerInputs:
    """What ``build_optimizer_setup`` reads of a parallelized model: the module whose parameters are
    stepped, in the order of ``named`` (their weight decay by those names; None: the module's own), the
    tensors this rank holds under the plain GPT's names (``held``, in the order the checkpoint lists them)
    with their placements, the group of each axis, the ZeRO stage, the policy."""

    module: nn.Module
    named: list[tuple[str, nn.Parameter]] | None
    held: list[tuple[str, nn.Parameter]]
    placements: Mapping[str, Placement]
    groups: Mapping[str, dist.ProcessGroup | None]
    zero_stage: int
    zero_bucket_numel: int
    policy: MixedPrecisionPolicy
    average_in_finish: bool = False  # pipeline at ZeRO-0: the dp x cp average comes once, after the step
    experts: tuple[str, ...] = ()  # expert parallelism: the expert tensors' names (reduced over edp)
    num_replicas: int = 1  # dp x cp: what the experts' gradient sums are divided by


def _sharded_optimizer(inputs: OptimizerInputs, config: OptimConfig) -> ShardedOptimizer:
    from refimpl.parallel.zero import ShardedOptimizer, ShardGroup

    experts = ShardGroup(group=inputs.groups.get(EDP), divide_factor=inputs.num_replicas)
    shard_groups: dict[torch.Tensor, ShardGroup] = {p: experts for n, p in inputs.held
                                                    if n in set(inputs.experts)}
    device = inputs.held[0][1].device if inputs.held else torch.device("cpu")
    return ShardedOptimizer(param_groups(inputs.module, config.weight_decay, inputs.named), torch.optim.AdamW,
                            inputs.groups.get(DP), zero_stage=inputs.zero_stage,
                            bucket_numel=inputs.zero_bucket_numel, shard_groups=shard_groups, lr=config.lr,
                            betas=(config.beta1, config.beta2), eps=config.eps,
                            foreach=adamw_foreach(device))  # the shards' device: refimpl.optim


def build_optimizer_setup(inputs: OptimizerInputs, config: OptimConfig) -> OptimizerSetup:
    """AdamW over this rank's tensors, or at ZeRO-1/2 a ShardedOptimizer over ``dp x cp``; the norm and the
    reductions from the placements (module docstring)."""
    zero, placements, groups = inputs.zero_stage, inputs.placements, inputs.groups
    held_params = [(n, p) for n, p in inputs.held if p.requires_grad]
    device = held_params[0][1].device
    optimizer: torch.optim.Optimizer
    reduce_shards: Callable[[], None] | None = None  # ZeRO-1's once-per-step reduce-scatter (finish)
    if zero in (1, 2):
        optimizer = sharded = _sharded_optimizer(inputs, config)
        if zero == 1:
            reduce_shards = sharded.reduce_gradients
        name_of: dict[torch.Tensor, str] = {p: n for n, p in reversed(inputs.held)}
        specs = {p: box for p, _, box in sharded.local_state_shards()}

        def held() -> list[HeldGradient]:  # the row shards, after ZeRO-1's once-per-step reduce-scatter
            sharded.reduce_gradients()
            out = []
            for p in sharded.params:
                g = sharded.shard(p).grad
                if g is not None:
                    name = name_of[p]
                    axis = EDP if name in inputs.experts else DP  # the rows' group
                    out.append(HeldGradient(name, g, placements[name].narrowed(specs[p], axis)))
            return out

        # the shards the inner optimizer steps: the loss scaler unscales and checks them, clipping scales
        # them (stage 1 reduce-scatters into them in finish_gradients, before the scaler; stage 2 in backward)
        grad_params = [sharded.shard(p) for p in sharded.params]
    else:
        optimizer = build_optimizer(inputs.module, config, named=inputs.named)

        def held() -> list[HeldGradient]:
            return [HeldGradient(n, p.grad, placements[n]) for n, p in held_params if p.grad is not None]

        grad_params = [p for _, p in held_params]

    sp = any("tp" in p.reduce_over for p in placements.values())
    experts = inputs.experts if zero == 0 else ()  # ZeRO-1/2 reduce them in the optimizer

    def finish() -> None:
        if reduce_shards is not None:  # ZeRO-1: before the loss scaler reads the shards
            reduce_shards()
        if inputs.average_in_finish:  # every stage's gradients, once per step, over the replicas
            from refimpl.parallel.data_parallel.data_parallel_communications import reduce_gradients_

            # not the experts': they are summed over edp below (the pipeline's stages hold experts too)
            reduce_gradients_([p for n, p in held_params if n not in experts], inputs.policy,
                              group=groups.get(DP))
        if experts:  # summed over the group their placement names (edp), divided by dp x cp
            from refimpl.parallel.expert_parallel_gpt import reduce_expert_gradients

            reduce_expert_gradients(held(), experts, groups=groups, num_replicas=inputs.num_replicas)
        if sp:  # the s/t-token gradients (whole, or the same rows of a ZeRO shard on every tp rank)
            reduce_gradients(held(), "tp", groups.get("tp"))

    clip_fn: Callable[[object], torch.Tensor] | None = None
    if config.grad_clip is not None and (zero != 0 or _sharded(placements)):
        max_norm = config.grad_clip

        def clip(_: object) -> torch.Tensor:
            return clip_grad_norm_(held(), max_norm, groups=groups, device=device)

        clip_fn = clip
    return OptimizerSetup(optimizer=optimizer, grad_params=grad_params, clip_fn=clip_fn,
                          finish=finish if (inputs.average_in_finish or sp or experts or zero == 1)
                          else None,
                          held_gradients=held)


def _sharded(placements: Mapping[str, Placement]) -> bool:
    """Whether any tensor is split over an axis (else the norm is ``clip_grad_norm_``'s on every rank)."""
    return any(p.sharded_over for p in placements.values())
