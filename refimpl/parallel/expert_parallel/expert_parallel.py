"""The mixture-of-experts layer and expert parallelism (chapter 09).

Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer";
Lepikhin et al. 2020, "GShard" (top-2 routing, capacity, experts spread over devices with all-to-all);
Fedus et al. 2021, "Switch Transformers"; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report". For each token
``x_t`` the router (``.router``) picks ``k`` of ``E`` experts ``I_t`` with weights ``w_t``, and

    y_t = sum_{j < k} w_{t,j} E_{I_tj}(x_t)          (combined in fp32; a dropped assignment adds 0).

**Expert parallelism** (GShard section 3): the ``N`` ranks of ``ep_group`` each keep ``E/N`` experts (rank
``r`` the experts ``[r E/N, (r+1) E/N)``) and each routes its **own** tokens. The all-to-all dispatcher
(``dispatch_all_to_all``, ``undispatch_all_to_all``): sort this rank's kept assignments by expert,
exchange the per-expert counts, send each expert's rows to its owner (uneven splits), regroup rank-major to
expert-major, run the local experts, and the reverse; then combine (``.dispatch`` for the bookkeeping,
``.expert_parallel_communications`` for the collectives). The ``allgather`` dispatcher (Megatron-LM's
default) gathers every rank's tokens and routing instead, computes the local experts' share of every token
and reduce-scatters the partial outputs; both give the same result.

**Gradients.** The layer averages nothing. After backward a local expert's gradient is the sum over every
token it received, from any rank; the router's is this rank's tokens' (through the combine weights and the
auxiliary losses). A data-parallel wrapper then averages dense weights over ``dp x cp`` and expert weights
over the expert-data-parallel group (``dp x cp / ep``), by the global token count (docs: layout rules). An
expert gradient divided by ``ep`` as well would be wrong by that factor, and AdamW would hide it
(pytorch/pytorch#160285); the tests compare gradients, not losses.

**Capacity** is per source rank (``C`` from this rank's ``T``, ``.router``): one device reproduces an
expert-parallel run by routing each rank's chunk on its own and concatenating (``.concat_routings``, then
``MoE.forward_routed``).

**Host syncs** (what stalls a GPU: the host waiting for a value the device computes;
``refimpl.distributed.host_syncs`` counts them on CPU): the shapes of the dispatch depend on the routing,
so the host reads the counts once per forward: ep 1 one ``.tolist()`` of the ``[E]`` counts, the all-to-all
dispatcher one of the exchanged counts (input splits, output splits and local counts together,
``.split_sizes``), the all-gather dispatcher two (its equal-token check, then its counts); backward none.
Everything else stays on the device: counts by ``scatter_add_`` (not ``bincount``), the kept count and
``repeat_interleave`` sizes from the host read, ``_grouped_mm``'s offsets from the device counts, the dropped
count and ``kept_per_expert`` read only when asked for (``MoE.dropped_fraction`` is a host read). Before:
11 per forward at ep 1, 16 with the all-to-all dispatcher (tests/ranks/test_expert_parallel.py).

Two constructors: ``MoE(dim=..., hidden=..., num_experts=..., top_k=..., ep_group=...)`` holds the local
slice of ``.GroupedExperts``' 3-D weights (the efficient path); ``MoE.from_modules`` takes any
router ``nn.Linear`` and any expert modules and runs them one by one (the general path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from refimpl.distributed.group_info import group_rank_size
from refimpl.parallel.expert_parallel.dispatch import (
    SortPlan,
    combine,
    expert_counts,
    expert_major_order,
    inverse_permutation,
    permute,
    sort_by_expert,
    split_sizes,
)
from refimpl.parallel.expert_parallel.expert_parallel_communications import (
    AllToAllTraffic,
    all_to_all_tokens,
    check_equal_tokens,
    exchange_counts,
    gather_no_grad,
    gather_tokens,
    post_all_to_all_tokens,
    reduce_scatter_tokens,
)
from refimpl.parallel.expert_parallel.experts import GroupedExperts, LoopedExperts
from refimpl.parallel.expert_parallel.router import RouterConfig, Routing, TopKRouter

DISPATCHERS = ("alltoall", "allgather")
"""Token dispatchers: ``alltoall`` (GShard; Megatron-LM's ``alltoall``) and ``allgather`` (Megatron-LM's
default)."""

Group = dist.ProcessGroup | None


@dataclass(frozen=True, kw_only=True)
class Dispatched:
    """What ``dispatch_all_to_all`` hands the local experts, and what the way back needs.
    ``tokens [R, h]``: expert-major rows; ``counts``: rows per local expert (host ints) and
    ``device_counts`` the same on the device (the grouped experts' offsets, no host-to-device copy);
    ``plan``: this rank's sort; ``order``: rank-major -> expert-major; ``input_splits`` /
    ``output_splits``: rows sent to / received from each rank."""

    tokens: torch.Tensor
    counts: list[int]
    plan: SortPlan
    order: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    device_counts: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class _Routes:
    """The dispatch's bookkeeping before any token moves: this rank's sort, the exchanged counts ``recv
    [N, E/N]``, the rows sent to / received from each rank, the rows per local expert."""

    plan: SortPlan
    recv: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    local: list[int]

    @classmethod
    def of(cls, routing: Routing, *, num_experts: int, group: Group) -> _Routes:
        ids = routing.kept_ids
        counts = expert_counts(ids, num_experts)                    # [E] on the device
        recv = exchange_counts(counts, group)                       # [N, E/N]: rank q's rows for my expert j
        input_splits, output_splits, local = split_sizes(counts, recv)  # the one host sync
        plan = sort_by_expert(ids, num_experts, counts=counts, kept=sum(input_splits))
        return cls(plan=plan, recv=recv, input_splits=input_splits, output_splits=output_splits, local=local)

    def dispatched(self, got: torch.Tensor) -> Dispatched:
        """The received rows ``got`` (rank-major) regrouped expert-major for the local experts."""
        order = expert_major_order(self.recv, total=sum(self.output_splits))
        return Dispatched(tokens=got.index_select(0, order), counts=self.local, plan=self.plan, order=order,
                          input_splits=self.input_splits, output_splits=self.output_splits,
                          device_counts=self.recv.sum(0))


def dispatch_all_to_all(x: torch.Tensor, routing: Routing, *, num_experts: int, group: Group,
                        traffic: AllToAllTraffic | None = None) -> Dispatched:
    """Send the tokens ``x [T, h]`` of this rank's kept assignments to their experts' ranks (module
    docstring). One device-to-host read: the exchanged counts (``.split_sizes``)."""
    routes = _Routes.of(routing, num_experts=num_experts, group=group)
    got = all_to_all_tokens(permute(x, routes.plan), routes.output_splits, routes.input_splits, group,
                            traffic)  # rank-major
    return routes.dispatched(got)


def dispatch_beside(x: torch.Tensor, routing: Routing, beside: Callable[[], torch.Tensor], *,
                    num_experts: int, group: Group, traffic: AllToAllTraffic | None = None,
                    overlap: bool = True) -> tuple[Dispatched, torch.Tensor]:
    """``dispatch_all_to_all`` with ``beside()`` computed while the tokens travel (DeepSeek-V3, section
    3.2.2: the shared experts overlap the dispatch): the all-to-all posted
    (``.expert_parallel_communications.post_all_to_all_tokens``), ``beside()`` run, then the wait.
    ``overlap=False`` is the serialized control: the wait first, then ``beside()`` (the same results,
    bitwise). Several ranks only."""
    routes = _Routes.of(routing, num_experts=num_experts, group=group)
    pending = post_all_to_all_tokens(permute(x, routes.plan), routes.output_splits, routes.input_splits,
                                     group, traffic)
    if not overlap:
        got = pending.wait()
    out = beside()
    if overlap:
        got = pending.wait()
    return routes.dispatched(got), out


def undispatch_all_to_all(y: torch.Tensor, d: Dispatched, group: Group,
                          traffic: AllToAllTraffic | None = None) -> torch.Tensor:
    """Expert outputs ``y [R, h]`` (expert-major) back to their source ranks: ``[A, h]`` in this rank's
    sorted order (``d.plan``), ready for ``.combine``."""
    back = y.index_select(0, inverse_permutation(d.order))     # rank-major again
    return all_to_all_tokens(back, d.input_splits, d.output_splits, group, traffic)


def _plus(y: torch.Tensor, shared: torch.Tensor | Callable[[], torch.Tensor] | None) -> torch.Tensor:
    """``y`` plus the shared output (computed here when given as a function), after the routed one."""
    if shared is None:
        return y
    return y + (shared() if callable(shared) else shared)


def _local_plan(ids: torch.Tensor, num_experts: int) -> tuple[SortPlan, list[int]]:
    """The sort of ``ids`` (no collective) and its counts as host ints: one device-to-host read."""
    counts = expert_counts(ids, num_experts)
    host = counts.tolist()  # the one host sync: the experts' row blocks are sized by it
    return sort_by_expert(ids, num_experts, counts=counts, kept=sum(host)), host


def _ep_rank_size(group: Group) -> tuple[int, int]:
    """``(rank, size)`` in the expert-parallel group; ``None`` is no expert parallelism (this rank holds
    every expert, no collective), also inside a multi-rank program: a layer built without a group must not
    shard its experts over the default group (a GPT builds its MoE blocks whole, chapter 09)."""
    return (0, 1) if group is None else group_rank_size(group)


def _local_count(num_experts: int, ep: int) -> int:
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not divide over the expert-parallel size {ep}")
    return num_experts // ep


class MoE(nn.Module):
    """A mixture-of-experts layer, expert-parallel over ``ep_group`` (module docstring).

    ``moe(x)`` maps ``[b, s, h]`` or ``[T, h]`` to the same shape (``ep_group=None``: no expert
    parallelism, every expert here and no collective, with or without a process group). After a forward:
    ``aux_loss`` (the load-balancing loss plus the z-loss, in the graph: add it to the loss), ``z_loss``,
    ``tokens_per_expert`` (``[E]`` assignments of this rank's tokens, before capacity), ``kept_per_expert``
    (after; computed when read), ``dropped_fraction`` (a host read), ``routing`` and ``traffic`` (token
    bytes the all-to-alls sent to other ranks, forward and, once backward ran, backward).

    This constructor builds the efficient layer: a bias-free ``nn.Linear(dim, num_experts)`` router and the
    local slice of ``.GroupedExperts``, all drawn from ``torch.Generator().manual_seed(seed)``, so
    every ``ep`` holds the same experts as one device. ``normalize_topk`` (None: ``top_k > 1``) is the
    router's (``.RouterConfig``): at ``top_k = 1`` the combine weight is the raw score, Switch's."""

    def __init__(self, *, dim: int, hidden: int, num_experts: int, top_k: int, activation: str = "swiglu",
                 score_func: str = "softmax", normalize_topk: bool | None = None,
                 capacity_factor: float | None = None, aux_loss_coeff: float = 0.01,
                 z_loss_coeff: float = 0.0, expert_bias: bool = False, dispatcher: str = "alltoall",
                 ep_group: Group = None, seed: int = 0, device=None, dtype=None) -> None:
        super().__init__()
        config = RouterConfig(num_experts=num_experts, top_k=top_k, score_func=score_func,
                              normalize_topk=normalize_topk, capacity_factor=capacity_factor,
                              aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff,
                              expert_bias=expert_bias)
        ep_rank, ep = _ep_rank_size(ep_group)
        local = _local_count(num_experts, ep)
        g = torch.Generator().manual_seed(seed)
        gate = nn.Linear(dim, num_experts, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            bound = 1.0 / dim**0.5
            gate.weight.copy_(torch.empty(num_experts, dim).uniform_(-bound, bound, generator=g))
        experts = GroupedExperts(dim=dim, hidden=hidden, num_experts=num_experts, activation=activation,
                                 first=ep_rank * local, num_local=local, generator=g, device=device,
                                 dtype=dtype)
        self._attach(TopKRouter(gate, config), experts, ep_group, dispatcher)

    @classmethod
    def from_modules(cls, router: nn.Linear, experts: Sequence[nn.Module], *, top_k: int,
                     score_func: str = "softmax", normalize_topk: bool | None = None,
                     capacity_factor: float | None = None, ep_group: Group = None,
                     aux_loss_coeff: float = 0.01, z_loss_coeff: float = 0.0, expert_bias: bool = False,
                     dispatcher: str = "alltoall") -> MoE:
        """The general layer: ``router`` (``h -> E``, used as given) and the full list of ``E`` expert
        modules (``[n, h] -> [n, h]``, any module); rank ``r`` of ``ep_group`` (size ``N``) keeps
        ``experts[r E/N : (r+1) E/N]`` and runs them one by one."""
        experts = list(experts)
        config = RouterConfig(num_experts=len(experts), top_k=top_k, score_func=score_func,
                              normalize_topk=normalize_topk, capacity_factor=capacity_factor,
                              aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff,
                              expert_bias=expert_bias)
        ep_rank, ep = _ep_rank_size(ep_group)
        local = _local_count(len(experts), ep)
        first = ep_rank * local
        moe = cls.__new__(cls)
        nn.Module.__init__(moe)
        moe._attach(TopKRouter(router, config), LoopedExperts(experts[first : first + local], first),
                    ep_group, dispatcher)
        return moe

    def _attach(self, router: TopKRouter, experts: nn.Module, ep_group: Group, dispatcher: str) -> None:
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"unknown dispatcher {dispatcher!r}; expected one of {DISPATCHERS}")
        self.router = router
        self.experts = experts
        self.ep_group = ep_group
        self.ep_rank, self.ep_size = _ep_rank_size(ep_group)
        self.num_experts = router.config.num_experts
        self.num_local_experts = _local_count(self.num_experts, self.ep_size)
        self.first_expert = self.ep_rank * self.num_local_experts
        self.dim = router.gate.in_features
        self.dispatcher = dispatcher
        self.routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.traffic = AllToAllTraffic()
        self.overlap_dispatch = True  # False: the serialized control of dispatch_beside

    @property
    def kept_per_expert(self) -> torch.Tensor | None:
        """``[E]`` assignments of the last forward each expert computes (on the device; None before)."""
        return None if self.routing is None else self.routing.kept_per_expert

    @property
    def dropped_fraction(self) -> float | None:
        """The last forward's dropped share of the assignments (a host read: call it outside the step)."""
        return None if self.routing is None else self.routing.dropped_fraction

    def forward(self, x: torch.Tensor, *, beside: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """``moe(x)``; ``beside()``: a computation of ``x``'s shape added to the output, run while the
        tokens travel (``forward_routed``)."""
        if x.dim() not in (2, 3) or x.shape[-1] != self.dim:
            raise ValueError(f"MoE expects [b, s, {self.dim}] or [T, {self.dim}], got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.dim)
        routing = self.router(tokens)
        flat = None if beside is None else (lambda: beside().reshape(-1, self.dim))  # [T, h], as tokens
        y = self.forward_routed(tokens, routing, beside=flat)
        self.routing, self.aux_loss, self.z_loss = routing, routing.aux_loss, routing.z_loss
        self.tokens_per_expert = routing.tokens_per_expert
        return y.view(x.shape)

    def forward_routed(self, x: torch.Tensor, routing: Routing, *,
                       beside: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """``[T, h]`` tokens already routed -> ``[T, h]`` (``x.dtype``): dispatch, local experts, combine;
        plus ``beside()`` (``[T, h]``, e.g. the shared experts), which the all-to-all dispatcher runs while
        the tokens travel (``dispatch_beside``; ``overlap_dispatch = False``: after them, the control)."""
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"unknown dispatcher {self.dispatcher!r}; expected one of {DISPATCHERS}")
        self.traffic = AllToAllTraffic()
        shared = None
        if self.ep_size == 1:  # every expert here: either dispatcher on one rank is this, no collective
            plan, counts = _local_plan(routing.kept_ids, self.num_experts)
            y = self.experts(permute(x, plan), counts, plan.counts)
            return _plus(combine(y, routing.kept_weights, plan).to(x.dtype), beside)
        if self.dispatcher == "allgather":
            return _plus(self._forward_allgather(x, routing).to(x.dtype), beside)
        if beside is None:
            d = dispatch_all_to_all(x, routing, num_experts=self.num_experts, group=self.ep_group,
                                    traffic=self.traffic)
        else:  # DeepSeek-V3: the shared experts run while the tokens travel
            d, shared = dispatch_beside(x, routing, beside, num_experts=self.num_experts, group=self.ep_group,
                                        traffic=self.traffic, overlap=self.overlap_dispatch)
        y = self.experts(d.tokens, d.counts, d.device_counts)
        back = undispatch_all_to_all(y, d, self.ep_group, self.traffic)
        return _plus(combine(back, routing.kept_weights, d.plan).to(x.dtype), shared)

    def _forward_allgather(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every rank's tokens and routing gathered; my experts' share of every token's output; the shares
        summed back to the tokens' owners (one reduce-scatter)."""
        g = self.ep_group
        check_equal_tokens(x.shape[0], g, x.device)
        x_all = gather_tokens(x, g)                                   # [N T, h]
        ids = gather_no_grad(routing.kept_ids, g)                     # [N T, k], -1: dropped
        weights = gather_tokens(routing.kept_weights, g)              # [N T, k] fp32, in the graph
        lo, hi = self.first_expert, self.first_expert + self.num_local_experts
        mine = torch.where((ids >= lo) & (ids < hi), ids - lo, torch.full_like(ids, -1))
        plan, counts = _local_plan(mine, self.num_local_experts)
        y = self.experts(permute(x_all, plan), counts, plan.counts)
        return reduce_scatter_tokens(combine(y, weights, plan), g)   # [T, h] fp32

    def update_expert_bias(self, rate: float, *, load: torch.Tensor | None = None,
                           group: Group = None) -> torch.Tensor:
        """DeepSeek-V3's bias update (``.TopKRouter.update_expert_bias``) from ``load`` (default: the
        last forward's ``tokens_per_expert``), summed over ``group`` when given."""
        load = self.tokens_per_expert if load is None else load
        if load is None:
            raise RuntimeError("update_expert_bias needs a forward first, or a load")
        return self.router.update_expert_bias(load, rate, group)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.router.config.top_k}, ep={self.ep_size}, "
                f"local=[{self.first_expert}, {self.first_expert + self.num_local_experts}), "
                f"dispatcher={self.dispatcher}")


__all__ = ["DISPATCHERS", "Dispatched", "MoE", "dispatch_all_to_all", "dispatch_beside",
           "undispatch_all_to_all"]
