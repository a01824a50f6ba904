"""A run's pieces: the model, its data-parallel or ZeRO wrapper (chapters 03-04), the optimizer and the
mixed-precision policy (chapter 05), as :func:`build_setup` puts them together."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refimpl.config import TrainConfig
from refimpl.distributed import DistributedContext
from refimpl.model import GPT
from refimpl.optim import build_optimizer, param_groups
from refimpl.parallel.data_parallel import DataParallelBucket
from refimpl.precision import MixedPrecision, MixedPrecisionPolicy
from refimpl.train.args import RunOptions


@dataclass(kw_only=True)
class _Setup:
    model: torch.nn.Module  # the plain GPT (ZeRO-3: its parameters are shards)
    forward: torch.nn.Module  # what the batch goes through
    state_module: torch.nn.Module  # what checkpoints save (FSDP for ZeRO-3)
    optimizer: torch.optim.Optimizer
    mp: MixedPrecision
    dp: DataParallelBucket | None = None
    grad_params: list = field(default_factory=list)
    clip_fn: object = None


def build_setup(config: TrainConfig, ctx: DistributedContext, options: RunOptions) -> _Setup:
    """Model, data-parallel or ZeRO wrapper, optimizer and mixed-precision policy of a run."""
    model = GPT(config.model, seed=config.data.seed).to(ctx.device)
    if options.activation_checkpointing is not None:
        from refimpl.activations import apply_activation_checkpointing, parse_block_selection

        apply_activation_checkpointing(model, parse_block_selection(options.activation_checkpointing))
    # ZeRO-3 in 16 bits as FSDP2: 16-bit gathered weights, fp32 master shards, gradients reduced in fp32
    fsdp_mp = options.zero_stage == 3 and options.precision != "fp32"
    mp = MixedPrecision(MixedPrecisionPolicy.from_name(options.precision, master_weights=fsdp_mp), model,
                        device=ctx.device, wrapper_keeps_master=fsdp_mp)
    clip = config.optim.grad_clip
    stage = options.zero_stage
    if stage == 0:
        dp = DataParallelBucket(model) if ctx.world_size > 1 else None  # broadcasts rank 0's weights
        return _Setup(model=model, forward=dp or model, state_module=model, mp=mp, dp=dp,
                      optimizer=build_optimizer(model, config.optim), grad_params=list(model.parameters()))
    from refimpl.parallel.zero import FullyShardedDataParallel, ShardedOptimizer

    if stage in (1, 2):  # every rank built the same weights from the seed: no broadcast needed
        o = config.optim
        optimizer = ShardedOptimizer(param_groups(model, o.weight_decay), torch.optim.AdamW, zero_stage=stage,
                                     lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
        # stage 1 checks the full local gradients (reduced in step), stage 2 the shards it kept
        grads = optimizer.params if stage == 1 else [optimizer.shard(p) for p in optimizer.params]
        return _Setup(model=model, forward=model, state_module=model, mp=mp, optimizer=optimizer,
                      grad_params=list(grads),
                      clip_fn=None if clip is None else (lambda _: optimizer.clip_grad_norm_(clip)))
    fsdp = FullyShardedDataParallel(model, mp_policy=mp.policy if fsdp_mp else None)
    return _Setup(model=model, forward=fsdp, state_module=fsdp, mp=mp,
                  optimizer=build_optimizer(fsdp, config.optim), grad_params=fsdp.sharded_parameters(),
                  clip_fn=None if clip is None else (lambda _: fsdp.clip_grad_norm_(clip)))


def _sampling_model(setup: _Setup, config: TrainConfig, options: RunOptions,
                    ctx: DistributedContext) -> torch.nn.Module | None:
    """A full model to sample from on rank 0 (ZeRO-3 gathers it: collective); None on other ranks."""
    if options.zero_stage != 3:
        return setup.model if ctx.is_main else None
    full = setup.state_module.full_state_dict()
    if not ctx.is_main:
        return None
    model = GPT(config.model, seed=config.data.seed).to(next(iter(full.values())).device)
    model.load_state_dict(full, strict=False)  # a tied output weight is the embedding's
    return model
