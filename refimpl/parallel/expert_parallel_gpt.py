"""Expert parallelism applied to the GPT (chapter 09): ``apply_expert_parallel``, the step of
``refimpl.parallel.parallelize`` after tensor parallelism, and the experts' gradient reduction.

**The layout** (torchtitan's dp2ep; Megatron-LM's MoE parallel folding, Liu et al. 2025): expert
parallelism is a second view of the ``N = dp x cp`` ranks that see different tokens, ``N = edp x ep``
(``refimpl.distributed.mesh.ParallelDims.expert_grid``, ``ep`` consecutive ranks of that view). Rank
``r`` of an ``ep`` group keeps experts ``[r E/ep, (r+1) E/ep)`` of every MoE block
(``refimpl.models.moe.MoEMLP.shard_experts``) and routes its own tokens to their owners with GShard's
all-to-all; the dense weights (attention, norms, embeddings, the routers) are replicated over all ``N``.
Under tensor parallelism (without sequence parallelism) the MoE input is the whole ``[b, s, h]`` on every
tp rank, so every tp rank routes the same tokens and runs the same experts: the experts are replicated over
``tp``, and their gradients are equal there (nothing to reduce over tp). With sequence parallelism the MoE
input is the tp rank's ``[b, s/t, h]``: each tp rank routes its own tokens (no repeated expert compute), and
the router's and experts' gradients, like the layer norms', are summed over ``tp``
(``refimpl.models.moe.MoEMLP.sequence_parallel_parameters``); the balance loss counts over tp too.

**Gradients.** After backward a local expert's gradient is ``sum_{q in my ep group} dL_q/dW``: the sum over
every token it received (the all-to-all's backward brings each rank's share home), and ``L_q`` is rank
``q``'s loss, the mean over its tokens. The gradient of the global loss ``1/N sum_q L_q`` is then

    g_e = 1/N sum_{ranks q holding a copy of e} (sum over q's ep group of dL/dW_e)
        = (1/N) sum over the expert-data-parallel group of the local gradients,

a **sum over ``edp`` divided by ``N = dp x cp``** (the global token count's normalisation, the dense
gradients' ``1/N``), not a mean over ``edp`` (``1/edp = ep/N``: ``ep`` times too large, the bug of
pytorch/pytorch#160285, hidden by AdamW; Megatron-LM's DDP scales expert gradients by ``1/(dp cp)`` too,
and torchtitan sets FSDP's ``gradient_divide_factor`` to ``dp cp`` for the experts).
``reduce_expert_gradients`` does it once per step (after the micro-batches, ZeRO-0); ZeRO-1/2
reduce-scatter them over ``edp`` with the same divisor (``refimpl.parallel.zero.ShardedOptimizer``'s
shard groups); ZeRO-3 makes each block's experts a unit of their own, sharded over ``edp`` and
reduce-scattered there with the same divisor (``refimpl.parallel.zero.FullyShardedDataParallel``'s
``own_groups``; torchtitan's ``fully_shard`` of the experts on its ``efsdp`` mesh). Which group is read
from the placement (``reduce_over``: ``edp``), so a placement that says ``dp x cp`` gives the wrong,
averaged-over-``dp x cp`` gradient the tests' negative control plants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size
from refimpl.parallel.declarations import moe_layers
from refimpl.parallel.placements import HeldGradient

__all__ = ["apply_expert_parallel", "expert_parameter_names", "reduce_expert_gradients"]


def apply_expert_parallel(model: nn.Module, *, ep_group: dist.ProcessGroup | None) -> nn.Module:
    """Keep this rank's experts of every MoE block of ``model`` (in place; module docstring); a model
    without MoE blocks is refused. Returns ``model``."""
    blocks = moe_layers(model)
    if not blocks:
        raise ValueError("expert parallelism needs a model with MoE blocks (ModelConfig.num_experts > 0)")
    ep = group_rank_size(ep_group)[1]
    for block in blocks:
        if block.num_experts % ep:
            raise ValueError(f"{block.num_experts} experts do not divide over the expert-parallel size {ep}")
        block.shard_experts(ep_group)
    return model


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The names, in ``model`` (a GPT), of the MoE blocks' expert tensors
    (``refimpl.models.moe.MoEMLP.expert_parallel_parameters``)."""
    where = {id(m): name for name, m in model.named_modules()}
    return [f"{where[id(b)]}.{n}" for b in moe_layers(model) for n in b.expert_parallel_parameters()]


@torch.no_grad()
def reduce_expert_gradients(held: Sequence[HeldGradient], names: Sequence[str], *,
                            groups: Mapping[str, dist.ProcessGroup | None], num_replicas: int) -> int:
    """For each gradient of ``names`` (the experts'): the sum over the group of every data-parallel axis
    its placement reduces over (the ``edp`` group; not ``tp``, summed elsewhere), divided by
    ``num_replicas`` (``N = dp x cp``): the module docstring's ``g_e``. Returns how many were reduced."""
    todo = [h for h in held if h.name in set(names)]
    for h in todo:
        for axis in h.placement.reduce_over:
            group = groups.get(axis)
            if axis != "tp" and group is not None and group_rank_size(group)[1] > 1:
                ops.all_reduce(h.grad, group=group)
        if num_replicas > 1:
            h.grad.div_(num_replicas)
    return len(todo)
