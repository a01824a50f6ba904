"""The top-k router of a mixture-of-experts layer, its auxiliary losses and capacity (chapter 09).

For ``T`` tokens ``x`` of width ``h`` and ``E`` experts the router computes **logits in fp32** (fp64 for an
fp64 reference) ``z = x W^T`` (``W``: an ``nn.Linear(h, E)``, its parameters the layer's), then scores

* ``softmax``: ``s_{t,i} = exp z_{t,i} / sum_j exp z_{t,j}`` (Switch Transformer, Fedus et al. 2021;
  Mixtral, Jiang et al. 2024);
* ``sigmoid``: ``s_{t,i} = sigmoid(z_{t,i})`` (DeepSeek-V3, DeepSeek-AI 2024), each expert judged alone;

picks each token's ``k`` experts ``I_t = topk_i(s_{t,i} + b_i)`` and gives them the combine weights
``w_{t,j} = s_{t,I_tj}``, divided by ``sum_j w_{t,j}`` when ``normalize_topk``. **Renormalising the top-k**
is what the top-2 and top-8 recipes do (GShard's top-2, Lepikhin et al. 2020, Algorithm 1; Mixtral, whose
softmax over the k chosen logits is this; DeepSeek-V3 eq. 13, on its sigmoid scores); Switch's top-1
multiplies the expert's output by the raw probability ``p_i(x)`` (Fedus et al. 2021, eq. 2). At ``k = 1`` a
renormalised weight is ``s / s = 1`` whatever the logits: the task's loss then gives the router **no
gradient** (only the auxiliary losses train it; measured on the course GPT, tests/ranks/test_moe_model.py:
router gradient norm 6.8e-10 at ``k = 1`` renormalised, 4.8e-3 with the raw score, 1.0e-2 at ``k = 2``). So
``normalize_topk=None`` (the default) means ``k > 1``: Switch at ``k = 1``, GShard / Mixtral / DeepSeek-V3
above; ``True`` or ``False`` forces it. ``b`` is DeepSeek-V3's **auxiliary-loss-free expert bias**
(``expert_bias=True``; zero until updated): it only steers the choice, never the combine weights, and
``TopKRouter.update_expert_bias`` moves it before each optimizer step by
``b_i += u * sign(mean_j load_j - load_i)``: an overloaded expert becomes less attractive.

Auxiliary losses, both on this rank's tokens only (a data-parallel wrapper averages later):

* load balancing (Switch, eq. 4; GShard, Lepikhin et al. 2020): ``L_aux = alpha * E * sum_i f_i P_i`` with
  ``f_i`` the fraction of the ``T k`` assignments routed to expert ``i`` (a count: no gradient) and ``P_i``
  the mean router probability of expert ``i`` (sigmoid scores are first normalised to sum to one per token,
  DeepSeek-V3 eq. 18-20). A uniform router gives ``alpha`` (not the minimum: hard counts ``f`` can
  go below, chapter 09); the gradient flows through ``P``;
* router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``L_z = beta * mean_t (logsumexp_i z_{t,i})^2``, which
  keeps the logits small enough for fp32 exponentials.

**Capacity** (GShard; Switch section 2.2): ``capacity_factor=None`` is dropless. A float ``cf`` gives each
expert ``C = ceil(k T / E * cf)`` slots *per rank* (``T`` is this rank's token count: under expert
parallelism each source rank sends each expert at most ``C`` tokens, as Megatron-LM's router does before
its all-to-all). An expert chosen by more assignments keeps the ``C`` with the highest score ``s_{t,i}``
(ties: the earlier token) and drops the rest: Megatron-LM's default drop policy
(``moe_token_drop_policy="probs"``; close to V-MoE's batch-prioritized routing, Riquelme et al. 2021, which
ranks tokens by their top score). GShard and Switch drop **by position** instead: an expert's slots go to
its assignments in token order (GShard: every token's first choice before any second choice), so the
assignments beyond ``C`` in that order drop, whatever their scores (Megatron-LM's ``"position"``). A
dropped assignment contributes zero (the residual connection around the layer carries its token). ``f_i``
counts the assignments before dropping.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refimpl.comm import ops
from refimpl.parallel.expert_parallel.dispatch import expert_counts

SCORE_FUNCS = ("softmax", "sigmoid")
"""``softmax`` (Switch, Mixtral) or ``sigmoid`` (DeepSeek-V3) router scores."""


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How tokens choose experts. Checked on construction (one-line ``ValueError`` s)."""

    num_experts: int
    top_k: int
    score_func: str = "softmax"
    normalize_topk: bool | None = None    # divide the k weights by their sum; None: when top_k > 1
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coeff: float = 0.01          # alpha of the load-balancing loss (0: none)
    z_loss_coeff: float = 0.0             # beta of the router z-loss (0: none)
    expert_bias: bool = False             # DeepSeek-V3's aux-loss-free bias on the selection scores

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts = {self.num_experts}], got {self.top_k}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"unknown score_func {self.score_func!r}; expected one of {SCORE_FUNCS}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None: dropless), got {self.capacity_factor}")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError("aux_loss_coeff and z_loss_coeff must be >= 0")
        if self.normalize_topk is None:  # the recipes' choice (module docstring): Switch at k = 1
            object.__setattr__(self, "normalize_topk", self.top_k > 1)


@dataclass(kw_only=True)
class Routing:
    """The router's decision for ``T`` tokens: ``expert_ids [T, k]`` (int64), ``weights [T, k]`` (fp32 combine
    weights, in the graph), ``keep [T, k]`` (False: dropped by capacity), ``scores [T, E]`` (fp32),
    ``tokens_per_expert [E]`` (assignments routed, before dropping), the auxiliary losses (scalars in the
    graph) and ``dropped`` (0-d int64: the assignments dropped by capacity). Every field stays on the
    device: ``dropped_fraction`` and ``kept_per_expert`` are read when asked for, not in the
    forward (a host read there would stall a GPU once per layer and micro-batch)."""

    expert_ids: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    scores: torch.Tensor
    tokens_per_expert: torch.Tensor
    balance_loss: torch.Tensor
    z_loss: torch.Tensor
    dropped: torch.Tensor

    @property
    def dropped_fraction(self) -> float:
        """The dropped share of the ``T k`` assignments (a host read)."""
        return int(self.dropped) / max(self.keep.numel(), 1)

    @property
    def aux_loss(self) -> torch.Tensor:
        """What to add to the training loss: the load-balancing loss plus the z-loss."""
        return self.balance_loss + self.z_loss

    @property
    def kept_ids(self) -> torch.Tensor:
        """``expert_ids`` with dropped assignments set to -1 (what the dispatch sorts)."""
        return torch.where(self.keep, self.expert_ids, torch.full_like(self.expert_ids, -1))

    @property
    def kept_weights(self) -> torch.Tensor:
        """The combine weights with dropped assignments at zero (fp32, in the graph)."""
        return self.weights * self.keep

    @property
    def kept_per_expert(self) -> torch.Tensor:
        """``[E]`` assignments each expert computes (after dropping), on the device."""
        return expert_counts(self.kept_ids, self.scores.shape[-1])


def _sum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum(tensors)`` of one tensor or more (``0 + t0 + t1 + ...``), a tensor."""
    total = sum(tensors)
    assert isinstance(total, torch.Tensor)  # not the empty sum 0: concat_routings refuses no routings
    return total


def concat_routings(routings: Sequence[Routing]) -> Routing:
    """The routings of consecutive token chunks as one (tokens concatenated, counts summed, losses summed,
    dropped fraction over all assignments): how one device replays N ranks that each routed their own
    chunk (per-rank capacity and per-rank auxiliary losses)."""
    if not routings:
        raise ValueError("concat_routings needs at least one routing")
    return Routing(
        expert_ids=torch.cat([r.expert_ids for r in routings]),
        weights=torch.cat([r.weights for r in routings]),
        keep=torch.cat([r.keep for r in routings]),
        scores=torch.cat([r.scores for r in routings]),
        tokens_per_expert=_sum(r.tokens_per_expert for r in routings),
        balance_loss=_sum(r.balance_loss for r in routings),
        z_loss=_sum(r.z_loss for r in routings),
        dropped=_sum(r.dropped for r in routings),
    )


def expert_capacity(num_tokens: int, top_k: int, num_experts: int,
                    capacity_factor: float | None) -> int | None:
    """``C = ceil(k T / E * cf)`` slots per expert, or None (dropless) when ``capacity_factor`` is None."""
    if capacity_factor is None:
        return None
    return math.ceil(top_k * num_tokens / num_experts * capacity_factor)


def capacity_keep(expert_ids: torch.Tensor, scores: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """``[T, k]`` bool: True for the assignments that fit. Each expert keeps its ``capacity`` assignments
    of the highest score ``scores[t, i]`` (ties: the earlier token, a stable sort), drops the rest."""
    if capacity is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    t, k = expert_ids.shape
    e = scores.shape[-1]
    chosen = torch.zeros(t, e, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, expert_ids, True)                               # [T, E]: token t chose expert i
    ranked = torch.where(chosen, scores.detach(), torch.full_like(scores, -math.inf))
    order = torch.sort(ranked, dim=0, descending=True, stable=True).indices  # per expert, best tokens first
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(t, device=scores.device).unsqueeze(1).expand(t, e))
    fits = chosen & (rank < capacity)                                  # [T, E]: token t is in i's first C
    return fits.gather(1, expert_ids)


def load_balancing_loss(scores: torch.Tensor, expert_ids: torch.Tensor, coeff: float,
                        score_func: str) -> torch.Tensor:
    """``alpha * E * sum_i f_i P_i`` (Switch eq. 4): ``f_i`` = share of the ``T k`` assignments routed to
    expert ``i`` (no gradient), ``P_i`` = mean probability of expert ``i`` (sigmoid scores normalised per
    token first)."""
    t, e = scores.shape
    if coeff == 0 or t == 0:
        return scores.new_zeros(())
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    f = expert_counts(expert_ids, e).to(scores.dtype) / expert_ids.numel()
    return coeff * e * (f * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``beta * mean_t (logsumexp_i z_{t,i})^2`` (ST-MoE eq. 5)."""
    if coeff == 0 or logits.shape[0] == 0:
        return logits.new_zeros(())
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


class TopKRouter(nn.Module):
    """The router (module docstring): ``gate`` is the given ``nn.Linear(h, E)``, ``expert_bias`` a ``[E]``
    fp32 buffer when ``config.expert_bias``. ``forward(x [T, h]) -> Routing``."""

    def __init__(self, gate: nn.Linear, config: RouterConfig) -> None:
        super().__init__()
        if not isinstance(gate, nn.Linear):
            raise TypeError(f"the router must be an nn.Linear(h, E), got {type(gate).__name__}")
        if gate.out_features != config.num_experts:
            raise ValueError(f"the router maps h -> {gate.out_features} but there are {config.num_experts} "
                             "experts")
        self.gate = gate
        self.config = config
        if config.expert_bias:
            bias = torch.zeros(config.num_experts, dtype=torch.float32, device=gate.weight.device)
            self.register_buffer("expert_bias", bias)
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.config
        dt = torch.promote_types(x.dtype, torch.float32)                        # fp32, or fp64 for fp64
        bias = None if self.gate.bias is None else self.gate.bias.to(dt)
        with torch.autocast(x.device.type, enabled=False):  # fp32 under autocast too (it would cast to 16)
            logits = F.linear(x.to(dt), self.gate.weight.to(dt), bias)          # [T, E]
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        choose = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias
        expert_ids = torch.topk(choose, cfg.top_k, dim=-1).indices               # [T, k]
        weights = scores.gather(1, expert_ids)                                   # bias-free combine weights
        if cfg.normalize_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        capacity = expert_capacity(x.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor)
        keep = capacity_keep(expert_ids, scores, capacity)
        return Routing(
            expert_ids=expert_ids, weights=weights, keep=keep, scores=scores,
            tokens_per_expert=expert_counts(expert_ids, cfg.num_experts),
            balance_loss=load_balancing_loss(scores, expert_ids, cfg.aux_loss_coeff, cfg.score_func),
            z_loss=router_z_loss(logits, cfg.z_loss_coeff),
            dropped=(~keep).sum(),
        )

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor, rate: float,
                           group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """DeepSeek-V3's update, before each optimizer step: ``b_i += rate * sign(mean(load) - load_i)``.
        ``load`` ([E] token counts) is summed over ``group`` first when given (one all-reduce), so every
        rank makes the same update. Returns the bias."""
        if self.expert_bias is None:
            raise RuntimeError("this router has no expert bias (RouterConfig(expert_bias=True))")
        load = load.detach().to(torch.float32).clone()
        if group is not None:
            ops.all_reduce(load, group=group)
        self.expert_bias += rate * torch.sign(load.mean() - load)
        return self.expert_bias
