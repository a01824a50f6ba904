"""What a step of an MoE model counts and does once per optimizer step (chapter 09): each block's load per
expert, its dropped assignments and its balance loss, summed over the step's micro-batches and ranks, and
DeepSeek-V3's auxiliary-loss-free bias update.

* ``record_micro_batch`` (called by the model's loss, once per micro-batch, after its forward): the
  blocks' balance losses summed (what the loss adds, in the graph), and each block's counters: the
  assignments its router made per expert (``tokens_per_expert``, before capacity), the dropped ones and
  the balance loss (detached). Read here and not in the forward, because activation checkpointing runs a
  block's forward a second time in backward. The counters are device tensors, added to on the device:
  nothing here reads a value on the host (a ``.cpu()`` and a ``float()`` per block and micro-batch were
  two device-to-host syncs each; ``refimpl.distributed.host_syncs``), the step's one read
  is ``finish_step``'s.
* ``finish_step`` (once per step, before the optimizer step): one all-reduce of every block's
  counters over the ``dp x cp`` group (the ranks that saw different tokens; a tensor-parallel group saw the
  same ones), so every rank knows the global batch's load ``c_i``. With ``moe_load_balance = "bias"`` each
  router's expert bias moves by DeepSeek-V3's rule, ``b_i += u sign(mean_j c_j - c_i)`` (section 2.1.2),
  the same on every rank (from the reduced counters still on the device). Returns the step's figures for
  metrics.jsonl: the balance loss (the mean over micro-batches and ranks, summed over blocks: the part of
  the loss it is), the most and the mean assignments per expert (over blocks and experts: ``mean = k T /
  E`` for ``T`` tokens), and the dropped fraction of all assignments. Under pipeline parallelism a rank
  holds its stages' blocks only: the figures then sum (and take the largest load) over the ``pp`` group
  too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size
from refimpl.parallel.declarations import moe_layers

if TYPE_CHECKING:
    from refimpl.parallel.expert_parallel import MoE

__all__ = ["ExpertLoad", "MoECounters", "finish_step", "record_micro_batch"]


@dataclass(kw_only=True)
class MoECounters:
    """One block's sums over the step's micro-batches on this rank, float64 on the block's device:
    ``load [E]`` (assignments routed to each expert, before capacity) and ``scalars [3]``: the
    assignments dropped by capacity, all assignments (``T k`` per forward) and the balance losses
    (detached)."""

    load: torch.Tensor
    scalars: torch.Tensor

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device) -> MoECounters:
        return cls(load=torch.zeros(num_experts, dtype=torch.float64, device=device),
                   scalars=torch.zeros(3, dtype=torch.float64, device=device))

    def add(self, load: torch.Tensor, dropped: torch.Tensor, assignments: int, aux: torch.Tensor) -> None:
        """One forward's figures, added on the device (no host read)."""
        self.load += load.detach()
        self.scalars[0] += dropped
        self.scalars[1] += assignments
        self.scalars[2] += aux.detach()


class _BalancedLayer(Protocol):
    """What this module reads and sets of an MoE layer (``refimpl.models.moe.MoEMLP``): its ``moe`` (the
    routing of the last forward), balance loss, counters and bias update rate (None: no bias update)."""

    moe: MoE
    aux_loss: torch.Tensor | None
    counters: MoECounters | None
    bias_update_rate: float | None


def _blocks(model: nn.Module) -> list[_BalancedLayer]:
    """The MoE layers of ``model`` (``moe_layers``), read as the GPT's ``MoEMLP`` s are."""
    return cast("list[_BalancedLayer]", moe_layers(model))


def record_micro_batch(model: nn.Module) -> torch.Tensor | None:
    """The sum of the blocks' balance losses of the last forward (None: a dense model), each block's
    counters advanced by it (module docstring)."""
    blocks = _blocks(model)
    losses = []
    for block in blocks:
        moe = block.moe
        if block.aux_loss is None or moe.tokens_per_expert is None:
            continue
        routing = moe.routing
        assert routing is not None  # the forward sets it with tokens_per_expert
        if block.counters is None:
            block.counters = MoECounters.zeros(moe.num_experts, moe.tokens_per_expert.device)
        block.counters.add(moe.tokens_per_expert, routing.dropped, routing.expert_ids.numel(),
                           block.aux_loss)
        losses.append(block.aux_loss)
    return torch.stack(losses).sum() if losses else None


@torch.no_grad()
def finish_step(model: nn.Module, group: dist.ProcessGroup | None, *, micro_batches: int,
                device: torch.device, pp_group: dist.ProcessGroup | None = None,
                sp_group: dist.ProcessGroup | None = None) -> dict[str, float] | None:
    """Sum the blocks' counters over ``group`` (``dp x cp``; None: one rank), update the expert biases,
    reset the counters and return the step's figures (module docstring); None for a dense model. Under
    pipeline parallelism ``model`` holds this rank's stages' blocks only: the figures then combine every
    stage's over ``pp_group`` (each rank joins, with or without MoE blocks of its own). Under sequence
    parallelism (``sp_group``, the tp group) each tp rank routed other tokens: the load is summed over it
    too (the balance loss, the same on the tp ranks, is not)."""
    blocks = [b for b in _blocks(model) if b.counters is not None]
    pp = group_rank_size(pp_group)[1] if pp_group is not None else 1
    if not blocks and pp == 1:
        return None
    n = group_rank_size(group)[1] if group is not None else 1
    # this rank's blocks' sums: balance loss, dropped, assignments, load summed and its element count
    sums = torch.zeros(5, dtype=torch.float64)
    most = torch.zeros(1, dtype=torch.float64)  # the largest load of an expert of a block here
    if blocks:
        counters = [b.counters for b in blocks if b.counters is not None]  # every block's (blocks: counted)
        loads = torch.stack([c.load for c in counters])  # [L, E]
        scalars = torch.stack([c.scalars for c in counters])  # [L, 3]: dropped, assignments, aux
        packed = torch.cat([loads.flatten(), scalars.flatten()]).to(device)
        if n > 1:
            ops.all_reduce(packed, group=group)  # the global batch's load: one collective for every block
        tp = group_rank_size(sp_group)[1] if sp_group is not None else 1
        if tp > 1:  # each tp rank's s/t tokens; the balance losses (equal there) averaged back below
            ops.all_reduce(packed, group=sp_group)
        for block, load in zip(blocks, packed[: loads.numel()].view_as(loads), strict=True):
            if block.bias_update_rate is not None:  # from the device's copy: no host-to-device copy
                block.moe.update_expert_bias(block.bias_update_rate, load=load)
            block.counters = None
        packed = packed.cpu()  # the step's one host read
        loads = packed[: loads.numel()].view_as(loads)
        dropped, assignments, aux = packed[loads.numel():].view(len(blocks), 3).unbind(1)
        aux = aux / tp
        sums = torch.stack([aux.sum(), dropped.sum(), assignments.sum(), loads.sum(),
                            torch.tensor(float(loads.numel()), dtype=torch.float64)])
        most = loads.max().reshape(1)
    if pp > 1:  # every stage's blocks: the sums summed, the largest load the largest
        sums, most = sums.to(device), most.to(device)
        ops.all_reduce(sums, group=pp_group)
        ops.all_reduce(most, op=dist.ReduceOp.MAX, group=pp_group)
        sums, most = sums.cpu(), most.cpu()
    aux, dropped, assignments, load, elements = sums.tolist()
    if not elements:  # no stage of the pipeline has MoE blocks
        return None
    return {"moe_aux_loss": aux / (n * micro_batches),
            "moe_tokens_per_expert_max": float(most),
            "moe_tokens_per_expert_mean": load / elements,
            "moe_dropped_fraction": dropped / assignments}


@dataclass(kw_only=True)
class ExpertLoad:
    """An MoE run's once-per-step balance (chapter 09), what ``finish_step`` needs bound once: the model
    (under pipeline parallelism this rank's stages), the ``dp x cp`` group, the device, the ``pp`` group
    and sequence parallelism's tp group (None: none). ``figures``: the last step's (metrics.jsonl)."""

    model: nn.Module
    group: dist.ProcessGroup | None
    device: torch.device
    pp_group: dist.ProcessGroup | None = None
    sp_group: dist.ProcessGroup | None = None
    figures: dict[str, float] | None = None

    def finish_step(self, micro_batches: int) -> dict[str, float] | None:
        """``finish_step`` over the step's ``micro_batches``: the load summed, the biases moved, the
        figures kept in ``figures`` and returned."""
        self.figures = finish_step(self.model, self.group, micro_batches=micro_batches, device=self.device,
                                   pp_group=self.pp_group, sp_group=self.sp_group)
        return self.figures
