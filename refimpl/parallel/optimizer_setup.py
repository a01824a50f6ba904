"""The optimizer of a parallelized model (chapter 10): :func:`build_optimizer_setup`, which
``Parallelized.build_optimizer`` calls, gives AdamW over this rank's parameters and what the checked step
needs for the layout, as an :class:`OptimizerSetup`.

* one device, DP (ZeRO-0) and ZeRO-3: plain AdamW (ZeRO-3's parameters are already shards; its wrapper
  clips over them);
* ZeRO-1/2 (Rajbhandari et al. 2020, chapter 04): a :class:`~refimpl.parallel.zero.ShardedOptimizer` over
  the ``dp x cp`` group;
* tensor parallelism (chapter 06): the norm counts each element of the model once, the sequence-parallel
  gradients are summed over ``tp``;
* pipeline parallelism (chapter 08): AdamW (ZeRO-1/2) over this rank's stages, the ``dp x cp`` average once
  per step, the norm over ``pp`` (and ``tp``, ``dp``) with a tied embedding counted once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.config import OptimConfig
from refimpl.optim import build_optimizer, param_groups

if TYPE_CHECKING:
    from refimpl.parallel.parallelize import Parallelized


@dataclass(frozen=True, kw_only=True)
class OptimizerSetup:
    """The optimizer and what the checked step needs: the gradients this rank checks and clips
    (``grad_params``, e.g. its ZeRO shards) and a clipping function over shards (None:
    ``clip_grad_norm_``)."""

    optimizer: torch.optim.Optimizer
    grad_params: list[torch.Tensor]
    clip_fn: Callable[[list[torch.Tensor]], object] | None = None
    finish_gradients: Callable[[], None] | None = None  # after the dp reduction (sequence parallelism)


def build_optimizer_setup(par: Parallelized, config: OptimConfig) -> OptimizerSetup:
    """AdamW over this rank's parameters: plain for ZeRO-0 and ZeRO-3 (whose parameters are already
    shards), a :class:`~refimpl.parallel.zero.ShardedOptimizer` over ``group`` for ZeRO-1/2."""
    zero_stage, clip = par.options.zero_stage, config.grad_clip
    if par.pipeline is not None:
        return _pipeline_optimizer(par, config)
    if par.tp_group is not None:
        return _tensor_parallel_optimizer(par, config)
    if zero_stage == 0:
        return OptimizerSetup(optimizer=build_optimizer(par.model, config),
                              grad_params=list(par.model.parameters()))
    if zero_stage == 3:
        fsdp = par.state_module
        return OptimizerSetup(optimizer=build_optimizer(fsdp, config),
                              grad_params=fsdp.sharded_parameters(),
                              clip_fn=None if clip is None else (lambda _: fsdp.clip_grad_norm_(clip)))
    from refimpl.parallel.zero import ShardedOptimizer

    optimizer = ShardedOptimizer(param_groups(par.model, config.weight_decay), torch.optim.AdamW,
                                 par.group, zero_stage=zero_stage,
                                 bucket_numel=par.options.zero_bucket_numel, lr=config.lr,
                                 betas=(config.beta1, config.beta2), eps=config.eps,
                                 foreach=False)
    # stage 1 checks the full local gradients (reduced in step), stage 2 the shards it kept
    grads = optimizer.params if zero_stage == 1 else [optimizer.shard(p) for p in optimizer.params]
    return OptimizerSetup(optimizer=optimizer, grad_params=list(grads),
                          clip_fn=None if clip is None else (lambda _: optimizer.clip_grad_norm_(clip)))

def _pipeline_optimizer(par: Parallelized, config: OptimConfig) -> OptimizerSetup:
    """AdamW over this rank's stages(ZeRO-1/2: a :class:`~refimpl.parallel.zero.ShardedOptimizer` over dp
    x cp); the dp x cp average after the step's last backward (ZeRO-1: into the shards; ZeRO-2: its hooks
    reduce-scatter every micro-batch's gradients inside that backward and free them, so a rank holds one
    shard of the gradients for ``m`` times the reduce-scatter traffic; the reason DeepSpeed refuses ZeRO-2
    with a pipeline), then under sequence parallelism the ``s/t``-token gradients summed over tp; the norm
    summed over the pp, tp and (ZeRO-1/2) dp ranks, each element once: the last stage's copy of a tied
    embedding left out, a tensor-parallel replica counted on tp rank 0
    (:mod:`refimpl.parallel.tensor_parallel.grad_norm`)."""
    from refimpl.parallel.data_parallel.data_parallel_communications import reduce_gradients_
    from refimpl.parallel.zero.clip_grad import scale_to_max_norm_, sum_of_squares

    pipe, group, policy, tp = par.pipeline, par.group, par.mp.policy, par.tp_group
    params = list(pipe.parameters())
    device = params[0].device
    sharded: set[int] = set()
    if tp is not None:
        from refimpl.parallel.tensor_parallel import tensor_parallel_sharded

        sharded = tensor_parallel_sharded(pipe)
    first_tp = tp is None or dist.get_rank(tp) == 0
    named = pipe.named_parameters_full()  # weight decay by the GPT's names (a tied copy is the embedding)
    zero = par.options.zero_stage if group is not None else 0
    if zero:
        from refimpl.parallel.zero import ShardedOptimizer

        optimizer = ShardedOptimizer(param_groups(pipe, config.weight_decay, named), torch.optim.AdamW,
                                     group, zero_stage=zero, bucket_numel=par.options.zero_bucket_numel,
                                     lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                                     foreach=False)
        # stage 1 checks the full gradients (reduced at the step), stage 2 the shards it kept
        grad_params = [p if zero == 1 else optimizer.shard(p) for p in optimizer.params]
        if zero == 2:  # its hooks keep only the shard of each gradient: the tied sum is of shards
            pipe.gradient_holder = optimizer.shard
    else:
        optimizer = build_optimizer(pipe, config, named=named)
        grad_params = params

    def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:  # (parameter, the gradient this rank holds)
        if zero:
            optimizer.reduce_gradients()  # ZeRO-1: once per step into the shards (ZeRO-2: in backward)
            return [(p, optimizer.shard(p).grad) for p in optimizer.params
                    if optimizer.shard(p).grad is not None]
        return [(p, p.grad) for p in params if p.grad is not None]

    def finish() -> None:  # every stage's gradients, once per step, over the data-parallel replicas
        if not zero and group is not None:
            reduce_gradients_(params, policy, group=group)
        if tp is not None and par.options.sequence_parallel:
            for p, g in pairs():  # a replicated parameter's shard: the same rows on every tp rank
                if getattr(p, "sequence_parallel", False):
                    ops.all_reduce(g, group=tp)

    def clip_fn(_: object) -> torch.Tensor:
        held = pairs()
        counted = [g for p, g in held if not pipe.is_tied_copy(p) and (id(p) in sharded or first_tp)]
        sq = sum_of_squares(counted, device=device)
        for g in (pipe.pp_group, tp, group if zero else None):
            if g is not None:
                ops.all_reduce(sq, group=g)
        return scale_to_max_norm_([g for _, g in held], sq.sqrt(), config.grad_clip)

    needs_finish = group is not None or (tp is not None and par.options.sequence_parallel)
    return OptimizerSetup(optimizer=optimizer, grad_params=grad_params,
                          clip_fn=None if config.grad_clip is None else clip_fn,
                          finish_gradients=finish if needs_finish else None)

def _tensor_parallel_optimizer(par: Parallelized, config: OptimConfig) -> OptimizerSetup:
    """ZeRO-0/1/2 over the TP shards: the norm counts each element of the model once, and the
    sequence-parallel gradients are summed over ``tp`` (both need the ``tp`` group)."""
    from refimpl.parallel.tensor_parallel import (
        allreduce_sequence_parallel_grads,
        clip_grad_norm_tensor_parallel_,
        tensor_parallel_sharded,
    )

    model, tp, zero_stage = par.model, par.tp_group, par.options.zero_stage
    sharded = tensor_parallel_sharded(model)
    device = next(iter(model.parameters())).device
    if zero_stage == 0:
        optimizer = build_optimizer(model, config)
        params = list(model.parameters())

        def grads() -> list[tuple[torch.Tensor, torch.Tensor]]:  # (parameter, its gradient)
            return [(p, p.grad) for p in params if p.grad is not None]

        dp_group = None
        finish = lambda: allreduce_sequence_parallel_grads(model, tp)  # noqa: E731
        grad_params = params
    else:
        from refimpl.parallel.zero import ShardedOptimizer

        optimizer = ShardedOptimizer(param_groups(model, config.weight_decay), torch.optim.AdamW,
                                     par.group, zero_stage=zero_stage,
                                     bucket_numel=par.options.zero_bucket_numel, lr=config.lr,
                                     betas=(config.beta1, config.beta2), eps=config.eps, foreach=False)

        def grads() -> list[tuple[torch.Tensor, torch.Tensor]]:
            optimizer.reduce_gradients()  # ZeRO-1: into the shards (ZeRO-2: done in backward)
            return [(p, optimizer.shard(p).grad) for p in optimizer.params
                    if optimizer.shard(p).grad is not None]

        def finish() -> None:  # the shards of a replicated parameter are the same rows on every TP rank
            for p, g in grads():
                if getattr(p, "sequence_parallel", False):
                    ops.all_reduce(g, group=tp)

        dp_group = par.group
        grad_params = (optimizer.params if zero_stage == 1
                       else [optimizer.shard(p) for p in optimizer.params])

    def clip_fn(_: object) -> torch.Tensor:
        pairs = grads()
        flags = [id(p) in sharded for p, _ in pairs]
        return clip_grad_norm_tensor_parallel_([g for _, g in pairs], flags, config.grad_clip,
                                               tp_group=tp, dp_group=dp_group, device=device)

    return OptimizerSetup(optimizer=optimizer, grad_params=list(grad_params),
                          clip_fn=None if config.grad_clip is None else clip_fn,
                          finish_gradients=finish if par.options.sequence_parallel else None)
