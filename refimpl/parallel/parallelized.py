"""What ``refimpl.parallel.parallelize.parallelize`` gives (chapter 12): the parallelized model
(``Parallelized``; what it takes is a ``refimpl.config.ParallelConfig``), which holds each
parameter's placement (``refimpl.parallel.placements``, recorded by ``record_parallel_placements``)
and builds the optimizer from them (``refimpl.parallel.optimizer_setup.build_optimizer_setup``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from refimpl.config import OptimConfig, ParallelConfig
from refimpl.distributed.group_info import group_rank_size
from refimpl.distributed.placement import Box, module_shards
from refimpl.nn.loss import lm_loss
from refimpl.parallel.data_parallel import DataParallelBucket
from refimpl.parallel.declarations import moe_layers
from refimpl.parallel.optimizer_setup import OptimizerInputs, OptimizerSetup, build_optimizer_setup
from refimpl.parallel.placements import DP, DP_REPLICATE, DP_SHARD, EDP, EP, Placement, record_placements
from refimpl.precision import MixedPrecision

if TYPE_CHECKING:
    from refimpl.parallel.context_parallel.context_parallel import Method
    from refimpl.parallel.context_parallel.sequence_layout import Layout
    from refimpl.parallel.pipeline_parallel import PipelineModule
    from refimpl.parallel.zero import FullyShardedDataParallel

__all__ = ["Parallelized", "held_parameters", "record_parallel_placements"]


@dataclass(kw_only=True)
class Parallelized:
    """What ``parallelize`` made of a model.

    ``model`` is the plain model (under ZeRO-3 its parameters are shards), ``forward`` what a batch goes
    through, ``config`` the ``refimpl.config.ParallelConfig`` it applied (its degrees those of the
    layout), ``state_module`` what a checkpoint saves (the ZeRO-3 wrapper), ``sync`` the wrapper whose
    ``no_sync()``/``finish_gradient_synchronization()`` the step calls (ZeRO-0 with several ranks, else
    None), ``group`` the ``dp x cp`` group gradients are averaged over (None: one process), ``applied``
    the steps of ``ORDER`` that did something, in order, ``tp_group`` the tensor-parallel group (None:
    no tensor parallelism), ``cp_group`` the context-parallel group (None: no context parallelism),
    ``pipeline`` this rank's stages (None: no pipeline parallelism; then ``model`` and ``state_module`` are
    it too), ``placements`` each held parameter's ``refimpl.parallel.placements.Placement`` under the
    plain GPT's name (``record_parallel_placements``); under expert parallelism (chapter 09)
    ``ep_group`` and ``edp_group`` (the expert-parallel and expert-data-parallel groups) and ``experts`` the
    names of the expert tensors (placed over the ``ep`` and ``edp`` groups; empty without expert
    parallelism).
    """

    model: nn.Module
    forward: nn.Module
    state_module: nn.Module
    mp: MixedPrecision
    config: ParallelConfig
    sync: DataParallelBucket | None = None
    group: dist.ProcessGroup | None = None
    applied: list[str] = field(default_factory=list)
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    shard_group: dist.ProcessGroup | None = None
    replicate_group: dist.ProcessGroup | None = None
    pipeline: PipelineModule | None = None
    fsdp_stages: list[FullyShardedDataParallel] = field(default_factory=list)  # ZeRO-3 under pp: per stage
    placements: dict[str, Placement] = field(default_factory=dict)
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    experts: list[str] = field(default_factory=list)

    def split_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tokens`` ``[b, s]`` (inputs or labels) along the sequence, ``[b, s/cp]``,
        by the layout its attention was built for; ``tokens`` itself without context parallelism."""
        if self.cp_group is None:
            return tokens
        from refimpl.parallel.context_parallel import split_for_context_parallel

        method, layout = context_parallel_options(self.config)
        return split_for_context_parallel(tokens, cp_group=self.cp_group, method=method, layout=layout)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of this rank's tokens: ``refimpl.models.lm_loss``, or under tensor
        parallelism the vocab-parallel loss on the logits shard (equal on the ranks of a TP group); an MoE
        model adds its blocks' balance losses of the forward that gave ``logits``, and counts their load
        (``refimpl.moe_balance.record_micro_batch``; call once per micro-batch). Under pipeline
        parallelism the executor takes each stage's balance losses itself (``stage_balance_loss``)."""
        if self.tp_group is None:
            loss = lm_loss(logits, labels)
        else:
            from refimpl.parallel.tensor_parallel import tp_lm_loss

            loss = tp_lm_loss(logits, labels, tp_group=self.tp_group, vocab_size=self.vocab_size(logits))
        if self.pipeline is None and moe_layers(self.model):
            from refimpl.moe_balance import record_micro_batch

            aux = record_micro_batch(self.model)
            if aux is not None:
                loss = loss + aux
        return loss

    def vocab_size(self, logits_shard: torch.Tensor) -> int:
        """The vocabulary the logits shard ``[..., V/t]`` is part of: the model's ``config.vocab_size``
        (ours, Hugging Face's), else ``t`` times the shard's width (a vocabulary padded to divide by ``t``
        needs the model to say its size: ``config.vocab_size``)."""
        declared = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if declared is not None:
            return declared
        return logits_shard.shape[-1] * group_rank_size(self.tp_group)[1]

    @staticmethod
    def stage_balance_loss(stage: nn.Module, *, micro_batches: int) -> torch.Tensor | None:
        """Under pipeline parallelism, a stage's own loss after its forward: its MoE blocks' balance losses
        (counted, ``refimpl.moe_balance.record_micro_batch``) divided by ``micro_batches`` like the
        micro-batch's language-model loss; None for a stage without MoE blocks. The pipeline executor adds
        it to the last stage's loss and backpropagates it in the other stages' backward."""
        from refimpl.moe_balance import record_micro_batch

        aux = record_micro_batch(stage)
        return None if aux is None else aux / micro_batches

    def build_optimizer(self, config: OptimConfig) -> OptimizerSetup:
        """AdamW over this rank's parameters, with what the checked step needs for this layout
        (``refimpl.parallel.optimizer_setup.build_optimizer_setup``)."""
        pipe, zero = self.pipeline, self.config.zero_stage
        if pipe is not None and self.group is None:
            zero = 0  # one data-parallel rank: nothing to shard the optimizer over
        named: list[tuple[str, nn.Parameter]] | None
        if pipe is not None:
            named = pipe.named_parameters_full()  # weight decay by the GPT's names (a tied copy: embedding)
        else:
            named = None if zero == 3 else list(self.model.named_parameters())
        setup = build_optimizer_setup(OptimizerInputs(
            module=self.state_module if zero == 3 else self.model, named=named,
            held=held_parameters(self), placements=self.placements, groups=self.groups(),
            zero_stage=zero, zero_bucket_numel=self.config.zero_bucket_numel, policy=self.mp.policy,
            average_in_finish=pipe is not None and zero == 0 and self.group is not None,
            experts=tuple(self.experts),
            num_replicas=1 if self.group is None else group_rank_size(self.group)[1]), config)
        if pipe is not None and zero == 2:  # ZeRO-2's hooks keep only each gradient's shard: the tied
            from refimpl.parallel.zero import ShardedOptimizer

            optimizer = setup.optimizer
            assert isinstance(optimizer, ShardedOptimizer)  # build_optimizer_setup's at ZeRO-1/2
            pipe.gradient_holder = optimizer.shard  # embedding's two ends are summed as shards
            if pipe.store is not None:  # zbh1: a weight's gradient is complete after its W action
                pipe.store.after_flush = optimizer.reduce_gradients_now
        return setup

    def groups(self) -> dict[str, dist.ProcessGroup | None]:
        """The process group of each axis a placement names (None: an axis of one rank)."""
        return {"pp": None if self.pipeline is None else self.pipeline.pp_group, "tp": self.tp_group,
                DP: self.group, DP_SHARD: self.shard_group, DP_REPLICATE: self.replicate_group,
                EP: self.ep_group, EDP: self.edp_group}


def context_parallel_options(config: ParallelConfig) -> tuple[Method, Layout | None]:
    """The config's context-parallel method and layout, as the names they are (``ParallelConfig``
    refuses any other)."""
    return cast("Method", config.cp_method), cast("Layout | None", config.cp_layout)


def held_parameters(done: Parallelized) -> list[tuple[str, nn.Parameter]]:
    """The parameters this rank holds (and steps) under the plain GPT's names, a tied one once, in the
    modules' order: the stages' (``refimpl.parallel.pipeline_parallel.PipelineModule.
    named_parameters_full``), ZeRO-3's row shards, or the model's own."""
    if done.pipeline is not None:
        return done.pipeline.named_parameters_full()
    if done.config.zero_stage == 3:
        return [(n, s.tensor) for n, s in module_shards(done.state_module).items()
                if isinstance(s.tensor, nn.Parameter)]
    return list(done.model.named_parameters())


def _zero3_inner_boxes(done: Parallelized) -> dict[str, Box] | None:
    """Under ZeRO-3 the box each held tensor had before the wrapper sharded its rows (a tensor-parallel
    block, else the whole tensor), by the plain GPT's name; None without ZeRO-3."""
    if done.fsdp_stages:  # pipeline stages, each sharded in place
        from refimpl.parallel.pipeline_parallel.stage import as_stage

        return {as_stage(f.module).full_name(n): b for f in done.fsdp_stages
                for n, b in f.inner_boxes.items()}
    if done.config.zero_stage == 3 and done.pipeline is None:
        from refimpl.parallel.zero import FullyShardedDataParallel

        fsdp = done.state_module
        assert isinstance(fsdp, FullyShardedDataParallel)  # parallelize's wrapper at ZeRO-3
        return fsdp.inner_boxes
    return None


def record_parallel_placements(done: Parallelized, *, replicas: int) -> dict[str, Placement]:
    """Each held parameter's placement, from the modules' declarations, composed in ``ORDER``: tensor
    parallel (a shard's box is not the whole tensor; the sequence-parallel names are summed over tp),
    the pipeline split (a stage's tensors are its own; the last stage's copy of a tied embedding is not
    primary), then data parallelism over ``dp x cp`` (ZeRO-0-2: replicated, averaged over the ``replicas``
    when there are several; ZeRO-3: the wrapper's row shards, their TP roles read from the blocks it
    sharded, since a row shard of a LayerNorm is no TP shard; under HSDP sharded over ``dp_shard`` and
    replicated over ``dp_replicate``)."""
    from refimpl.parallel.tensor_parallel import sequence_parallel_names

    pipe, tp = done.pipeline, done.tp_group is not None
    if done.config.zero_stage == 3 and pipe is None:  # the wrapper's boxes (its modules hold row shards)
        declared = module_shards(done.state_module)
    else:  # the boxes the modules declare (ZeRO-3's stages: the wrapper's, declared on each stage)
        declared = module_shards(done.model if pipe is None else pipe)
    boxes = {n: declared[n].box for n, _ in held_parameters(done)}
    if pipe is None:
        sp = sequence_parallel_names(done.model)
        tied = None
    else:
        from refimpl.parallel.pipeline_parallel.stage import as_stage

        sp = [as_stage(stage).full_name(n) for stage in pipe.stages.values()
              for n in sequence_parallel_names(stage)]
        tied = pipe.tied_copy_name()
    inner = _zero3_inner_boxes(done)
    if inner is None:
        experts = set(done.experts)
        placed = record_placements({n: b for n, b in boxes.items() if n not in experts}, tp=tp,
                                   sequence_parallel=sp, pp=pipe is not None, tied_copy=tied)
        out = {n: p.along(DP, sharded=False, reduced=replicas > 1) for n, p in placed.items()}
        for n in experts:  # split over ep, whole on each tp rank, averaged over the expert-data-parallel ones
            p = Placement(box=boxes[n], sharded_over=(EP,))
            if tp:  # under sequence parallelism each tp rank's experts saw other tokens: summed over tp
                p = p.along("tp", sharded=False, reduced=n in sp)
            if pipe is not None:  # a stage's own, like its dense tensors
                p = p.along("pp", sharded=True)
            out[n] = p.along(EDP, sharded=False, reduced=True)
        return {n: out[n] for n in boxes}
    experts = set(done.experts)  # ZeRO-3 shards them over their own group (parallelize's _expert_units)
    before = record_placements({n: inner[n] for n in boxes if n not in experts}, tp=tp, sequence_parallel=sp,
                               pp=pipe is not None, tied_copy=tied)
    placed = {n: replace(p, box=boxes[n]) for n, p in before.items()}
    if done.replicate_group is not None:  # HSDP
        return {n: p.along(DP_SHARD, sharded=True, reduced=True).along(DP_REPLICATE, sharded=False,
                                                                          reduced=True)
                for n, p in placed.items()}
    out = {n: p.along(DP, sharded=True, reduced=True) for n, p in placed.items()}
    for n in experts:  # the ep rank's experts, their rows sharded over the expert-data-parallel group
        p = Placement(box=boxes[n], sharded_over=(EP,))
        if tp:
            p = p.along("tp", sharded=False, reduced=n in sp)
        if pipe is not None:
            p = p.along("pp", sharded=True)
        out[n] = p.along(EDP, sharded=True, reduced=True)
    return {n: out[n] for n in boxes}
