"""A run's pieces, built through ``refimpl.parallel.parallelize.parallelize`` (chapter 12): the model,
its data-parallel or ZeRO wrapper on the ``dp x cp`` group (chapters 03-04), the optimizer and the
mixed-precision policy (chapter 05), as ``build_setup`` puts them together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from refimpl.config import TrainConfig
from refimpl.distributed import DistributedContext
from refimpl.distributed.mesh import ParallelGroups
from refimpl.models import GPT
from refimpl.moe_balance import ExpertLoad
from refimpl.parallel.optimizer_setup import OptimizerSetup
from refimpl.parallel.parallelize import parallelize
from refimpl.parallel.parallelized import Parallelized
from refimpl.precision import MixedPrecision
from refimpl.train.args import RunOptions
from refimpl.train.layout import Layout

if TYPE_CHECKING:
    from refimpl.parallel.pipeline_parallel import PipelineModule


@dataclass(kw_only=True)
class _Setup:
    """A run's pieces, each held by the object that owns it (``build_setup``): ``parallel``, what
    ``parallelize`` made of the model (``Parallelized``: the wrapper the batch goes through, the layout's
    loss and batch split, its groups, the pipeline's stages); ``optim``, the optimizer built for the layout
    (``OptimizerSetup``: AdamW, what completes the gradients after the data-parallel reduction, the
    layout's clipping norm); ``experts``, an MoE model's once-per-step balance (``ExpertLoad``; None for a
    dense model); ``ep``, the expert-parallel degree. What the step and the loop read most is named below."""

    parallel: Parallelized
    optim: OptimizerSetup
    experts: ExpertLoad | None = None
    ep: int = 1

    @property
    def model(self) -> torch.nn.Module:
        """The plain model (ZeRO-3: its parameters are shards; pipeline: this rank's stages)."""
        return self.parallel.model

    @property
    def forward(self) -> torch.nn.Module:
        """What the batch goes through (the data-parallel or ZeRO wrapper)."""
        return self.parallel.forward

    @property
    def state_module(self) -> torch.nn.Module:
        """What a checkpoint saves (the ZeRO-3 wrapper)."""
        return self.parallel.state_module

    @property
    def mp(self) -> MixedPrecision:
        return self.parallel.mp

    @property
    def pipeline(self) -> PipelineModule | None:
        return self.parallel.pipeline

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optim.optimizer


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
    experts = None
    if config.model.num_experts:
        experts = ExpertLoad(model=par.model, group=par.group, device=ctx.device,
                             pp_group=None if par.pipeline is None else par.pipeline.pp_group,
                             sp_group=par.tp_group if options.parallel.sequence_parallel else None)
    return _Setup(parallel=par, optim=par.build_optimizer(config.optim), experts=experts, ep=dims.ep)


# one return per layout kind, and None on the ranks that do not sample
def _sampling_model(setup: _Setup, config: TrainConfig, options: RunOptions,  # noqa: PLR0911
                    ctx: DistributedContext) -> GPT | None:
    """A full model to sample from on rank 0 (ZeRO-3 and tensor parallelism gather it: collective); None on
    other ranks. Under context parallelism the trained model's attention is collective, so rank 0 samples
    from a plain GPT holding the same weights."""
    boxed = setup.pipeline if setup.pipeline is not None else (
        setup.state_module if (setup.parallel.tp_group is not None and options.parallel.zero_stage == 3)
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
    if setup.parallel.tp_group is not None:
        from refimpl.parallel.tensor_parallel import full_state_dict

        full = full_state_dict(setup.model, setup.parallel.tp_group)
        if not ctx.is_main:
            return None
        model = GPT(config.model, seed=config.data.seed).to(ctx.device)
        model.load_state_dict(full, strict=False)  # a tied output weight is the embedding's
        return model
    if options.parallel.zero_stage != 3:
        if not ctx.is_main:
            return None
        if setup.parallel.cp_group is None:
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
