"""A rank's part of a pipeline-parallel model, as one module: ``PipelineModule`` (chapter 08).

``refimpl.parallel.parallelize.parallelize`` cuts the model (its step 3) into ``pp x v`` stages and
keeps this rank's (the model's ``pipeline_stages`` declaration; the GPT's: ``refimpl/models/gpt_stages.py``)
in a ``PipelineModule``. One call of ``PipelineModule.step`` is a whole step's forward and backward:
the rank's action list of the schedule (``refimpl.parallel.pipeline_parallel.schedules.
build_schedule``) over ``m`` micro-batches (``refimpl.parallel.pipeline_parallel.executor.
run_schedule``), then the tied-embedding gradient exchange, then the step loss sent from the last stage to
every rank of the pipeline. What the data-parallel ranks do next (the gradient average over ``dp``, after
the last backward of the step) is the caller's: chapter 12's rule that every technique reduces over its own
group.

Checkpoints see the whole model's names: ``PipelineModule.local_shards`` declares each stage parameter
under its name in the model (the stage's ``full_name``: ``layers.5.mlp...``), so a checkpoint written at ``pp
= 2`` loads at ``pp = 1`` or ``4`` (chapter 11's boxes; a tied embedding's two copies are two replicas of one
tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops
from refimpl.comm.device_clock import Stamp
from refimpl.distributed.placement import LocalShard, module_shards
from refimpl.parallel.declarations import declared
from refimpl.parallel.pipeline_parallel.executor import PipelineEvent, run_schedule
from refimpl.parallel.pipeline_parallel.pipeline_communications import sync_tied_embeddings
from refimpl.parallel.pipeline_parallel.schedules import (
    SPLIT_BACKWARD,
    Placement,
    build_schedule,
    schedule_placement,
    stage_rank,
)
from refimpl.parallel.pipeline_parallel.stage import as_stage
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore, defer_weight_gradients

__all__ = ["PipelineModule"]


class PipelineModule(nn.Module):
    """The stages pipeline rank ``pp_rank`` of ``pp_size`` holds of ``model``, run by ``schedule``."""

    def __init__(self, model: nn.Module, *, pp_group: dist.ProcessGroup | None, pp_rank: int, pp_size: int,
                 schedule: str = "1f1b", virtual_stages: int = 1, balance: str = "layers",
                 sequence_split: int = 1) -> None:
        super().__init__()
        self.sequence_split = sequence_split  # tensor-parallel ranks the boundary activations' s splits over
        self.schedule, self.virtual_stages = schedule, virtual_stages
        self.config = getattr(model, "config", None)  # the model's own, when it has one
        self.pp_group, self.pp_rank, self.pp_size = pp_group, pp_rank, pp_size
        build_schedule(schedule, pp_size=pp_size, num_microbatches=pp_size, virtual_stages=virtual_stages)
        self.placement = schedule_placement(schedule)
        # ZB-V's V: the model is asked for the stages of rank r and 2 pp - 1 - r (a declaration that
        # takes placement=; the loop placement is asked as before, so models without it keep working)
        found = _declared_stages(model, pp_rank=pp_rank, pp_size=pp_size, virtual_stages=virtual_stages,
                                 balance=balance, placement=self.placement)
        self.stage_ids = sorted(found)
        self.stages = nn.ModuleDict({str(s): found[s] for s in self.stage_ids})
        self.store = WeightGradStore() if schedule in SPLIT_BACKWARD else None
        if self.store is not None:
            for stage in found.values():
                defer_weight_gradients(stage, self.store)
        self.num_stages = pp_size * virtual_stages
        first, last = (stage_rank(s, pp_size=pp_size, placement=self.placement)
                       for s in (0, self.num_stages - 1))  # one rank under ZB-V's V: nothing to exchange
        self.tied_peer: int | None = None  # the rank at the other end of a tied embedding
        ends = [s for s in (0, self.num_stages - 1) if s in found and found[s].tied_weight() is not None]
        if ends and first != last:
            self.tied_peer = last if pp_rank == first else first
        self.last_events: list[PipelineEvent] = []
        # where a parameter's gradient lives after backward: itself, or under ZeRO-2 (whose hooks cut each
        # gradient into its dp shard inside backward) the optimizer's shard (parallelize sets it)
        self.gradient_holder: Callable[[torch.Tensor], torch.Tensor] = lambda param: param
        # what runs once the schedule's backwards are done, before the tied-embedding sum: under ZeRO-3 the
        # stages' gradient reduce-scatter, once per step (parallelize sets it)
        self.after_backward: Callable[[], None] | None = None

    def tied_weight(self) -> torch.Tensor | None:
        """This rank's end of a tied embedding that another rank also holds (None otherwise)."""
        if self.tied_peer is None:
            return None
        end = "0" if 0 in self.stage_ids else str(self.num_stages - 1)
        return as_stage(self.stages[end]).tied_weight()

    def is_tied_copy(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is the last stage's copy of the tied embedding (the first stage counts it)."""
        end = str(self.num_stages - 1)
        last = as_stage(self.stages[end]) if end in self.stages else None
        return last is not None and last.tied_copy and param is last.tied_weight()

    def tied_copy_name(self) -> str | None:
        """The whole model's name of the tied tensor whose copy this rank's last stage holds (None when
        this rank holds no copy: the first stage's end is the primary)."""
        weight = self.tied_weight()
        if weight is None or 0 in self.stage_ids:
            return None
        last = self.stages[str(self.num_stages - 1)]
        return next(as_stage(last).full_name(n) for n, p in last.named_parameters() if p is weight)

    def named_parameters_full(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the whole model (the tied copy as the original; a
        tensor two of its stages share, ZB-V's tied embedding on rank 0, once, under its first name)."""
        out, seen = [], set()
        for stage in self.stages.values():
            params = dict(stage.named_parameters())
            out += [(as_stage(stage).full_name(local), p) for local, p in params.items() if id(p) not in seen]
            seen |= {id(p) for p in params.values()}
        return out

    def local_shards(self) -> dict[str, LocalShard]:
        """What this rank holds of each tensor of its stages (whole, or the box a tensor-parallel layer
        declares), under its name in the whole model."""
        out: dict[str, LocalShard] = {}
        seen: set[int] = set()  # a tensor two stages share (ZB-V's tied embedding) once: module_shards' rule
        for stage in self.stages.values():
            for name, shard in module_shards(stage).items():
                if id(shard.tensor) not in seen:
                    out.setdefault(as_stage(stage).full_name(name), shard)
                seen.add(id(shard.tensor))
        return out

    def forward(self, *args: object) -> None:
        raise RuntimeError("a pipeline stage is not called on a batch: use PipelineModule.step(inputs, "
                           "labels, ...), which runs the schedule's forwards and backwards")

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, *, num_microbatches: int,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
             clock: Callable[[], Stamp] | None = None,
             aux_loss: Callable[[nn.Module], torch.Tensor | None] | None = None) -> torch.Tensor:
        """Forward and backward of ``inputs``/``labels`` (``[B, s]``, this data-parallel rank's batch) in
        ``num_microbatches`` micro-batches; returns the step's loss (the sum of the micro-batch losses) on
        every pipeline rank. Gradients accumulate in the stages' parameters (the tied copies summed).
        ``clock``: the executor's clock; ``aux_loss(stage)``: a stage's own loss after its forward (an MoE
        stage's balance losses; ``.executor.run_schedule``)."""
        m = num_microbatches
        actions = build_schedule(self.schedule, pp_size=self.pp_size, num_microbatches=m,
                                 virtual_stages=self.virtual_stages)[self.pp_rank]
        if inputs.shape[0] % m:
            raise ValueError(f"{inputs.shape[0]} sequences do not split into {m} micro-batches")
        micro = inputs.shape[0] // m
        # [b, s, h] at every stage boundary ([b, s/t, h] under sequence parallelism)
        hidden = as_stage(self.stages[str(self.stage_ids[0])]).hidden_size
        shape = (micro, inputs.shape[1] // self.sequence_split, hidden)
        self.last_events = []
        loss = run_schedule(actions, stages={s: self.stages[str(s)] for s in self.stage_ids},
                            num_stages=self.num_stages,
                            pp_group=self.pp_group, pp_size=self.pp_size, inputs=inputs.chunk(m),
                            labels=labels.chunk(m), loss_fn=loss_fn, activation_shape=shape,
                            activation_dtype=torch.float32, store=self.store, scale_loss=scale_loss,
                            events=self.last_events, clock=clock, aux_loss=aux_loss,
                            placement=self.placement)
        if self.after_backward is not None:
            self.after_backward()
        weight = self.tied_weight()
        if weight is not None:
            assert self.tied_peer is not None  # tied_weight: None without a peer
            # the two ends hold the same rows of their gradients (whole, or the same ZeRO-2 shard)
            sync_tied_embeddings(self.gradient_holder(weight), peer=self.tied_peer, group=self.pp_group)
        ops.all_reduce(loss, group=self.pp_group)  # only the last stage's rank holds it: a sum with zeros
        return loss


def _declared_stages(model: nn.Module, *, pp_rank: int, pp_size: int, virtual_stages: int, balance: str,
                     placement: Placement) -> dict[int, Any]:
    """The model's declared ``pipeline_stages`` for this rank. Under the V (ZB-V) the declaration must take
    ``placement=`` and return stages ``r`` and ``2 pp - 1 - r``: a user's model that does not is refused by
    name, not left to a TypeError or to stages on the wrong ranks."""
    declare = declared(model, "pipeline_stages")
    if placement == "loop":
        return declare(pp_rank=pp_rank, pp_size=pp_size, virtual_stages=virtual_stages, balance=balance)
    name = type(model).__name__
    try:
        found = declare(pp_rank=pp_rank, pp_size=pp_size, virtual_stages=virtual_stages, balance=balance,
                        placement=placement)
    except TypeError as exc:
        if "placement" not in str(exc):
            raise
        raise ValueError(f"{name}.pipeline_stages takes no placement=: the {placement!r} placement of "
                         "--pp-schedule zbv needs it (rank r holds stages r and 2 pp - 1 - r); use another "
                         "schedule or declare it") from exc
    want = sorted(s for s in range(pp_size * virtual_stages)
                  if stage_rank(s, pp_size=pp_size, placement=placement) == pp_rank)
    if sorted(found) != want:
        raise ValueError(f"{name}.pipeline_stages gave pp rank {pp_rank} the stages {sorted(found)}; the "
                         f"{placement!r} placement puts {want} there")
    return found
