"""The gradients the optimizer receives, as boxes of the plain GPT's tensors: what a probe passed to
``refimpl.train.train`` (``gradient_probe``) reads after the step's reductions and the loss scaler's
unscaling and check, before clipping and AdamW (``MixedPrecision.step``'s ``after_unscale``).

Why a probe: AdamW divides each gradient by the root of its second moment and clipping rescales the whole
gradient, so a gradient that is a constant factor off (a pipeline loss not divided by its ``m``
micro-batches, expert gradients counted twice: pytorch/pytorch#160285, a shard the loss scaler never
unscaled) trains with the same losses. The equivalence tests compare these gradients with one device's
(chapters 06-10).

Each rank says what it holds, as the checkpoint does (chapter 11): ``{name: LocalShard(gradient, box)}``,
``name`` the plain GPT's, ``box`` the part of the global tensor (a tensor-parallel block, a ZeRO row
shard of it, a whole replica; a tied embedding on both pipeline ends under the embedding's name). The
probe reads the tensors the optimizer steps, never a recomputation:

* plain, DP, tensor, context and pipeline parallelism (ZeRO-0), ZeRO-3: the ``.grad`` of the tensor the
  rank holds (ZeRO-3: of its row shard);
* ZeRO-1 and ZeRO-2: the ``.grad`` of the optimizer's row shard (reduce-scattered before the step:
  ZeRO-1 once per step, ZeRO-2 in backward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from refimpl.checkpoint import parameter_shards
from refimpl.distributed.placement import LocalShard

if TYPE_CHECKING:
    from refimpl.train.setup import _Setup


@torch.no_grad()
def gradient_shards(setup: _Setup) -> dict[str, LocalShard]:
    """``{plain GPT name: LocalShard(float32 gradient, its box in the global tensor)}`` of every parameter
    this rank holds a gradient of (module docstring)."""
    held = {name.removeprefix("model/"): s for name, s in parameter_shards(setup.state_module).items()}
    declare = getattr(setup.optimizer, "local_state_shards", None)
    if not callable(declare):  # the rank's tensors carry their own gradients
        return {name: LocalShard(s.tensor.grad.float(), s.box) for name, s in held.items()
                if s.tensor.is_leaf and s.tensor.requires_grad and s.tensor.grad is not None}
    where = {s.tensor: (name, s.box) for name, s in held.items()}  # by tensor: its name and box
    out: dict[str, LocalShard] = {}
    for param, stepped, box in declare():  # ZeRO-1/2: the optimizer steps a row box of each local tensor
        name, param_box = where[param]
        if stepped.grad is not None:
            out[name] = LocalShard(stepped.grad.float(), param_box.within(box))
    return out
