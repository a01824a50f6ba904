"""One function applies every parallel technique to a model, in one fixed order: :func:`parallelize`.

Chapter 10 (the 3D trainer) explains the order; each step is the technique of its chapter. The trainer
(``refimpl.train.setup``) builds its run through this function only. As in torchtitan's
``parallelize_llama`` (``torchtitan/models/llama3/parallelize.py``: tensor parallel, then activation
checkpointing, then ``torch.compile``, then FSDP with the mixed-precision policy) and Megatron-LM (the model
is built tensor- and pipeline-parallel first, then wrapped in its ``DistributedDataParallel``), the order is:

1. **tensor / sequence parallel** over the ``tp`` group (chapter 06; Shoeybi et al. 2019, Korthikanti et al.
   2022). First, because it *replaces* modules (a ``Linear`` by a ``ColumnParallelLinear``) and parameters (by
   their shards): everything after it must see the final modules and the local shards, never the full ones.
2. **context parallel** over the ``cp`` group (chapter 07; ring attention, Liu et al. 2023; Ulysses, Jacobs
   et al. 2023). It swaps the attention inside each block and shards the sequence: like 1, a change inside
   the blocks, so it comes before the steps that wrap whole blocks.
3. **pipeline split** over the ``pp`` group (chapter 08; GPipe, Huang et al. 2019; 1F1B, Narayanan et al.
   2021). It cuts the model *between* blocks, so it commutes with 1-2 (which act inside blocks); torchtitan
   splits first and then applies the rest to each stage. It must come before 4-6: checkpointing, precision
   and the data-parallel wrapper apply to each stage's own blocks and parameters.
4. **activation checkpointing** (chapter 05; Chen et al. 2016): wraps the (now parallel) blocks so that
   backward recomputes them, including their collectives. Before 6, because the data-parallel/ZeRO wrapper
   must hook the parameters of the final, wrapped blocks (torchtitan's comment: compile "after AC wrapping
   and before FSDP").
5. **mixed precision** (chapter 05; Micikevicius et al. 2018): the policy (compute, parameter and reduce
   dtypes, the fp16 loss scaler) is chosen on the finished model, and handed to 6: under ZeRO-3 the wrapper
   itself casts its fp32 shards to ``param_dtype`` before the all-gather (FSDP2's ``mp_policy``), so the
   policy must exist before the wrapper is built.
6. **data parallel / ZeRO 0-3** over the ``dp x cp`` group (chapters 03-04; Li et al. 2020; Rajbhandari
   et al. 2020), **outermost**: it hooks every gradient the steps before produced and averages it over the
   ranks that saw other tokens of the same shard (``dp x cp``, :data:`refimpl.distributed.mesh.LOSS_AXES`).
   ZeRO-0 is :class:`~refimpl.parallel.data_parallel.DataParallelBucket`; ZeRO-1/2 a
   :class:`~refimpl.parallel.zero.ShardedOptimizer` (the optimizer *is* the technique, so
   :meth:`Parallelized.build_optimizer` makes it); ZeRO-3
   :class:`~refimpl.parallel.zero.FullyShardedDataParallel`.

Steps 1-3 are not built yet: with ``tp = cp = pp = 1`` they are skipped, with a degree above 1 a
``ValueError`` names the chapter that builds them (the trainer's command line refuses such a layout earlier,
with exit status 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from refimpl.config import OptimConfig
from refimpl.distributed.mesh import LOSS_AXES, ParallelDims, ParallelGroups
from refimpl.optim import build_optimizer, param_groups
from refimpl.parallel.data_parallel import DataParallelBucket
from refimpl.precision import PRECISIONS, MixedPrecision, MixedPrecisionPolicy

__all__ = ["ORDER", "OptimizerSetup", "ParallelizeOptions", "Parallelized", "parallelize"]

ORDER = ("tensor parallel", "context parallel", "pipeline split", "activation checkpointing",
         "mixed precision", "data parallel")  # the steps of :func:`parallelize`, in the order applied
_UNBUILT = (("tp", "tensor parallel", "06 tensor and sequence parallelism"),
            ("cp", "context parallel", "07 context parallelism"),
            ("pp", "pipeline split", "08 pipeline parallelism"))


@dataclass(frozen=True, kw_only=True)
class ParallelizeOptions:
    """How :func:`parallelize` applies each technique (the layout itself comes with the groups).

    ``zero_stage`` 0 (data parallel), 1 (sharded optimizer state), 2 (and gradients), 3 (and parameters);
    ``precision`` ``fp32``/``bf16``/``fp16`` (:meth:`refimpl.precision.MixedPrecisionPolicy.from_name`);
    ``activation_checkpointing`` a block selection (``all``, ``every-N``, ``0,2,-1``; None: off);
    ``bucket_cap_mb`` the gradient buckets of ZeRO-0 (DDP's 25 MB); ``zero_bucket_numel`` the elements per
    reduce-scatter bucket of ZeRO-2; ``prefetch`` and ``reshard_after_forward`` the all-gather schedule of
    ZeRO-3.
    """

    zero_stage: int = 0
    precision: str = "fp32"
    activation_checkpointing: str | None = None
    bucket_cap_mb: float = 25.0
    zero_bucket_numel: int = 2**20
    prefetch: bool = False
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not self.bucket_cap_mb > 0 or self.zero_bucket_numel < 1:
            raise ValueError(f"bucket sizes must be positive, got bucket_cap_mb={self.bucket_cap_mb}, "
                             f"zero_bucket_numel={self.zero_bucket_numel}")
        if self.zero_stage == 3 and self.activation_checkpointing not in (None, "none"):
            # ZeRO-3 registers the gathered parameters only around the unit's forward: the recomputation in
            # backward would run on the shards.
            raise ValueError("activation checkpointing does not work with zero_stage 3 yet (the recomputed "
                             "forward would see the parameter shards); use zero_stage 1 or 2")

    @property
    def fsdp_mixed_precision(self) -> bool:
        """ZeRO-3 in 16 bits as FSDP2: 16-bit gathered weights over fp32 master shards."""
        return self.zero_stage == 3 and self.precision != "fp32"


@dataclass(frozen=True, kw_only=True)
class OptimizerSetup:
    """The optimizer and what the checked step needs: the gradients this rank checks and clips
    (``grad_params``, e.g. its ZeRO shards) and a clipping function over shards (None:
    ``clip_grad_norm_``)."""

    optimizer: torch.optim.Optimizer
    grad_params: list[torch.Tensor]
    clip_fn: Callable[[list[torch.Tensor]], object] | None = None


@dataclass(kw_only=True)
class Parallelized:
    """What :func:`parallelize` made of a model.

    ``model`` is the plain model (under ZeRO-3 its parameters are shards), ``forward`` what a batch goes
    through, ``state_module`` what a checkpoint saves (the ZeRO-3 wrapper), ``sync`` the wrapper whose
    ``no_sync()``/``finish_gradient_synchronization()`` the step calls (ZeRO-0 with several ranks, else
    None), ``group`` the ``dp x cp`` group gradients are averaged over (None: one process), ``applied``
    the steps of :data:`ORDER` that did something, in order.
    """

    model: nn.Module
    forward: nn.Module
    state_module: nn.Module
    mp: MixedPrecision
    options: ParallelizeOptions
    sync: DataParallelBucket | None = None
    group: dist.ProcessGroup | None = None
    applied: list[str] = field(default_factory=list)

    def build_optimizer(self, config: OptimConfig) -> OptimizerSetup:
        """AdamW over this rank's parameters: plain for ZeRO-0 and ZeRO-3 (whose parameters are already
        shards), a :class:`~refimpl.parallel.zero.ShardedOptimizer` over ``group`` for ZeRO-1/2."""
        zero_stage, clip = self.options.zero_stage, config.grad_clip
        if zero_stage == 0:
            return OptimizerSetup(optimizer=build_optimizer(self.model, config),
                                  grad_params=list(self.model.parameters()))
        if zero_stage == 3:
            fsdp = self.state_module
            return OptimizerSetup(optimizer=build_optimizer(fsdp, config),
                                  grad_params=fsdp.sharded_parameters(),
                                  clip_fn=None if clip is None else (lambda _: fsdp.clip_grad_norm_(clip)))
        from refimpl.parallel.zero import ShardedOptimizer

        optimizer = ShardedOptimizer(param_groups(self.model, config.weight_decay), torch.optim.AdamW,
                                     self.group, zero_stage=zero_stage,
                                     bucket_numel=self.options.zero_bucket_numel, lr=config.lr,
                                     betas=(config.beta1, config.beta2), eps=config.eps,
                                     foreach=False)
        # stage 1 checks the full local gradients (reduced in step), stage 2 the shards it kept
        grads = optimizer.params if zero_stage == 1 else [optimizer.shard(p) for p in optimizer.params]
        return OptimizerSetup(optimizer=optimizer, grad_params=list(grads),
                              clip_fn=None if clip is None else (lambda _: optimizer.clip_grad_norm_(clip)))


def _layout(groups_or_dims: ParallelGroups | ParallelDims) -> tuple[ParallelDims, ParallelGroups | None]:
    """The layout and its groups; refuses steps 1-3 (naming their chapter) and a multi-rank layout given
    without its groups, before anything is touched (every rank alike)."""
    if isinstance(groups_or_dims, ParallelGroups):
        dims, groups = groups_or_dims.dims, groups_or_dims
    elif isinstance(groups_or_dims, ParallelDims):
        dims, groups = groups_or_dims, None
    else:
        raise TypeError("parallelize takes ParallelGroups or ParallelDims, got "
                        f"{type(groups_or_dims).__name__}")
    for axis, step, chapter in _UNBUILT:
        if getattr(dims, axis) > 1:
            raise ValueError(f"{step} ({axis} = {getattr(dims, axis)} in {dims.describe()}) is not built "
                             f"yet: chapter {chapter} builds it")
    if groups is None and dims.world_size > 1:
        raise ValueError(f"the layout {dims.describe()} spans {dims.world_size} ranks: pass its process "
                         "groups (dims.build(rank=..., world_size=..., timeout_s=...))")
    return dims, groups


def parallelize(model: nn.Module, groups_or_dims: ParallelGroups | ParallelDims,
                options: ParallelizeOptions | None = None) -> Parallelized:
    """Apply the techniques of ``options`` to ``model`` over the groups of the layout, in the order of the
    module docstring (:data:`ORDER`); return the pieces a training step needs (:class:`Parallelized`).

    ``groups_or_dims``: this rank's :class:`ParallelGroups` (``dims.build(...)``, built once per run), or a
    one-rank :class:`ParallelDims` (no process group). The model must be identical on every rank (same
    seed); it is changed in place (checkpointed blocks, ZeRO-3's shards). Collective under several ranks.
    """
    options = options or ParallelizeOptions()
    dims, groups = _layout(groups_or_dims)  # steps 1-3 (tp, cp, pp): refused while unbuilt
    applied: list[str] = []
    # 4. activation checkpointing, on the blocks the wrapper of step 6 will hook
    if options.activation_checkpointing not in (None, "none"):
        from refimpl.parallel.activation_checkpoint import (
            apply_activation_checkpointing,
            parse_block_selection,
        )

        apply_activation_checkpointing(model, parse_block_selection(options.activation_checkpointing))
        applied.append("activation checkpointing")
    # 5. mixed precision: the policy, handed to ZeRO-3 (it casts before the all-gather) or used as autocast.
    # The fp16 scaler agrees on overflow over WORLD (group None): every rank skips the step together.
    fsdp_mp = options.fsdp_mixed_precision
    device = next(iter(model.parameters())).device
    mp = MixedPrecision(MixedPrecisionPolicy.from_name(options.precision, master_weights=fsdp_mp), model,
                        device=device, wrapper_keeps_master=fsdp_mp)
    if options.precision != "fp32":
        applied.append("mixed precision")
    # 6. data parallel / ZeRO over dp x cp, outermost
    group = None if groups is None else groups.group(*LOSS_AXES)
    replicas = dims.dp * dims.cp
    done = Parallelized(model=model, forward=model, state_module=model, mp=mp, options=options, group=group,
                        applied=applied)
    if options.zero_stage == 0:
        if replicas > 1:  # broadcasts the first rank's weights over the group
            done.sync = DataParallelBucket(model, options.bucket_cap_mb, group)
            done.forward = done.sync
            applied.append("data parallel")
    elif options.zero_stage in (1, 2):  # every rank built the same weights: the optimizer shards them
        applied.append("data parallel")
    else:
        from refimpl.parallel.zero import FullyShardedDataParallel

        fsdp = FullyShardedDataParallel(model, group=group, prefetch=options.prefetch,
                                        reshard_after_forward=options.reshard_after_forward,
                                        mp_policy=mp.policy if fsdp_mp else None)
        done.forward = done.state_module = fsdp
        applied.append("data parallel")
    return done
