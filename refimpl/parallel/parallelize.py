"""One function applies every parallel technique to a model, in one fixed order: ``parallelize``.

Chapter 12 (the 3D trainer) explains the order; each step is the technique of its chapter. The trainer
(``refimpl.train.setup``) builds its run through this function only. As in torchtitan's
``parallelize_llama`` (``torchtitan/models/llama3/parallelize.py``: tensor parallel, then activation
checkpointing, then ``torch.compile``, then FSDP with the mixed-precision policy) and Megatron-LM (the model
is built tensor- and pipeline-parallel first, then wrapped in its ``DistributedDataParallel``), the order is:

1. **tensor / sequence parallel** over the ``tp`` group (chapter 06; Shoeybi et al. 2019, Korthikanti et al.
   2022). First, because it *replaces* modules (a ``Linear`` by a ``ColumnParallelLinear``) and parameters (by
   their shards): everything after it must see the final modules and the local shards, never the full ones.
1b. **expert parallel** over the ``ep`` group (chapter 09; GShard, Lepikhin et al. 2020; torchtitan's
   dp2ep): each MoE block keeps its rank's experts (``refimpl.parallel.expert_parallel_gpt.
   apply_expert_parallel``). Like 1 it replaces parameters by shards (the experts' rows), inside the blocks,
   and leaves the dense part as 1 made it: an MoE MLP is not tensor-split (the experts are replicated over
   ``tp``). The data-parallel step 6 then averages the dense gradients over ``dp x cp`` and leaves the
   experts to the expert-data-parallel reduction (sum over ``edp``, divided by ``dp x cp``).
1c. **fp8 linears** (chapter 10; torchao's ``convert_to_float8_training``, ``--precision fp8``): the seam's
   layers get fp8 GEMMs in place (``refimpl.precision.fp8.apply_float8_training``), the tensor-parallel
   ones with scales agreed over ``tp`` (one device's scales). After 1 and 1b, so that it sees the final
   layers (a column-parallel block, not the full linear it replaced), but with the first and last linear
   named on the plain model, before 1 replaced them; before 3 and 4, which wrap or move whole blocks.
   Under ZeRO-3 (step 6, and per pipeline stage) those layers' weights are all-gathered in fp8
   (``refimpl.parallel.zero.fsdp_float8``). Rowwise scaling or tp > 1 with ZeRO-3 do not compose with
   it yet (refimpl/support.py says why).
2. **context parallel** over the ``cp`` group (chapter 07; ring attention, Liu et al. 2023; Ulysses, Jacobs
   et al. 2023). It swaps the attention inside each block and shards the sequence: like 1, a change inside
   the blocks, so it comes before the steps that wrap whole blocks. An MoE block's balance loss then sums
   each sequence's counts over ``cp`` (``refimpl.models.moe.sequence_balance_loss``).
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
   ranks that saw other tokens of the same shard (``dp x cp``, ``refimpl.distributed.mesh.LOSS_AXES``).
   ZeRO-0 is ``refimpl.parallel.data_parallel.DataParallelBucket``; ZeRO-1/2 a
   ``refimpl.parallel.zero.ShardedOptimizer`` (the optimizer *is* the technique, so
   ``Parallelized.build_optimizer`` makes it); ZeRO-3
   ``refimpl.parallel.zero.FullyShardedDataParallel`` (with expert parallelism each MoE block's
   experts a unit of their own over the expert-data-parallel group, their gradients divided by ``dp x cp``).

Step 1 with ``tp > 1`` composes with ZeRO 0-2 over ``dp``; ZeRO-3 would shard the tensor-parallel shards
again over ``dp`` (FSDP2's 2-D layout): not built, refused.

Under pipeline parallelism (step 3, ``pp > 1``) the model becomes this rank's stages, a
``refimpl.parallel.pipeline_parallel.PipelineModule`` (``Parallelized.pipeline``): a step is one
``refimpl.parallel.pipeline_parallel.PipelineModule.step`` over the micro-batches, not a forward per
micro-batch; the gradients are averaged over ``dp x cp`` once, after the step's last backward
(``OptimizerSetup.finish_gradients``; a rank that skipped it would drift from its replicas: picotron's DP
x PP bug), and the gradient norm sums over the ``pp`` ranks (a tied embedding counted once). It composes with
data parallelism (ZeRO 0-2; ZeRO-2 reduce-scatters every micro-batch's gradients), tensor and sequence
parallelism and context parallelism (steps 1-2 come first: the stages hold the tensor- and context-parallel
blocks, and the stage boundaries carry each rank's part of the sequence), precision and activation
checkpointing; with ZeRO-3 it is refused (each micro-batch would gather its stage's weights again).

Under context parallelism (step 2, ``cp > 1``) each rank runs the model on its part of the sequence:
``Parallelized.split_batch`` cuts the tokens (inputs and labels alike) by the layout the attention was
built for, and the embedding gives those tokens their global positions. The parameters are replicated over
``cp`` like over ``dp``, so step 6 treats the ``dp x cp`` ranks as one data-parallel group: each rank's loss
is the mean over its ``b s/cp`` tokens, and the mean of those over the group is the global batch's mean.

Under tensor parallelism the model returns the logits shard ``[b, s, V/t]``: ``Parallelized.loss``
takes the vocab-parallel loss on it, the gradient norm counts every element once
(``refimpl.parallel.tensor_parallel.grad_norm``) and, under sequence parallelism,
``OptimizerSetup.finish_gradients`` sums the gradients of the replicated parameters that saw ``s/t``
tokens over the ``tp`` group, after the data-parallel reduction and before clipping.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from refimpl.config import ParallelConfig
from refimpl.distributed.mesh import LOSS_AXES, SHARD_AXES, ParallelDims, ParallelGroups
from refimpl.parallel.data_parallel import DataParallelBucket
from refimpl.parallel.data_parallel.data_parallel_communications import broadcast_module
from refimpl.parallel.declarations import declared, moe_layers
from refimpl.parallel.expert_parallel_gpt import apply_expert_parallel, expert_parameter_names
from refimpl.parallel.optimizer_setup import OptimizerSetup
from refimpl.parallel.parallelized import Parallelized, context_parallel_options, record_parallel_placements
from refimpl.precision import MixedPrecision, MixedPrecisionPolicy
from refimpl.support import check_supported

if TYPE_CHECKING:
    from refimpl.parallel.pipeline_parallel import PipelineModule
    from refimpl.precision.fp8.scaling import Scaling

__all__ = ["ORDER", "OptimizerSetup", "Parallelized", "parallelize"]

# the steps of ``parallelize``, in the order applied
ORDER = ("tensor parallel", "expert parallel", "fp8 linears", "context parallel", "pipeline split",
         "activation checkpointing", "mixed precision", "data parallel")


def _layout(groups_or_dims: ParallelGroups | ParallelDims, config: ParallelConfig, *,
            moe: bool = False) -> tuple[ParallelDims, ParallelGroups | None]:
    """The layout and its groups; refuses a config whose degrees are not the layout's, combinations that
    are not built (saying why, ``refimpl.support.check_supported``) and a multi-rank layout given
    without its groups, before anything is touched (every rank alike)."""
    if isinstance(groups_or_dims, ParallelGroups):
        dims, groups = groups_or_dims.dims, groups_or_dims
    elif isinstance(groups_or_dims, ParallelDims):
        dims, groups = groups_or_dims, None
    else:
        raise TypeError("parallelize takes ParallelGroups or ParallelDims, got "
                        f"{type(groups_or_dims).__name__}")
    layout = {"dp": dims.dp, "cp": dims.cp, "tp": dims.tp, "pp": dims.pp, "dp_replicate": dims.dp_replicate,
              "ep": dims.ep}
    differ = {k: v for k, v in config.degrees.items() if v is not None and v != layout[k]}
    if differ:
        raise ValueError(f"the config's degrees {differ} are not the layout's {dims.describe()}: give "
                         "dims.config(...) (ParallelDims.config: the layout's degrees and your options)")
    # refused combinations: refimpl/support.py (the MoE rows when the model has MoE blocks)
    check_supported(dataclasses.replace(config, dp=dims.dp), moe=moe)
    if groups is None and dims.world_size > 1:
        raise ValueError(f"the layout {dims.describe()} spans {dims.world_size} ranks: pass its process "
                         "groups (dims.build(rank=..., world_size=..., timeout_s=...))")
    return dims, groups


def parallelize(model: nn.Module, groups_or_dims: ParallelGroups | ParallelDims,
                config: ParallelConfig | None = None) -> Parallelized:
    """Apply the techniques of ``config`` to ``model`` over the groups of the layout, in the order of the
    module docstring (``ORDER``); return the pieces a training step needs (``Parallelized``).

    ``config``: a ``refimpl.config.ParallelConfig`` whose degrees are the layout's (``dp`` may be
    None; None: ``dims.config()``, the layout's degrees with every technique option at its default).

    ``groups_or_dims``: this rank's ``ParallelGroups`` (``dims.build(...)``, built once per run), or a
    one-rank ``ParallelDims`` (no process group). The model must be identical on every rank (same
    seed); it is changed in place (checkpointed blocks, ZeRO-3's shards). Collective under several ranks.
    """
    if config is None:
        dims = groups_or_dims.dims if isinstance(groups_or_dims, ParallelGroups) else groups_or_dims
        config = dims.config()
    experts = expert_parameter_names(model)  # [] for a dense model
    dims, groups = _layout(groups_or_dims, config, moe=bool(experts))
    applied: list[str] = []
    tp_group, ep_group, cp_group = _inside_blocks(model, dims, groups, config, applied)  # steps 1-2
    pipeline = None
    # 3. pipeline split over pp: this rank keeps its stages (and runs them by the schedule)
    if dims.pp > 1:
        from refimpl.parallel.pipeline_parallel import PipelineModule

        pp_group = _group(groups, "pp")
        pipeline = PipelineModule(model, pp_group=pp_group, pp_rank=dist.get_rank(pp_group), pp_size=dims.pp,
                                  schedule=config.pp_schedule, virtual_stages=config.virtual_stages,
                                  balance=config.pp_balance,
                                  sequence_split=dims.tp if config.sequence_parallel else 1)
        applied.append("pipeline split")
    # 4. activation checkpointing, on the blocks the wrapper of step 6 will hook
    if config.activation_checkpointing not in (None, "none"):
        from refimpl.parallel.activation_checkpoint import (
            apply_activation_checkpointing,
            parse_block_selection,
        )

        apply_activation_checkpointing(model, parse_block_selection(config.activation_checkpointing),
                                       unit_types=tuple(declared(model, "shard_units")()))
        applied.append("activation checkpointing")
    # 5. mixed precision: the policy, handed to ZeRO-3 (it casts before the all-gather) or used as autocast.
    # The fp16 scaler agrees on overflow over WORLD (group None): every rank skips the step together.
    fsdp_mp = config.fsdp_mixed_precision
    device = next(iter(model.parameters())).device
    mp = MixedPrecision(MixedPrecisionPolicy.from_name(config.precision, master_weights=fsdp_mp),
                        model if pipeline is None else pipeline, device=device, wrapper_keeps_master=fsdp_mp)
    if config.precision != "fp32":
        applied.append("mixed precision")
    # 6. data parallel / ZeRO over dp x cp, outermost
    group = None if groups is None else groups.group(*LOSS_AXES)
    done = Parallelized(model=model, forward=model, state_module=model, mp=mp, config=config, group=group,
                        applied=applied, tp_group=tp_group, cp_group=cp_group, ep_group=ep_group,
                        edp_group=None if ep_group is None else _group(groups, "edp"),
                        experts=experts if ep_group is not None else [])
    if pipeline is not None:  # the dp x cp average comes once per step (OptimizerSetup.finish_gradients)
        _data_parallel_stages(done, model, pipeline, groups, dims)
    else:
        _data_parallel(done, model, groups, dims)
    done.placements = record_parallel_placements(done, replicas=dims.dp * dims.cp)
    return done


def _group(groups: ParallelGroups | None, *axes: str) -> dist.ProcessGroup:
    """The group of ``axes`` in a layout of several ranks, whose groups ``_layout`` made sure were given."""
    assert groups is not None, "a layout of several ranks comes with its groups (_layout)"
    return groups.group(*axes)


def _inside_blocks(
    model: nn.Module, dims: ParallelDims, groups: ParallelGroups | None, config: ParallelConfig,
    applied: list[str],
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Steps 1 to 2, which change the inside of the blocks: tensor, expert and context parallelism and the
    fp8 linears (module docstring), each recorded in ``applied``; returns the ``tp``, ``ep`` and ``cp``
    groups (None: not applied)."""
    tp_group = cp_group = ep_group = None
    fp8 = config.precision == "fp8"
    if fp8:  # the first and last linear of the plain model, named before tensor parallelism replaces them
        from refimpl.precision.fp8 import apply_float8_training, first_and_last_linear

        keep_bf16 = first_and_last_linear(model)
    # 1. tensor / sequence parallel over tp: replaces the linears and the embedding by their shards
    if dims.tp > 1:
        from refimpl.parallel.tensor_parallel import apply_tensor_parallel

        tp_group = _group(groups, "tp")
        apply_tensor_parallel(model, tp_group=tp_group, sequence_parallel=config.sequence_parallel,
                              tp_comm_overlap=config.tp_comm_overlap)
        if config.sequence_parallel:  # an MoE block routes this tp rank's s/t tokens (refimpl.models.moe)
            for block in moe_layers(model):
                block.sp_group = tp_group
        applied.append("tensor parallel")
    # 1b. expert parallel over ep: each MoE block keeps its rank's experts (the rest replicated)
    if dims.ep > 1:
        ep_group = _group(groups, "ep")
        apply_expert_parallel(model, ep_group=ep_group)
        applied.append("expert parallel")
    # 1c. fp8 linears: the seam's layers (tensor-parallel blocks too) get fp8 GEMMs; first and last kept
    if fp8:
        scaling = cast("Scaling", config.fp8_scaling)  # one of FP8_SCALINGS: ParallelConfig refuses others
        apply_float8_training(model, scaling=scaling, keep=keep_bf16)
        applied.append("fp8 linears")
    # 2. context parallel over cp: attention across the ranks' parts of the sequence, global positions
    if dims.cp > 1:
        from refimpl.parallel.context_parallel import apply_context_parallel

        cp_group = _group(groups, "cp")
        method, layout = context_parallel_options(config)
        apply_context_parallel(model, cp_group=cp_group, method=method, layout=layout)
        for block in moe_layers(model):  # the balance loss counts each whole sequence's assignments
            block.cp_group = cp_group
        applied.append("context parallel")
    return tp_group, ep_group, cp_group


def _data_parallel_stages(done: Parallelized, model: nn.Module, pipeline: PipelineModule,
                          groups: ParallelGroups | None, dims: ParallelDims) -> None:
    """Step 6 under pipeline parallelism: ``done`` runs this rank's stages (``pipeline``), whose replicas
    start equal (the first rank's weights broadcast over ``dp x cp``) and, at ZeRO-3, are sharded stage by
    stage (``_shard_stages``); the gradients' average is ``OptimizerSetup.finish_gradients``'."""
    done.model = done.forward = done.state_module = done.pipeline = pipeline
    held = dict(pipeline.named_parameters_full())
    done.experts = [n for n in done.experts if n in held]  # this rank's stages' experts
    replicas = dims.dp * dims.cp
    if replicas > 1:  # the replicas start equal, as DataParallelBucket makes them (an ep rank's experts
        expert_ids = {id(held[n]) for n in done.experts}  # are its own: not the first rank's)
        broadcast_module(pipeline, done.group, exclude=[n for n, p in pipeline.named_parameters()
                                                        if id(p) in expert_ids])
        done.applied.append("data parallel")
        if done.config.zero_stage == 3:
            _shard_stages(done, pipeline, groups, dims, unit_types=tuple(declared(model, "shard_units")()))
    else:
        done.group = None


def _data_parallel(done: Parallelized, model: nn.Module, groups: ParallelGroups | None,
                   dims: ParallelDims) -> None:
    """Step 6 without a pipeline: ZeRO-0's ``DataParallelBucket`` (several replicas), ZeRO-1/2's sharded
    optimizer (built later, ``Parallelized.build_optimizer``) or ZeRO-3's ``FullyShardedDataParallel``."""
    config, replicas = done.config, dims.dp * dims.cp
    if config.zero_stage == 0:
        if replicas > 1:  # broadcasts the first rank's weights over the group (not an ep rank's experts)
            done.sync = DataParallelBucket(model, config.bucket_cap_mb, done.group, ignore=done.experts)
            done.forward = done.sync
            done.applied.append("data parallel")
    elif config.zero_stage in (1, 2):  # every rank built the same weights: the optimizer shards them
        done.applied.append("data parallel")
    else:
        from refimpl.parallel.zero import FullyShardedDataParallel

        fsdp = FullyShardedDataParallel(model, group=_zero3_groups(done, groups, dims),
                                        unit_types=tuple(declared(model, "shard_units")()),
                                        replicate_group=done.replicate_group, prefetch=config.prefetch,
                                        reshard_after_forward=config.reshard_after_forward,
                                        mp_policy=done.mp.policy if config.fsdp_mixed_precision else None,
                                        own_groups=_expert_units(done, model, replicas))
        # the fp8 linears' weights gathered in fp8 (torchao's enable_fsdp_float8_all_gather)
        if config.precision == "fp8":
            from refimpl.parallel.zero.fsdp_float8 import enable_float8_all_gather

            enable_float8_all_gather(fsdp)
        done.forward = done.state_module = fsdp
        done.applied.append("data parallel")


def _expert_units(done: Parallelized, module: nn.Module,
                  replicas: int) -> dict[nn.Module, tuple[dist.ProcessGroup | None, int | None]] | None:
    """ZeRO-3 with expert parallelism: each MoE block's experts a unit of their own, sharded over the
    expert-data-parallel group and their gradients summed there and divided by ``dp x cp`` (torchtitan's
    ``fully_shard`` on its ``efsdp`` mesh with ``gradient_divide_factor``); None without ``ep``."""
    if done.ep_group is None:
        return None
    return {block.expert_unit(): (done.edp_group, replicas) for block in moe_layers(module)}


def _zero3_groups(done: Parallelized, groups: ParallelGroups | None,
                  dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group ZeRO-3 shards over: ``dp x cp``, or under HSDP a shard group (``dp_shard x cp``), the
    shards then all-reduced across the ``dp_replicate`` groups (both recorded on ``done``)."""
    if dims.dp_replicate == 1:
        return done.group
    done.shard_group = _group(groups, *SHARD_AXES)
    done.replicate_group = _group(groups, "dp_replicate")
    return done.shard_group


def _shard_stages(done: Parallelized, pipeline: PipelineModule, groups: ParallelGroups | None,
                  dims: ParallelDims, *, unit_types: tuple[type[nn.Module], ...]) -> None:
    """ZeRO-3 under pipeline parallelism: each of this rank's stages sharded in place over ``dp x cp``
    (FSDP2's ``fully_shard`` per stage, as torchtitan applies it). By default a stage is gathered once per
    step and kept through its micro-batches, its gradients accumulated whole and reduce-scattered once
    after the schedule's last backward (``PipelineModule.after_backward``); with
    ``zero3_reshard_per_microbatch`` every micro-batch gathers, frees and reduces (m times the
    collectives, the stage's full weights and gradients never held across micro-batches)."""
    from refimpl.parallel.zero import FullyShardedDataParallel

    config = done.config
    shard_group = _zero3_groups(done, groups, dims)
    per_micro = config.zero3_reshard_per_microbatch
    policy = done.mp.policy if config.fsdp_mixed_precision else None
    replicate = done.replicate_group
    done.fsdp_stages = [FullyShardedDataParallel(stage, group=shard_group, replicate_group=replicate,
                                                 unit_types=unit_types,
                                                 reshard_after_forward=per_micro, declare_on_module=True,
                                                 mp_policy=policy,
                                                 output_dtype=None if policy is None else torch.float32,
                                                 own_groups=_expert_units(done, stage, dims.dp * dims.cp))
                        for stage in pipeline.stages.values()]
    if config.precision == "fp8":  # each stage's fp8 linears' weights gathered in fp8, as at pp = 1
        from refimpl.parallel.zero.fsdp_float8 import enable_float8_all_gather

        for fsdp in done.fsdp_stages:
            enable_float8_all_gather(fsdp)
    if not per_micro:
        for fsdp in done.fsdp_stages:
            fsdp.set_requires_gradient_sync(False)

        def finish_gradient_sync() -> None:  # the stages' reduce-scatter, once after the last backward
            for fsdp in done.fsdp_stages:
                fsdp.finish_gradient_sync()

        pipeline.after_backward = finish_gradient_sync
