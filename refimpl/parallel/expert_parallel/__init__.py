"""Mixture of experts and expert parallelism, from scratch (chapter 09).

Shazeer et al. 2017 (the sparsely-gated MoE layer), Lepikhin et al. 2020 (GShard: top-2 routing, capacity,
experts over devices with all-to-all), Fedus et al. 2021 (Switch: the load-balancing loss), Zoph et al. 2022
(ST-MoE: router z-loss), DeepSeek-AI 2024 (DeepSeek-V3: sigmoid scores, the aux-loss-free expert bias).
One concept per file:

* ``refimpl.parallel.expert_parallel.router``: ``TopKRouter`` (fp32 logits, softmax or sigmoid
  scores, top-k, renormalisation, the expert bias and its update), ``RouterConfig``, ``Routing``,
  the load-balancing loss, the z-loss and capacity;
* ``refimpl.parallel.expert_parallel.experts``: ``ExpertMLP`` (SwiGLU or GELU),
  ``LoopedExperts`` (any modules, one by one) and ``GroupedExperts`` (3-D weights,
  ``torch._grouped_mm``);
* ``refimpl.parallel.expert_parallel.dispatch``: the bookkeeping (counts, sort by expert, split sizes
  in one host read, rank-major to expert-major, combine);
* ``refimpl.parallel.expert_parallel.expert_parallel_communications``: the uneven autograd all-to-all,
  the count exchange, the all-gather dispatcher's all-gather / reduce-scatter pair;
* ``refimpl.parallel.expert_parallel.expert_parallel``: ``MoE`` (``MoE(dim=..., ...)`` with grouped
  experts, ``MoE.from_modules`` with any modules), the all-to-all and all-gather dispatchers;
"""

from __future__ import annotations

from refimpl.parallel.expert_parallel.dispatch import (
    SortPlan,
    combine,
    expert_counts,
    expert_major_order,
    inverse_permutation,
    permute,
    rank_splits,
    sort_by_expert,
    split_sizes,
    unpermute,
)
from refimpl.parallel.expert_parallel.expert_parallel import (
    DISPATCHERS,
    Dispatched,
    MoE,
    dispatch_all_to_all,
    undispatch_all_to_all,
)
from refimpl.parallel.expert_parallel.expert_parallel_communications import (
    AllToAllTraffic,
    all_to_all_tokens,
    exchange_counts,
    gather_tokens,
    reduce_scatter_tokens,
)
from refimpl.parallel.expert_parallel.experts import (
    ACTIVATIONS,
    ExpertMLP,
    GroupedExperts,
    LoopedExperts,
    contiguous_grad,
    grouped_mm_runs_fused,
)
from refimpl.parallel.expert_parallel.router import (
    SCORE_FUNCS,
    RouterConfig,
    Routing,
    TopKRouter,
    capacity_keep,
    concat_routings,
    expert_capacity,
    load_balancing_loss,
    router_z_loss,
)

__all__ = [
    "ACTIVATIONS",
    "DISPATCHERS",
    "SCORE_FUNCS",
    "AllToAllTraffic",
    "Dispatched",
    "ExpertMLP",
    "GroupedExperts",
    "LoopedExperts",
    "MoE",
    "RouterConfig",
    "Routing",
    "SortPlan",
    "TopKRouter",
    "all_to_all_tokens",
    "capacity_keep",
    "combine",
    "concat_routings",
    "contiguous_grad",
    "dispatch_all_to_all",
    "exchange_counts",
    "expert_counts",
    "expert_capacity",
    "expert_major_order",
    "gather_tokens",
    "grouped_mm_runs_fused",
    "inverse_permutation",
    "load_balancing_loss",
    "permute",
    "rank_splits",
    "reduce_scatter_tokens",
    "router_z_loss",
    "sort_by_expert",
    "split_sizes",
    "undispatch_all_to_all",
    "unpermute",
]
