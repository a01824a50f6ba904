"""A run's pieces, built through ``refimpl.parallel.parallelize.parallelize`` (chapter 12): the model,
its data-parallel or ZeRO wrapper on the ``dp x cp`` group (chapters 03-04), the optimizer and the
mixed-precision policy (chapter 05), as ``build_setup`` puts them together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from refimpl.config import TrainConfig
from refimpl.distributed import DistributedContext
from refimpl.distributed.mesh import ParallelGroups
from refimpl.models import GPT, lm_loss
from refimpl.parallel.data_parallel import DataParallelBucket
from refimpl.parallel.parallelize import parallelize
from refimpl.precision import MixedPrecision
from refimpl.train.args import RunOptions
from refimpl.train.layout import Layout

if TYPE_CHECKING:
    from refimpl.parallel.pipeline_parallel import PipelineModule


@dataclass(kw_only=True)
class _Setup:
    model: torch.nn.Module  # the plain GPT (ZeRO-3: its parameters are shards)
    forward: torch.nn.Module  # what the batch goes through
    state_module: torch.nn.Module  # what checkpoints save (FSDP for ZeRO-3)
    optimizer: torch.optim.Optimizer
    mp: MixedPrecision
    dp: DataParallelBucket | None = None
    grad_params: list = field(default_factory=list)
    clip_fn: Callable[[list[torch.Tensor]], object] | None = None  # replaces clip_grad_norm_ (a sharded norm)
    group: torch.distributed.ProcessGroup | None = None  # dp x cp: gradients and the loss are averaged here
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss  # (logits, labels) -> mean loss
    finish_gradients: Callable[[], None] | None = None  # after the dp reduction (sequence parallelism)
    tp_group: torch.distributed.ProcessGroup | None = None
    split_batch: Callable[[torch.Tensor], torch.Tensor] = lambda tokens: tokens  # [b, s] -> [b, s/cp]
    cp_group: torch.distributed.ProcessGroup | None = None
    pipeline: PipelineModule | None = None  # this rank's pipeline stages (PipelineModule): a step per call
    placements: dict = field(default_factory=dict)  # each held parameter's Placement (refimpl.parallel)
    # MoE models: once per step, before the optimizer step: the load summed over dp x cp, the expert bias
    # update, the step's figures (refimpl.moe_balance.finish_step); None for a dense model
    moe_step: Callable[[int], dict | None] | None = None
    moe_metrics: dict | None = None  # the last step's figures (metrics.jsonl)
    # MoE under pipeline parallelism: a stage's balance losses after its forward, / micro-batches
    # (Parallelized.stage_balance_loss); None otherwise
    stage_loss: Callable[..., torch.Tensor | None] | None = None
    ep: int = 1


def build_setup(config: TrainConfig, ctx: DistributedContext, layout: Layout,
                groups: ParallelGroups | None = None) -> _Setup:
    """Model, data-parallel or ZeRO wrapper, optimizer and mixed-precision policy of a run, over the groups
    of the resolved ``layout`` (``refimpl.train.layout.resolve``; ``groups``: from ``dims.build``, built
    once by the trainer; None: built here, a collective, when a process group exists, else a one-process
    run)."""
    dims, options = layout.dims, layout.options
    if groups is None and torch.distributed.is_initialized():
        groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    model = GPT(config.model, seed=config.data.seed).to(ctx.device)
    par = parallelize(model, groups if groups is not None else dims, options.parallel)
    opt = par.build_optimizer(config.optim)
    moe_step = None
    if config.model.num_experts:
        from refimpl.moe_balance import finish_step

        def moe_step(micro_batches: int) -> dict | None:
            return finish_step(par.model, par.group, micro_batches=micro_batches, device=ctx.device,
                               pp_group=None if par.pipeline is None else par.pipeline.pp_group,
                               sp_group=par.tp_group if options.parallel.sequence_parallel else None)

    return _Setup(model=par.model, forward=par.forward, state_module=par.state_module, mp=par.mp,
                  optimizer=opt.optimizer, dp=par.sync, grad_params=opt.grad_params, clip_fn=opt.clip_fn,
                  group=par.group, loss=par.loss, finish_gradients=opt.finish_gradients,
                  tp_group=par.tp_group, split_batch=par.split_batch, cp_group=par.cp_group,
                  pipeline=par.pipeline, placements=par.placements, moe_step=moe_step, ep=dims.ep,
                  stage_loss=par.stage_balance_loss if moe_step is not None and par.pipeline is not None
                  else None)


# one return per layout kind, and None on the ranks that do not sample
def _sampling_model(setup: _Setup, config: TrainConfig, options: RunOptions,  # noqa: PLR0911
                    ctx: DistributedContext) -> GPT | None:
    """A full model to sample from on rank 0 (ZeRO-3 and tensor parallelism gather it: collective); None on
    other ranks. Under context parallelism the trained model's attention is collective, so rank 0 samples
    from a plain GPT holding the same weights."""
    boxed = setup.pipeline if setup.pipeline is not None else (
        setup.state_module if (setup.tp_group is not None and options.parallel.zero_stage == 3)
        or setup.ep > 1
        else None)  # expert parallelism: each rank holds its experts' rows
    if boxed is not None:  # each rank holds boxes (its stages, tp blocks, ZeRO-3 rows of them): on rank 0
        import torch.distributed as dist

        from refimpl.distributed.placement import module_shards

        mine = [(name, shard.box, shard.tensor.detach().cpu())
                for name, shard in module_shards(boxed).items()]
        parts: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
        dist.gather_object(mine, parts, dst=0)
        if parts is None:  # not rank 0
            return None
        full: dict[str, torch.Tensor] = {}
        for name, box, tensor in (item for part in parts for item in part):  # dp replicas write alike
            whole = full.setdefault(name, torch.empty(box.global_shape, dtype=tensor.dtype))
            whole[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.shape, strict=True))] = tensor
        model = GPT(config.model, seed=config.data.seed).to(ctx.device)
        model.load_state_dict(full, strict=False)  # a tied output weight is the embedding's
        return model
    if setup.tp_group is not None:
        from refimpl.parallel.tensor_parallel import full_state_dict

        full = full_state_dict(setup.model, setup.tp_group)
        if not ctx.is_main:
            return None
        model = GPT(config.model, seed=config.data.seed).to(ctx.device)
        model.load_state_dict(full, strict=False)  # a tied output weight is the embedding's
        return model
    if options.parallel.zero_stage != 3:
        if not ctx.is_main:
            return None
        if setup.cp_group is None:
            assert isinstance(setup.model, GPT)  # no boxes: the plain GPT build_setup made
            return setup.model
        model = GPT(config.model, seed=config.data.seed).to(ctx.device)
        model.load_state_dict(setup.model.state_dict())
        return model
    from refimpl.parallel.zero import FullyShardedDataParallel

    assert isinstance(setup.state_module, FullyShardedDataParallel)  # ZeRO-3 without boxes: the wrapper
    full = setup.state_module.full_state_dict()
    if not ctx.is_main:
        return None
    model = GPT(config.model, seed=config.data.seed).to(next(iter(full.values())).device)
    model.load_state_dict(full, strict=False)  # a tied output weight is the embedding's
    return model
