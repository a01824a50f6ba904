"""The gradients a step hands to the optimizer, as boxes of the plain GPT's tensors: what a probe passed to
:func:`refimpl.train.train` (``gradient_probe``) receives, after the step's reductions and before the
loss scaler's check, clipping and AdamW.

Why a probe: AdamW divides each gradient by the root of its second moment and clipping rescales the whole
gradient, so a gradient that is a constant factor off (a pipeline loss not divided by its ``m``
micro-batches, expert gradients counted twice: pytorch/pytorch#160285) trains with the same losses. The
equivalence tests compare these gradients with one device's (chapters 06-10).

Each rank says what it holds, as the checkpoint does (chapter 11): ``{name: LocalShard(gradient, box)}``,
``name`` the plain GPT's, ``box`` the part of the global tensor (a tensor-parallel block, a ZeRO row
shard of it, a whole replica; a tied embedding on both pipeline ends under the embedding's name). Where
the gradient lives:

* plain, DP, tensor, context and pipeline parallelism (ZeRO-0), ZeRO-3: the ``.grad`` of the tensor the
  rank holds (ZeRO-3: of its row shard);
* ZeRO-2: the ``.grad`` of the optimizer's row shard (the full gradient was freed in backward);
* ZeRO-1: the full local gradient is averaged over the data-parallel group only inside the optimizer's
  step, so here a copy of it is averaged (``all_reduce`` then ``/ N``, the arithmetic of the step's
  reduce-scatter mean, untraced so that ``metrics.jsonl``'s bytes stay the step's; an expert's over its
  expert-data-parallel group, divided by ``dp x cp``; under sequence parallelism then summed over tp, as
  ``finish_gradients`` sums the step's shards) and the state the step reads is left as it was.

Under fp16 the gradients are divided by the loss scale (a power of two: exact), as ``unscale_`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from refimpl.checkpoint import parameter_shards
from refimpl.distributed.group_info import group_rank_size
from refimpl.distributed.placement import LocalShard

if TYPE_CHECKING:
    from refimpl.train.setup import _Setup


@torch.no_grad()
def gradient_shards(setup: _Setup) -> dict[str, LocalShard]:
    """``{plain GPT name: LocalShard(float32 gradient, its box in the global tensor)}`` of every parameter
    this rank holds a gradient of; a collective under ZeRO-1 (every rank of the group must call it)."""
    held = {name.removeprefix("model/"): s for name, s in parameter_shards(setup.state_module).items()}
    where = {s.tensor: (name, s.box) for name, s in held.items()}  # by tensor: its name and box
    scale = setup.mp.scale
    optimizer = setup.optimizer
    out: dict[str, LocalShard] = {}
    declare = getattr(optimizer, "local_state_shards", None)
    if not callable(declare):  # the rank's tensors carry their own gradients
        for name, s in held.items():
            if s.tensor.is_leaf and s.tensor.requires_grad and s.tensor.grad is not None:
                out[name] = LocalShard(s.tensor.grad.float() / scale, s.box)
        return out
    for param, stepped, box in declare():  # ZeRO-1/2: the optimizer steps a row box of each local tensor
        name, param_box = where[param]
        if optimizer.zero_stage == 2:
            if stepped.grad is not None:
                out[name] = LocalShard(stepped.grad.float() / scale, param_box.within(box))
        elif param.grad is not None:
            mean = param.grad.float().clone()
            group, divide = optimizer.reduction(param)  # experts: summed over edp, divided by dp x cp
            size = group_rank_size(group)[1]
            if size > 1:
                dist.all_reduce(mean, group=group)  # not traced: the probe's, not the step's
            if (size if divide is None else divide) > 1:
                mean /= size if divide is None else divide
            placement = setup.placements.get(name)
            if placement is not None and "tp" in placement.reduce_over and setup.tp_group is not None:
                dist.all_reduce(mean, group=setup.tp_group)  # sequence parallelism: finish_gradients' tp sum
            out[name] = LocalShard(mean / scale, param_box)
    return out
