"""The GPT's mixture-of-experts MLP: ``MoEMLP``, built on ``refimpl.parallel.expert_parallel.MoE``
(chapter 09).

Shazeer et al. 2017 (the sparsely-gated MoE layer), Lepikhin et al. 2020 (GShard), Fedus et al. 2021
(Switch), DeepSeek-AI 2024 (DeepSeek-V3). A block whose index is a multiple of ``moe_every``
(``refimpl.config.ModelConfig.is_moe_layer``) replaces its dense MLP by ``E`` expert MLPs and a top-``k``
router (the grouped experts: 3-D weights ``[E, h, f]``, one ``torch._grouped_mm`` per projection); a token's
output is ``y_t = sum_j w_{t,j} E_{I_tj}(x_t)``.

**The balance loss is sequence-wise** (DeepSeek-V3 eq. 17-20, its "complementary sequence-wise auxiliary
loss"): for each sequence ``b`` of ``s`` tokens, ``f_{b,i}`` is the share of its ``s k`` assignments routed
to expert ``i`` and ``P_{b,i}`` the mean probability of expert ``i`` over its tokens (sigmoid scores first
normalised per token), and

    L_aux = alpha E mean_b sum_i f_{b,i} P_{b,i}                  (a uniform router gives alpha).

Why per sequence and not per forward (Switch computes it over the tokens of one device's batch): a mean
over sequences does not depend on how the global batch is cut into ranks and micro-batches, exactly like
the language-model loss, a mean over tokens. The block keeps ``aux_loss`` of its last forward; the model's
loss adds the blocks' (``moe_aux_loss``, called by ``refimpl.parallel.parallelized.Parallelized.
loss``), so it is divided by the micro-batches ``A`` and its gradient averaged over the ``dp x cp`` ranks
like the main loss: the trainer minimises ``1/(N A) sum_{ranks, micro-batches} (CE + sum_blocks L_aux)``,
the global mean over sequences of both, at any ``dp``, ``ep`` and micro-batch size (under ``cp``
``sequence_balance_loss`` sums each sequence's counts over the cp ranks). Under pipeline
parallelism each stage holds some blocks' losses: the executor adds the last stage's to the loss and
backpropagates every other stage's in that stage's backward (``refimpl.parallel.parallelized.
Parallelized.stage_balance_loss``), the same gradient. The layer's own per-forward
loss (``refimpl.parallel.expert_parallel.RouterConfig``'s ``aux_loss_coeff``) is kept at 0.

**Capacity** (``capacity_factor``) is the layer's: ``C = ceil(k T / E cf)`` slots per expert for the ``T``
tokens of one forward on one rank (GShard's group is a device's batch), so a run with capacity equals one
device only at the same micro-batch per rank. Dropless (None) routes each token on its own.

**Expert parallelism** (``MoEMLP.shard_experts``, applied by ``refimpl.parallel.expert_parallel_gpt.
apply_expert_parallel``): the model is built whole (every expert, so every ``ep`` draws the same weights)
and rank ``r`` of the ``ep`` group keeps experts ``[r E/ep, (r+1) E/ep)``. ``MoEMLP.local_shards``
declares those rows as boxes of the global ``[E, ...]`` tensors (the checkpoint reshards by them) and
``MoEMLP.expert_parallel_parameters`` names them (their placement: split over ``ep``, gradient
averaged over the expert-data-parallel group).

**Shared experts** (DeepSeekMoE, Dai et al. 2024; DeepSeek-V3 eq. 12): with ``moe_shared_experts = N_s``
the block also runs an always-on MLP of ``N_s x`` the expert width on every token and adds it,
``y_t = S(x_t) + sum_j w_{t,j} E_{I_tj}(x_t)`` (``SharedExperts``, ``MoEMLP.shared_experts``). Its
weights are dense ones, not under ``moe.experts.``: every rank holds them whole, expert parallelism leaves
them alone and their gradients are averaged over ``dp x cp`` like the attention's (under sequence
parallelism summed over tp too, as every parameter of the block: ``MoEMLP.sequence_parallel_parameters``).
Under expert parallelism they run while the dispatch's all-to-all carries the tokens to their experts
(DeepSeek-V3 section 3.2.2; ``MoE(x, beside=...)``): the same sum, its time hidden behind the transfer.
The first ``moe_first_dense`` blocks keep the dense MLP (DeepSeek-V3's ``first_k_dense_replace``:
``ModelConfig.is_moe_layer``).

The per-step bookkeeping (load per expert, dropped assignments, the aux loss, DeepSeek-V3's bias update)
is ``refimpl.moe_balance``.
"""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refimpl.comm import ops
from refimpl.config import ModelConfig
from refimpl.distributed.group_info import group_rank_size
from refimpl.distributed.placement import Box, LocalShard
from refimpl.nn.linear import Linear
from refimpl.parallel.expert_parallel import MoE

__all__ = ["EXPERT_TENSORS", "MoEMLP", "SharedExperts", "moe_aux_loss", "moe_blocks", "sequence_balance_loss"]

EXPERT_TENSORS = ("w1", "w3", "w2")
"""The grouped experts' 3-D weights (``w3``: SwiGLU only); under expert parallelism each rank holds rows."""


def sequence_balance_loss(scores: torch.Tensor, expert_ids: torch.Tensor, *, sequences: int, coeff: float,
                          score_func: str, cp_group: dist.ProcessGroup | None = None,
                          sp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``coeff E mean_b sum_i f_{b,i} P_{b,i}`` (module docstring) over ``sequences`` equal sequences of the
    ``T`` tokens: ``scores [T, E]`` (fp32, in the graph), ``expert_ids [T, k]``. One sequence is Switch's
    loss (``refimpl.parallel.expert_parallel.load_balancing_loss``) over its tokens.

    ``cp_group`` (context parallelism, chapter 07): this rank holds ``s / cp`` tokens of each sequence. The
    counts, which carry no gradient, are summed over the group, so ``f`` is the whole sequence's; ``P`` is
    the mean over this rank's tokens. The ``cp`` ranks' losses then average (as the trainer averages the
    ranks' losses over ``dp x cp``) to ``coeff E mean_b sum_i f_{b,i} mean_r P^{(r)}_{b,i}``, and the mean of
    the ranks' means over equal parts is the whole sequence's ``P``: the one-device loss and gradient.

    ``sp_group`` (sequence parallelism, chapter 06): the tensor-parallel ranks hold ``s / t`` tokens each
    too, and the counts are summed over them alike; but their losses are not averaged (every tp rank holds
    the same loss, and the gradients of the parameters that saw ``s / t`` tokens are *summed* over tp). So
    each rank returns ``L_r / t`` in the gradient (the tp sum of those gradients is the mean's) and the tp
    mean of the ``L_r`` in value (one all-reduce of a scalar): the same loss on every tp rank, one
    device's."""
    t, e = scores.shape
    if coeff == 0 or t == 0:
        return scores.new_zeros(())
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    ids = expert_ids.reshape(sequences, -1)  # [b, s k] (s: this rank's tokens of each sequence)
    counts = torch.zeros(sequences, e, dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=scores.dtype))  # [b, E] assignments per expert
    assignments = ids.shape[1]
    for group in (cp_group, sp_group):  # the whole sequences' counts (no gradient flows through f)
        parts = group_rank_size(group)[1] if group is not None else 1
        if parts > 1:
            ops.all_reduce(counts, group=group)
            assignments *= parts
    f = counts / assignments  # [b, E]: share of the sequence's s k assignments (no gradient)
    p = probs.reshape(sequences, t // sequences, e).mean(1)  # [b, E]: mean probability over its tokens
    loss = coeff * e * (f * p).sum(-1).mean()
    tp = group_rank_size(sp_group)[1] if sp_group is not None else 1
    if tp > 1:  # gradient of L_r / t, value the tp mean of the L_r (docstring)
        mean = loss.detach().clone()
        ops.all_reduce(mean, group=sp_group)
        loss = loss / tp + (mean / tp - loss.detach() / tp)
    return loss


class SharedExperts(nn.Module):
    """DeepSeekMoE's shared experts (module docstring): one bias-free MLP of width ``f_s =
    moe_shared_experts x expert_hidden_size`` with the experts' activation, ``[b, s, h] -> [b, s, h]``:
    SwiGLU ``(silu(x W_gate) * x W_up) W_2`` or GELU ``gelu(x W_1) W_2`` (exact GELU, as the routed
    experts). The dense MLP's layout and names (``refimpl.models.gpt.MLP``): ``dense_h_to_4h`` (SwiGLU:
    ``2 f_s`` rows, row ``2i`` gate ``i``, row ``2i + 1`` up ``i``) and ``dense_4h_to_h``, which
    ``GPT.reset_parameters`` scales as a residual output projection. Linears of the one linear seam."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.moe_shared_experts * config.expert_hidden_size
        self.swiglu = config.moe_activation == "swiglu"
        self.dense_h_to_4h = Linear(h, 2 * f if self.swiglu else f, bias=False)
        self.dense_4h_to_h = Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense_h_to_4h(x)  # [b, s, f_s] (SwiGLU: [b, s, 2 f_s])
        if self.swiglu:
            gate, up = y.view(*y.shape[:-1], -1, 2).unbind(-1)  # [b, s, f_s] each: rows 2i and 2i + 1
            return self.dense_4h_to_h(F.silu(gate) * up)
        return self.dense_4h_to_h(F.gelu(y))


class _MoEArgs(TypedDict):
    """The keyword arguments ``MoEMLP`` builds its ``MoE`` with (again, sharded, by ``shard_experts``)."""

    dim: int
    hidden: int
    num_experts: int
    top_k: int
    activation: str
    score_func: str
    normalize_topk: bool | None
    capacity_factor: float | None
    aux_loss_coeff: float
    expert_bias: bool
    seed: int


class MoEMLP(nn.Module):
    """The MLP of an MoE block (module docstring): ``forward(x [b, s, h]) -> [b, s, h]``; after a forward
    ``aux_loss`` (the sequence-wise balance loss, in the graph) and ``moe`` the layer (its routing,
    ``tokens_per_expert``, ``kept_per_expert``, ``dropped_fraction``). ``layer``: the block's index (the
    layer's seed; the GPT's ``reset_parameters`` draws the weights anyway). ``shared_experts``: the
    ``SharedExperts`` added to the routed output, None without (``moe_shared_experts = 0``)."""

    def __init__(self, config: ModelConfig, *, layer: int = 0) -> None:
        super().__init__()
        self.aux_loss_coeff = config.aux_loss_coeff
        self.score_func = config.score_func
        self.bias_update_rate = config.moe_bias_update_rate if config.moe_load_balance == "bias" else None
        self._kw = _MoEArgs(dim=config.hidden_size, hidden=config.expert_hidden_size,
                            num_experts=config.num_experts, top_k=config.top_k,
                            activation=config.moe_activation, score_func=config.score_func,
                            normalize_topk=config.moe_normalize_topk, capacity_factor=config.capacity_factor,
                            aux_loss_coeff=0.0, expert_bias=config.moe_load_balance == "bias", seed=layer)
        self.moe = MoE(**self._kw)
        self.shared_experts = SharedExperts(config) if config.moe_shared_experts else None
        self.aux_loss: torch.Tensor | None = None
        self.counters = None  # refimpl.moe_balance's per-step counters, set by its first record
        # context parallelism: the group whose ranks hold the other parts of each sequence (parallelize's
        # step 2 sets it); the balance loss sums its counts over it (sequence_balance_loss)
        self.cp_group: dist.ProcessGroup | None = None
        # sequence parallelism: the tensor-parallel group, whose ranks route s/t tokens each (parallelize's
        # step 1 sets it); the balance loss sums its counts over it, the router's and experts' gradients
        # are summed over it (sequence_parallel_parameters)
        self.sp_group: dist.ProcessGroup | None = None

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts  # DeepSeekMoE: every token through the shared experts too, added to
        # the routed output; under expert parallelism computed while the dispatch's tokens travel
        y = self.moe(x, beside=None if shared is None else (lambda: shared(x)))
        routing = self.moe.routing
        assert routing is not None  # the forward just set it
        self.aux_loss = sequence_balance_loss(routing.scores, routing.expert_ids,
                                              sequences=x.shape[0] if x.dim() == 3 else 1,
                                              coeff=self.aux_loss_coeff, score_func=self.score_func,
                                              cp_group=self.cp_group, sp_group=self.sp_group)
        return y

    @torch.no_grad()
    def shard_experts(self, ep_group: torch.distributed.ProcessGroup | None) -> None:
        """Keep this rank's experts ``[r E/ep, (r+1) E/ep)`` of the whole layer (built with every expert),
        routing over ``ep_group`` (GShard's all-to-all); the router stays whole (every rank routes its own
        tokens), and so do the shared experts (dense weights, untouched)."""
        if self.moe.ep_size != 1:
            raise ValueError("shard_experts takes a layer that holds every expert (it is already sharded)")
        old = self.moe
        new = MoE(**self._kw, ep_group=ep_group, device=old.router.gate.weight.device,
                  dtype=old.router.gate.weight.dtype)
        new.router.gate.weight.copy_(old.router.gate.weight)
        if old.router.expert_bias is not None:
            new.router.expert_bias.copy_(old.router.expert_bias)
        rows = slice(new.first_expert, new.first_expert + new.num_local_experts)
        for name in EXPERT_TENSORS:
            if getattr(old.experts, name) is not None:
                getattr(new.experts, name).copy_(getattr(old.experts, name)[rows])
                getattr(new.experts, name).requires_grad_(getattr(old.experts, name).requires_grad)
        new.router.gate.weight.requires_grad_(old.router.gate.weight.requires_grad)
        self.moe = new

    def sequence_parallel_parameters(self) -> list[str]:
        """Under sequence parallelism, the parameters applied to this tp rank's ``s/t`` tokens: the router's,
        the experts' and the shared experts' (their gradients summed over tp, ``refimpl.parallel.
        tensor_parallel.sequence_parallel_names``); none otherwise."""
        if self.sp_group is None:
            return []
        return [n for n, _ in self.named_parameters()]

    def expert_unit(self) -> nn.Module:
        """The module holding the expert tensors: ZeRO-3 shards it over the expert-data-parallel group."""
        return self.moe.experts

    def expert_parallel_parameters(self) -> list[str]:
        """The names (relative to this module) of the expert tensors, split over ``ep``."""
        return [f"moe.experts.{n}" for n in EXPERT_TENSORS if getattr(self.moe.experts, n) is not None]

    def local_shards(self) -> dict[str, LocalShard]:
        """Every tensor whole (the router, the shared experts) but the experts': rows ``[first, first +
        E/ep)`` of the global ``[E, ...]``."""
        experts = set(self.expert_parallel_parameters())
        own = [*self.named_parameters(), *((n, b) for n, b in self.named_buffers() if b is not None)]
        out = {}
        for name, t in own:
            box = Box.full(t.shape)
            if name in experts:
                box = Box.full((self.moe.num_experts, *t.shape[1:])).narrow(0, self.moe.first_expert,
                                                                          self.moe.num_local_experts)
            out[name] = LocalShard(t, box)
        return out

    def extra_repr(self) -> str:
        return f"aux_loss_coeff={self.aux_loss_coeff}, balance={'bias' if self.bias_update_rate else 'aux'}"


def moe_blocks(model: nn.Module) -> list[MoEMLP]:
    """The MoE MLPs of ``model`` (any wrapper of a GPT), in module order; [] for a dense model."""
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the MoE blocks' balance losses of the last forward (None for a dense model): what the
    model's loss adds (module docstring)."""
    losses = [m.aux_loss for m in moe_blocks(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
