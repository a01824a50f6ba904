# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Mixture of experts and expert parallelism
#
# A dense transformer spends the same FLOPs on every token for every parameter it has: to make the model
# larger is to make every token more expensive. A **mixture of experts** (MoE) breaks that link. The MLP
# of a block becomes $E$ expert MLPs and a small **router**, and each token is sent to only $k$ of them
# (Shazeer et al. 2017, "Outrageously Large Neural Networks"). The model holds $E$ experts' parameters,
# but a token pays for $k$. Every open model at the "trillion parameters" scale is built this way
# (GShard, Switch Transformer, Mixtral, DeepSeek-V3, Kimi K2), and the Ultra-Scale Playbook counts
# **expert parallelism** as the fifth dimension of parallelism, beside data, tensor, context and pipeline:
# the experts of a layer live on different ranks, and two **all-to-alls** carry each token to the rank of
# its experts and back (Lepikhin et al. 2020, "GShard").
#
# Everything here lives in `refimpl.parallel.expert_parallel`: the router, its balance losses and capacity
# (`router`), the experts one by one or grouped into one matmul (`experts`), the dispatch bookkeeping
# (`dispatch`), the autograd all-to-alls (`expert_parallel_communications`) and the layer, `MoE`
# (`expert_parallel`); the GPT's MoE block is `refimpl.models.moe`, the trainer's per-step load and bias update
# `refimpl.moe_balance`. This chapter shows, and proves with assertions:
#
# 1. a token costs $6N_\text{active}$ FLOPs, not $6N_\text{total}$: the planner's count for a
#    DeepSeek-V3-sized model, and FLOPs measured by PyTorch's counter on an MoE layer equal to the formula;
# 2. the router: top-$k$ of softmax scores, renormalised when $k > 1$ (at $k = 1$ renormalising would
#    leave the router without a gradient: measured); the Switch balance loss computed by hand equal to
#    refimpl's bit for bit, and not smallest at uniform routing; DeepSeek-V3's bias changes which experts
#    are chosen, not their weights; capacity $C = \lceil kT/E \cdot cf \rceil$ drops exactly the
#    lowest-scored assignments beyond it (refimpl's policy; GShard and Switch drop by position);
# 3. the grouped experts (one `torch._grouped_mm` per projection) equal the per-expert loop;
# 4. on 4 ranks: the dispatch bookkeeping with uneven (and empty) splits; the layer at ep = 2 and 4 equal
#    to one device in outputs **and every gradient**, and the data-parallel step's gradients equal to one
#    device's; the all-gather dispatcher equal to the all-to-all one; two broken variants (expert
#    gradients $ep$ times too large, counts not exchanged) that fail the same check; the bytes each rank
#    sends equal to the formula from the routed counts;
# 5. load balance measured while training: no balancing, the balance loss, the expert bias;
# 6. the trainer, `python -m refimpl.train --ep 2`, trains like one device and reports its experts' load,
#    alone and with the pipeline, context and sequence parallelism.

# %%
import contextlib
import dataclasses
import io
import json
import shutil
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from refimpl.config import DEEPSEEK_V3, DataConfig, ModelConfig, OptimConfig, TrainConfig
from refimpl.data import make_corpus_file
from refimpl.distributed import DistributedContext
from refimpl.launch import start_ranks
from refimpl.measure import order_tolerance
from refimpl.models import GPT, lm_loss
from refimpl.parallel.expert_parallel import (
    ExpertMLP,
    GroupedExperts,
    MoE,
    RouterConfig,
    TopKRouter,
    expert_capacity,
    load_balancing_loss,
)
from refimpl.planner import PEAK_FLOPS, flops_per_token, param_count
from refimpl.planner.presets import MODEL_PRESETS, printed_like
from refimpl.train import RunOptions, train

torch.set_num_threads(1)  # tiny matrices: one thread is as fast, and leaves the other core to the ranks
WORK = Path(tempfile.mkdtemp(prefix="ch09-"))
FACTOR = 4.0  # tolerance = FACTOR x a spread measured in the same run (the numerics rule)
print("torch", torch.__version__, "| work folder", WORK)

# %% [markdown]
# ## 1. Why experts: FLOPs per token
#
# The training FLOPs of a token are $6N + 12LHQT$ (chapter 01; PaLM appendix B): $2N$ forward and $4N$
# backward for the $N$ weights its matrix multiplies use, plus attention. In an MoE block a token uses the
# router and $k$ of the $E$ experts, so $N$ is the **active** parameters, $N_\text{active} = N_\text{total}
# - \sum_\text{MoE blocks} (E - k) \cdot (\text{one expert})$ (`refimpl.planner.param_count(...).active`).
#
# DeepSeek-V3 in our `ModelConfig` (`refimpl.planner.presets.MODEL_PRESETS["deepseek-v3"]`, the model
# card's shape in the model's DeepSeek-V3 form, `refimpl.config.DEEPSEEK_V3`): its width, depth, heads,
# vocabulary, multi-head latent attention (`refimpl.models.mla`: keys and values through a 512-wide
# latent), the first 3 blocks dense, then 256 routed experts of width 2048 (SwiGLU), 8 per token, and one
# shared expert every token passes through. The counts land on the published ones to the digits printed
# (the activated size is the weights a token multiplies; counting the embedding table it would be
# 37.6B). The dense model of the same size is the same configuration with every expert active ($k = E$). The
# budget: chapter 00's cluster, 2048 H100s, at a realistic 40% MFU (about 810 PFLOP/s; not the 3.2 PFLOP/s
# of the claim chapter 00 examined, which is 0.16% MFU and cannot stand beside its "82% utilisation"), for
# three weeks. DeepSeek-V3's report gives a check of that rate: 14.8T tokens of pre-training in 2.664M
# H800 GPU hours (the H800's dense BF16 peak is the H100's 989 TFLOP/s; most of their matrix multiplies
# ran in FP8, whose peak is twice that, so this is an MFU against the BF16 peak).

# %%
DSV3_PRESET = MODEL_PRESETS["deepseek-v3"]  # DeepSeek-V3 technical report: 671B total, 37B activated
DSV3 = DSV3_PRESET.config(max_seq_len=4096)
DENSE = dataclasses.replace(DSV3, top_k=DSV3.num_experts)  # every expert for every token
GPUS, MFU, DAYS = 2048, 0.40, 21
RATE = GPUS * MFU * PEAK_FLOPS["H100"]["bf16"]  # FLOP/s sustained: 810 PFLOP/s
budget = RATE * DAYS * 86400
rows = {}
for name, cfg in (("MoE, top 8 of 256", DSV3), ("dense, same parameters", DENSE)):
    counts = param_count(cfg)
    fpt = flops_per_token(cfg, seq_len=4096)
    rows[name] = (counts.total, counts.active, fpt, budget / fpt)
print(f"{'':24s} {'total':>9s} {'active':>9s} {'FLOPs/token':>12s} "
      f"{f'tokens in {DAYS} days at {RATE / 1e15:.0f} PFLOP/s':>34s}")
for name, (total, active, fpt, tokens) in rows.items():
    print(f"{name:24s} {total / 1e9:8.0f}B {active / 1e9:8.1f}B {fpt / 1e9:10.0f} G {tokens / 1e9:32.1f} B")
moe_row, dense_row = rows["MoE, top 8 of 256"], rows["dense, same parameters"]
published_mfu = 14.8e12 * moe_row[2] / (2.664e6 * 3600 * PEAK_FLOPS["H100"]["bf16"])
print(f"DeepSeek-V3's 14.8T tokens in 2.664M GPU hours at these FLOPs per token: {published_mfu:.0%} MFU "
      f"(the budget assumes {MFU:.0%})")
multiplied = param_count(DSV3).matmul  # the weights a token multiplies (no embedding lookup, no norms)
print(f"published: {DSV3_PRESET.published} total, {DSV3_PRESET.published_active} activated; ours "
      f"{printed_like(moe_row[0], DSV3_PRESET.published)}, {multiplied / 1e9:.1f}B multiplied per token | "
      f"the MoE trains {moe_row[3] / dense_row[3]:.1f} x the tokens of the dense model for the same FLOPs")
assert moe_row[0] == dense_row[0] and dense_row[1] == dense_row[0], "same parameters; dense: all active"
assert printed_like(moe_row[0], DSV3_PRESET.published) == DSV3_PRESET.published
assert printed_like(multiplied, DSV3_PRESET.published_active) == DSV3_PRESET.published_active
assert abs(published_mfu / MFU - 1) < 0.25, "the assumed MFU is of the order of a published MoE run's"

# %% [markdown]
# **Checked, not assumed.** Two claims hide in that table: that `param_count` counts the model we build,
# and that a token really costs $6N_\text{active}$. The first is a count of a built tiny MoE GPT's
# tensors, and the expert we subtract is measured from the module. For the second, PyTorch's
# `FlopCounterMode` counts the FLOPs of every matrix multiply in a forward and backward of one MoE layer
# (the experts as plain `nn.Linear` modules, `MoE.from_modules`, so that the counter sees each one), and
# they must equal $6T(hE + k \cdot \text{expert})$ for $T$ tokens: the router and $k$ experts per token.
# Then the DeepSeek-V3 form in miniature (multi-head latent attention with both latents, a dense first
# block, a shared expert): its count is the built model's, and a whole forward and backward costs what the
# table's formula says, $6 N_\text{mult}$ for the weights a token multiplies plus the attention's
# $6 L a (d_{qk} + d_v) s$ (the scores over the query/key width, the weighted sum over the value width).

# %%
tiny = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=16, num_experts=8,
                   top_k=2)
model = GPT(tiny)
block0 = model.layers[0].mlp.moe.experts
expert_numel = block0.w1[0].numel() + block0.w2[0].numel()  # one expert of block 0 (GELU: two matrices)
counts = param_count(tiny)
assert counts.total == sum(p.numel() for p in model.parameters()), "the planner counts the built model"
assert counts.active == counts.total - len(tiny.moe_layers) * (tiny.num_experts - tiny.top_k) * expert_numel

H1, E1, K1, F1, T1 = 8, 8, 2, 16, 24
torch.manual_seed(0)
layer = MoE.from_modules(nn.Linear(H1, E1, bias=False), [ExpertMLP(H1, F1, "gelu") for _ in range(E1)],
                         top_k=K1)
x1 = torch.randn(T1, H1, requires_grad=True)
with FlopCounterMode(display=False) as counter:
    y1 = layer(x1)
    ((y1 * y1).sum() + layer.aux_loss).backward()
measured_flops = counter.get_total_flops()
formula_flops = 6 * T1 * (H1 * E1 + K1 * 2 * H1 * F1)
print(f"tiny GPT: {counts.total:,d} parameters, {counts.active:,d} active | one MoE layer, T = {T1}: "
      f"FlopCounterMode {measured_flops:,d} FLOPs, 6 T (hE + k expert) = {formula_flops:,d}")
assert measured_flops == formula_flops

tiny_ds = ModelConfig(**{**DEEPSEEK_V3, "num_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
                         "ffn_hidden_size": 48, "vocab_size": 64, "max_seq_len": 16, "q_lora_rank": 24,
                         "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
                         "num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 20, "moe_shared_experts": 1,
                         "moe_first_dense": 1})
model_ds = GPT(tiny_ds, seed=1).double()  # float64: the experts' per-expert loop, plain matmuls
assert param_count(tiny_ds).total == sum(p.numel() for p in model_ds.parameters())
ids_ds = torch.randint(0, tiny_ds.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
    lm_loss(model_ds(ids_ds[:, :-1]), ids_ds[:, 1:]).backward()
ds_formula = flops_per_token(tiny_ds, 16, matmul_only=True) * 2 * 16
print(f"tiny DeepSeek-V3 form: {param_count(tiny_ds).total:,d} parameters (the model's numel); a step of 2 x 16 "
      f"tokens: FlopCounterMode {counter.get_total_flops():,d} FLOPs, the formula {ds_formula:,.0f}")
assert counter.get_total_flops() == ds_formula

# %% [markdown]
# What MoE does **not** save: memory. Every expert's weights, gradients and optimizer state must live
# somewhere, all of them, whichever tokens come. That is what expert parallelism (section 4) spreads over
# ranks, and why MoE models are trained on many devices even when their FLOPs would fit on fewer.
#
# ## 2. The router, on one process
#
# For $T$ tokens the router computes logits $z = xW^\top$ in fp32 ($W$: `[E, h]`), scores
# $s = \text{softmax}(z)$ (Switch, Mixtral; DeepSeek-V3 uses $\text{sigmoid}(z)$, each expert judged
# alone) and picks each token's top $k$; their scores are the **combine weights**,
# $y_t = \sum_j w_{t,j} E_{I_{tj}}(x_t)$, renormalised to sum to one when $k > 1$ (GShard's top-2,
# Mixtral, DeepSeek-V3). Here the router's weight is the identity, so the logits are the input itself:

# %%
def identity_router(**kw):
    cfg = RouterConfig(**{"num_experts": 4, "top_k": 2, **kw})
    gate = nn.Linear(cfg.num_experts, cfg.num_experts, bias=False)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(cfg.num_experts))
    return TopKRouter(gate, cfg)


logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, -1.0, 0.5, 4.0], [1.0, 2.0, -2.0, 1.5],
                       [2.0, 0.0, 0.0, 1.0]])
routing = identity_router()(logits)
for t in range(4):
    print(f"token {t}: scores {[round(v, 3) for v in routing.scores[t].tolist()]} -> experts "
          f"{routing.expert_ids[t].tolist()}, weights {[round(v, 3) for v in routing.weights[t].tolist()]}")
picked = logits.softmax(-1).gather(1, routing.expert_ids)
assert torch.equal(routing.weights, picked / picked.sum(-1, keepdim=True)), "top-k of softmax, renormalised"
assert routing.expert_ids.tolist() == [[0, 2], [3, 2], [1, 3], [0, 3]]

# %% [markdown]
# **Why not at $k = 1$.** The router learns from the task only through the combine weights: the choice
# itself, a top-$k$, has no gradient. At $k = 1$ a renormalised weight is $s/s = 1$ whatever the logits,
# so the task's loss gives the router nothing, and only the balance loss would move it. Switch, which
# routes each token to one expert, multiplies the expert's output by the raw probability $p_i(x)$
# (Fedus et al. 2021, eq. 2), and so does refimpl at $k = 1$ (`RouterConfig.normalize_topk`: default
# $k > 1$; the trainer's `--moe-normalize-topk` / `--no-moe-normalize-topk` force it). Measured: the
# router's gradient from a loss of one layer's output alone (balance loss 0), at $k = 1$ with and
# without renormalising, and at $k = 2$:

# %%
xr, gr = (torch.randn(32, 8, generator=torch.Generator().manual_seed(s)) for s in (20, 21))
router_grad = {}
for k, normalize in ((1, False), (1, True), (2, True)):
    moe = MoE(dim=8, hidden=16, num_experts=4, top_k=k, normalize_topk=normalize, aux_loss_coeff=0.0, seed=2)
    (moe(xr) * gr).sum().backward()
    router_grad[k, normalize] = moe.router.gate.weight.grad.norm().item()
    print(f"k = {k}, {'renormalised' if normalize else 'raw score   '}: |router gradient| "
          f"{router_grad[k, normalize]:.2e}")
assert 0.1 < router_grad[1, False] / router_grad[2, True] < 10, "top-1 with the raw score learns like top-2"
assert router_grad[1, True] < 1e-5 * router_grad[2, True], "top-1 renormalised: no gradient from the task"

# %% [markdown]
# **The balance loss** (Switch, eq. 4). Nothing in the language-model loss asks the router to spread the
# tokens; left alone, a few experts win early, get better, win more, and the others idle. Switch adds
#
# $$L_\text{aux} = \alpha \, E \sum_i f_i P_i ,$$
#
# with $f_i$ the fraction of the $Tk$ assignments routed to expert $i$ (a count: no gradient) and $P_i$
# the mean score of expert $i$ over the tokens (differentiable). Uniform routing ($f_i = P_i = 1/E$) gives
# $\alpha$, which the factor $E$ keeps the same for any $E$. Switch says the loss "is minimized under a
# uniform distribution"; that holds for the soft version of it ($f = P$: $E \sum_i P_i^2 \ge 1$ by
# Cauchy-Schwarz, equal only at uniform), **not** for the loss itself, whose $f$ counts hard choices: when
# the experts chosen most are chosen with low probability, $\sum_i f_i P_i$ drops below $1/E$ (an example
# below gives $0.906\,\alpha$). What balances the load is the gradient: $f$ is a constant, so
# $\partial L / \partial P_i = \alpha E f_i$ pushes each expert's mean probability down in proportion to
# its load. By hand, on scores that are exact binary fractions (so every step is exact):

# %%
scores = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.5, 0.125, 0.125],
                       [0.125, 0.125, 0.5, 0.25], [0.5, 0.125, 0.25, 0.125]])
ids = torch.topk(scores, 2).indices
alpha, E_, T_, k_ = 0.5, 4, 4, 2
f = [sum(int(e == i) for e in ids.flatten().tolist()) / (T_ * k_) for i in range(E_)]  # counted
P = [sum(scores[t, i].item() for t in range(T_)) / T_ for i in range(E_)]              # column means
by_hand = alpha * E_ * sum(fi * pi for fi, pi in zip(f, P, strict=True))
ours = float(load_balancing_loss(scores, ids, alpha, "softmax"))
uniform = float(load_balancing_loss(torch.full((4, 4), 0.25), torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]),
                                    alpha, "softmax"))
# below uniform: three tokens choose experts 0 and 1 by a hair, one chooses 2 and 3 with conviction
hair, sure = [17 / 64, 17 / 64, 15 / 64, 15 / 64], [1 / 64, 1 / 64, 31 / 64, 31 / 64]
skewed = torch.tensor([hair, hair, hair, sure])
below = float(load_balancing_loss(skewed, torch.topk(skewed, 2).indices, alpha, "softmax"))
print(f"f = {f}, P = {P}\nby hand: alpha E sum f P = {by_hand} | refimpl: {ours} | "
      f"perfectly uniform: {uniform} = alpha | f = (3/8, 3/8, 1/8, 1/8), P = (13/64, 13/64, 19/64, 19/64): "
      f"{below} = {below / alpha} alpha")
assert ours == by_hand and uniform == alpha
assert below == alpha * 4 * (2 * 3 / 8 * 13 / 64 + 2 * 1 / 8 * 19 / 64) == 0.90625 * alpha < alpha
router = identity_router(aux_loss_coeff=alpha)
r = router(torch.randn(6, 4, generator=torch.Generator().manual_seed(5)))
assert torch.equal(r.balance_loss, load_balancing_loss(r.scores, r.expert_ids, alpha, "softmax"))

# %% [markdown]
# **DeepSeek-V3's bias** (the "auxiliary-loss-free" balancing). A balance loss pulls the router's
# gradient away from the language-model loss. DeepSeek-V3 instead adds a per-expert bias $b_i$ to the
# scores **for the choice only**: $I_t = \text{topk}_i(s_{t,i} + b_i)$, while the combine weights stay
# $s_{t,i}$ renormalised. Before each optimizer step, $b_i \mathrel{+}= u\,\text{sign}(\bar c - c_i)$
# with $c_i$ the tokens expert $i$ received: an overloaded expert becomes less attractive. Below, a bias
# of 2 on expert 3 (sigmoid scores lie in (0, 1)) makes every token choose it, and the weights are still
# the scores' own:

# %%
router = identity_router(score_func="sigmoid", expert_bias=True)
x2 = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
before = router(x2)
with torch.no_grad():
    router.expert_bias[3] = 2.0
after = router(x2)
picked = after.scores.gather(1, after.expert_ids)
print("tokens choosing expert 3: before", int((before.expert_ids == 3).any(1).sum()), "of 8, with the bias",
      int((after.expert_ids == 3).any(1).sum()), "of 8")
assert not (before.expert_ids == 3).any(1).all() and (after.expert_ids == 3).any(1).all()
assert torch.equal(after.weights, picked / picked.sum(-1, keepdim=True)), "the bias is not in the weights"
with torch.no_grad():
    router.expert_bias.zero_()
load = torch.tensor([10, 2, 4, 0])  # mean 4
assert router.update_expert_bias(load, 0.5).tolist() == [-0.5, 0.5, 0.0, 0.5]  # b += u sign(mean - c)

# %% [markdown]
# **Capacity.** On a device, an expert's tokens are a matrix of as many rows as tokens were routed to it:
# with a fixed budget (static shapes, memory), GShard and Switch give each expert
# $C = \lceil kT/E \cdot cf \rceil$ slots for the $T$ tokens of a forward, $cf$ the **capacity factor**.
# An expert chosen by more assignments **drops** some: a dropped assignment contributes zero (the
# residual connection around the block carries its token on). Which ones is a policy. GShard and Switch
# drop **by position**: an expert's slots go to its assignments in token order (GShard first places every
# token's first choice, then the second choices), and whatever comes after the $C$-th is dropped, however
# high its score. refimpl keeps the $C$ with the **highest scores** instead, Megatron-LM's default
# (`moe_token_drop_policy="probs"`; its `"position"` is GShard's). refimpl's default is dropless
# (`capacity_factor=None`). The dropped fraction follows from the loads:
# $\sum_i \max(0, c_i - C) / (Tk)$. Measured on 64 random tokens, 8 experts, top 2:

# %%
xc = torch.randn(64, 8, generator=torch.Generator().manual_seed(8))
drops = {}
for cf in (None, 1.0, 1.25, 2.0):
    moe = MoE(dim=8, hidden=16, num_experts=8, top_k=2, capacity_factor=cf, seed=1)
    moe(xc)
    rt = moe.routing
    C = expert_capacity(64, 2, 8, cf)
    loads = moe.tokens_per_expert
    formula = 0.0 if C is None else float((loads - C).clamp(min=0).sum()) / (64 * 2)
    assert moe.dropped_fraction == formula, (cf, moe.dropped_fraction, formula)
    if C is not None:
        assert torch.equal(moe.kept_per_expert, loads.clamp(max=C))
        for e in range(8):  # which assignments drop: every kept score >= every dropped one, per expert
            mine = rt.expert_ids == e
            kept = rt.scores[:, e][(mine & rt.keep).any(1)]
            dropped = rt.scores[:, e][(mine & ~rt.keep).any(1)]
            assert dropped.numel() == 0 or kept.min() >= dropped.max(), (cf, e)
    drops[cf] = moe.dropped_fraction
    print(f"cf = {cf!s:4s}: C = {C!s:4s} | tokens per expert {loads.tolist()} | "
          f"kept {moe.kept_per_expert.tolist()} | dropped {moe.dropped_fraction:.1%}")
assert drops[None] == 0 <= drops[2.0] <= drops[1.25] < drops[1.0], drops

# %% [markdown]
# Even a random router is uneven enough to drop assignments at $cf = 1$: capacity makes balance a
# matter of quality, not only of speed.
#
# ## 3. Grouped experts: one matmul for all of them
#
# The experts get their tokens **sorted by expert**: rows `[0, c_0)` for expert 0, the next $c_1$ for
# expert 1, and so on. The readable way runs them one by one (`GroupedExperts.forward_loop`, or
# `LoopedExperts` over any modules): $E$ small matmuls per projection, each with its launch cost and
# poor utilisation. The grouped way stacks the weights into `[E, h, f]` and calls
# `torch._grouped_mm(x, w, offs=ends)` once per projection: rows `[ends[i-1], ends[i])` times `w[i]`
# (torchtitan's and Megatron-LM's "grouped GEMM"). Counted at the operator level (a
# `TorchDispatchMode` that records each ATen call), with an expert that received no token, and checked
# against the loop: the tolerance is the loop's own distance from float64, times `FACTOR`.

# %%
class CountOps(TorchDispatchMode):
    """Counts the ATen operators a block of code runs."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


sizes = [3, 0, 5, 4]  # rows per expert, expert 1 received none
xg, gy = (torch.randn(12, 8, generator=torch.Generator().manual_seed(s)) for s in (8, 9))
results = {}
for name, dtype in (("grouped", torch.float32), ("loop", torch.float32), ("loop64", torch.float64)):
    experts = GroupedExperts(dim=8, hidden=16, num_experts=4, generator=torch.Generator().manual_seed(0))
    experts = experts.to(dtype)
    xi = xg.to(dtype).clone().requires_grad_()
    with CountOps() as ops_seen:
        y = (experts if name == "grouped" else experts.forward_loop)(xi, sizes)
    y.backward(gy.to(dtype))
    results[name] = ({"y": y.detach(), "dx": xi.grad, **{n: p.grad for n, p in experts.named_parameters()}},
                     {k: v for k, v in ops_seen.counts.items() if "mm" in k})
for key in results["grouped"][0]:
    spread = (results["loop64"][0][key] - results["loop"][0][key].double()).abs().max().item()
    err = (results["grouped"][0][key] - results["loop"][0][key]).abs().max().item()
    print(f"{key:3s}: |grouped - loop| {err:.1e}, tolerance {FACTOR} x {spread:.1e}")
    assert err <= FACTOR * spread and spread > 0, key
print("matmul operators in forward: grouped", results["grouped"][1], "| loop", results["loop"][1])
assert results["grouped"][1] == {"_grouped_mm": 3} and results["loop"][1] == {"mm": 3 * 4}  # SwiGLU: 3
assert all(results["grouped"][0][n][1].abs().max() == 0 for n in ("w1", "w2", "w3")), "no token, no gradient"

# %% [markdown]
# ## 4. Expert parallelism on four ranks
#
# With $N$ ranks in an expert-parallel group, rank $r$ keeps experts $[rE/N, (r+1)E/N)$, and every rank
# routes **its own** tokens. The all-to-all dispatcher (GShard; `dispatch_all_to_all`):
#
# 1. sort this rank's kept assignments by expert (`sort_by_expert`): the rows for rank $q$ are then one
#    contiguous block, and the **input split sizes** are the counts summed per owner (`rank_splits`);
# 2. **exchange the counts**: one all-to-all of $E$ integers tells every rank how many rows each peer will
#    send for each of its local experts, hence its **output split sizes** (`exchange_counts`);
# 3. one uneven `all_to_all_single` of the token rows (`all_to_all_tokens`), which arrive rank-major;
#    a permutation makes them expert-major for the grouped matmul (`expert_major_order`);
# 4. the reverse all-to-all brings the outputs home, and `combine` weights and sums each token's $k$.
#
# The backward of an all-to-all is the all-to-all with the splits swapped: the conjugate pair is the
# function itself. Step 2 is what makes the splits agree: gloo takes uneven and zero sizes in
# `all_to_all_single`, but each side must name the same numbers.
#
# One cluster of 4 ranks serves both sizes: the world is one ep group of 4, and {0, 1} and {2, 3} are two
# ep groups of 2 that run the same experiment side by side. The layer: $h = 8$, 8 experts (SwiGLU,
# width 16), top 2, 12 tokens per rank. Experts 6 and 7 are made unreachable with an expert bias of $-10$
# (scores lie in (0, 1)), so at ep = 4 rank 3 owns two experts that nobody chooses: zero splits.

# %%
ranks = start_ranks(4, timeout_s=120)
ranks

# %%
# %%px
import datetime
import math

from refimpl.comm import CommTracer
from refimpl.parallel.expert_parallel import (
    MoE,
    all_to_all_tokens,
    combine,
    concat_routings,
    dispatch_all_to_all,
    expert_major_order,
    inverse_permutation,
    permute,
    rank_splits,
    sort_by_expert,
)

timeout = datetime.timedelta(seconds=120)
pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]  # every rank
ep_groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
H, F, E, K, T = 8, 16, 8, 2, 12
DEAD = [6, 7]
FACTOR = 4.0
EXPERT = ("w1", "w3", "w2")
PARAMS = ("router", *EXPERT)
X = torch.randn(4, T, H, generator=torch.Generator().manual_seed(10))  # every rank's tokens, known to all
G = torch.randn(4, T, H, generator=torch.Generator().manual_seed(11))  # loss = sum(G * y) + aux


def build(group, dispatcher="alltoall"):
    """The same layer on every rank (drawn from one seed), holding this rank's experts of ``group``."""
    moe = MoE(dim=H, hidden=F, num_experts=E, top_k=K, expert_bias=True, ep_group=group,
              dispatcher=dispatcher, seed=3)
    with torch.no_grad():
        moe.router.expert_bias[DEAD] = -10.0  # experts 6 and 7: never chosen
    return moe.to(device)


# the dispatch bookkeeping at ep = 4, step by step
moe4 = build(ep_groups[4])
routing = moe4.router(X[rank].to(device))
d = dispatch_all_to_all(X[rank].to(device), routing, num_experts=E, group=ep_groups[4])
book = {"per expert": d.plan.counts.tolist(), "input splits": d.input_splits,
        "output splits": d.output_splits, "rows per local expert": d.counts,
        "received": tuple(d.tokens.shape)}

# %%
books = ranks.run(lambda: book)
for r, b in enumerate(books):
    print(f"rank {r}: routes {b['per expert']} per expert | sends {b['input splits']} | receives "
          f"{b['output splits']} -> {b['rows per local expert']} for its experts {2 * r}, {2 * r + 1}")
sent = np.array([b["input splits"] for b in books])  # [src, dst]
assert all(books[q]["output splits"][r] == sent[r, q] for r in range(4) for q in range(4)), "splits agree"
assert all(sum(b["rows per local expert"]) == sum(b["output splits"]) == b["received"][0] for b in books)
assert sent[:, 3].sum() == 0 and any(len(set(row)) > 1 for row in sent.tolist()), "rank 3 empty; uneven"
fig, ax = plt.subplots(figsize=(4.2, 3.4))
im = ax.imshow(sent, cmap="Blues")
for r in range(4):
    for q in range(4):
        ax.text(q, r, int(sent[r, q]), ha="center", va="center")
ax.set_xlabel("to rank (owner of experts 2q, 2q+1)")
ax.set_ylabel("from rank")
ax.set_title("token rows in the dispatch all-to-all, ep = 4")
fig.colorbar(im)
fig.tight_layout()

# %% [markdown]
# Each rank's output split sizes are exactly what the others said they would send (the counts exchange),
# the splits are uneven, and rank 3 receives nothing.
#
# **Against one device.** The reference processes all ranks' tokens on one device. Two details make it
# the same computation: each rank's router sees only its own tokens, so the reference routes each rank's
# chunk on its own and concatenates the routings (`concat_routings`: the balance losses are per chunk,
# and so would capacity be), then runs the experts once (`MoE.forward_routed`). We compare the outputs,
# the input gradients, the router's gradient (summed over the ep group: every rank's router saw only its
# tokens) and each rank's experts' gradients (its rows of the `[E, ...]` tensors), all before any
# optimizer.
#
# The tolerance: the reference run again with the ranks' chunks in reverse order and in float64 (the
# same sums in other orders and at another precision); per tensor, the largest distance of these from
# the reference is the **spread**, and ours must be within `FACTOR x spread`.
#
# **Then the data-parallel step.** The layer averages nothing: its loss is the sum of the ranks' losses.
# A trainer whose $N$ ranks each see their own tokens (here $dp = ep = N$, torchtitan's dp2ep with one
# ep group) minimises their **mean**, so one device's gradients of the mean are the reference's divided
# by $N$. The router is replicated, so its gradient is averaged over the $N$ ranks. An expert lives on
# one rank of the group, and its gradient there already sums every rank's tokens; the trainer sums it
# over the expert-data-parallel group (the ranks holding the same expert: here only itself) and divides
# by $N = dp \times cp$, the global count, as for the dense weights (`refimpl/parallel/expert_parallel_gpt.py`).
# The first negative control is the mistake of pytorch/pytorch#160285: the expert gradients **averaged
# over the expert-data-parallel group** instead ($1/edp = ep/N$; here not divided at all, since
# $edp = 1$), which hands the optimizer expert gradients $ep$ times too large; AdamW hides it, and the
# loss curves look the same. The second: a dispatch that does not exchange the counts but assumes every
# expert gets the same number of rows. The tracer records every collective, and the bytes each rank sends
# to others must equal $(\text{rows sent to others} + \text{rows returned to others}) \times h \times 4$
# from the routed counts.

# %%
# %%px
def run(moe, x, g):
    """Output and every gradient of sum(g * moe(x)) + aux; the collectives of forward (tracer step 0)
    and backward (1)."""
    x = x.clone().requires_grad_()
    with CommTracer() as tracer:
        y = moe(x)
        loss = (y * g).sum() + moe.aux_loss
        tracer.step()
        loss.backward()
    out = {"y": y.detach(), "dx": x.grad, "router": moe.router.gate.weight.grad}
    return out | {n: getattr(moe.experts, n).grad for n in EXPERT}, tracer


def reference(n, order="natural", dtype=torch.float32):
    """One device, the n ranks' tokens; routing (and its loss) per rank's chunk, experts once."""
    moe = build(None).to(dtype)
    x = X[:n].to(device, dtype).clone().requires_grad_()
    chunks = list(range(n))[::-1] if order == "reversed" else list(range(n))
    routings = [moe.router(x[q]) for q in chunks]
    y = moe.forward_routed(torch.cat([x[q] for q in chunks]), concat_routings(routings))
    parts = dict(zip(chunks, y.split(T), strict=True))
    y = torch.stack([parts[q] for q in range(n)])
    ((y * G[:n].to(device, dtype)).sum() + sum(r.aux_loss for r in routings)).backward()
    out = {"y": y.detach(), "dx": x.grad, "router": moe.router.gate.weight.grad}
    ids = torch.cat([routings[chunks.index(q)].expert_ids for q in range(n)])
    return out | {k: getattr(moe.experts, k).grad for k in EXPERT}, ids


def mean_of_ranks(grads, n):
    """One device's gradients of the mean of the n ranks' losses from those of their sum (/ n: exact, n is
    a power of two); outputs and input gradients are the layer's, unchanged."""
    return {k: t / n if k in PARAMS else t for k, t in grads.items()}


def data_parallel_step(grads, n, expert_divisor=None):
    """What the trainer hands the optimizer with dp = ep = n (``grads``: the layer's, the router's already
    summed over the group): the router averaged over the n ranks, each expert summed over the
    expert-data-parallel group (one rank here: itself, so the sum is the gradient) and divided by
    ``expert_divisor`` (default the trainer's, n = dp x cp)."""
    divisor = n if expert_divisor is None else expert_divisor
    return {k: t / divisor if k in EXPERT else t / n if k == "router" else t for k, t in grads.items()}


def diff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def worst(ours, ref, spread, box):
    """Largest |ours - ref[box]| / (FACTOR x spread) over the tensors, and which (0 / 0 counts as 0)."""
    ratios = {}
    for k, t in ours.items():
        err = diff(t, ref[k][box[k]])
        ratios[k] = 0.0 if err == 0 else err / (FACTOR * spread[k]) if spread[k] > 0 else math.inf
    name = max(ratios, key=ratios.get)
    return ratios[name], name


def uniform_splits(group, x):
    """Negative control: the counts are not exchanged; every rank assumes each expert gets A / E rows."""
    moe = build(group)
    routing = moe.router(x)
    plan = sort_by_expert(routing.kept_ids, E)
    assumed = torch.full((E,), plan.order.numel() // E)
    splits = rank_splits(assumed, dist.get_world_size(group))
    recv = assumed.view(dist.get_world_size(group), -1)
    got = all_to_all_tokens(permute(x, plan), splits, splits, group)
    order = expert_major_order(recv)
    y = moe.experts(got[order], recv.sum(0).tolist())
    back = all_to_all_tokens(y[inverse_permutation(order)], splits, splits, group)
    return combine(back, routing.kept_weights, plan).detach()


check = {}
for n, group in ep_groups.items():
    q = dist.get_rank(group)
    natural, ids = reference(n)
    others = [reference(n, "reversed")[0]]
    exact, ids64 = reference(n, dtype=torch.float64)
    assert torch.equal(ids, ids64), "float64 routes the same tokens (else its spread means nothing)"
    others.append(exact)
    spread = {k: max(diff(o[k], t) for o in others) for k, t in natural.items()}
    for dispatcher in ("alltoall", "allgather"):
        moe = build(group, dispatcher)
        ours, tracer = run(moe, X[q].to(device), G[q].to(device))
        dist.all_reduce(ours["router"], group=group)  # the router saw only this rank's tokens
        rows = slice(moe.first_expert, moe.first_expert + moe.num_local_experts)
        box = {"y": q, "dx": q, "router": slice(None)} | {k: rows for k in EXPERT}
        check[n, dispatcher] = worst(ours, natural, spread, box)
        if dispatcher == "alltoall":
            mean_ref, mean_spread = mean_of_ranks(natural, n), mean_of_ranks(spread, n)
            check[n, "data-parallel step"] = worst(data_parallel_step(ours, n), mean_ref, mean_spread, box)
            edp = 1  # every expert on one rank of the group
            wrong = data_parallel_step(ours, n, expert_divisor=edp)  # averaged over edp (#160285)
            check[n, "experts averaged over edp"] = worst(wrong, mean_ref, mean_spread, box)
            norms = [(wrong[k].norm().item(), mean_ref[k][rows].norm().item()) for k in EXPERT]
            check[n, "too large by"] = [a / b for a, b in norms if b > 0]  # rank 3 at ep = 4: no tokens
            kept = [torch.zeros_like(moe.kept_per_expert) for _ in range(n)]
            dist.all_gather(kept, moe.kept_per_expert, group=group)
            kept = torch.stack(kept).view(n, n, -1).sum(2)  # [src, dst] rows, from the routed counts
            sent, received, own = int(kept[q].sum()), int(kept[:, q].sum()), int(kept[q, q])
            formula = (sent - own + received - own) * H * 4
            a2a = [[e for e in tracer.select(op="all_to_all", step=s)] for s in (0, 1)]
            assert [e.nbytes for e in a2a[0]] == [E * 8, sent * H * 4, received * H * 4], "counts, to, back"
            assert sum(e.wire_bytes for e in a2a[0][1:]) == formula == sum(e.wire_bytes for e in a2a[1])
            assert (moe.traffic.forward_bytes, moe.traffic.backward_bytes) == (formula, formula)
            check[n, "bytes"] = (formula, sum(e.wire_bytes for e in a2a[0][1:]), a2a[0][0].wire_bytes)
        else:
            check[n, "allgather bytes"] = {op: t.wire_bytes for op, t in tracer.summary(step=0).items()}
            # forward: the token count (int64), tokens (T h fp32), ids (T k int64), weights (T k fp32) and
            # the reduce-scatter of the partial outputs (N T h fp32), (N-1)/N of each (ring model)
            formula = (n - 1) * (8 + T * (4 * H + 8 * K + 4 * K + 4 * H))
            check[n, "allgather sent"] = (tracer.bytes_sent(step=0), formula, 2 * (n - 1) * T * H * 4, n / K)
    if n == 4:
        wrong = uniform_splits(group, X[q].to(device))
        check[n, "counts not exchanged"] = worst({"y": wrong}, natural, spread, {"y": q})
    assert check[n, "alltoall"][0] <= 1 and check[n, "allgather"][0] <= 1, (n, check)
    assert check[n, "data-parallel step"][0] <= 1, (n, check)

# %%
checks = ranks.run(lambda: check)
for n in (2, 4):
    for what in ("alltoall", "allgather", "data-parallel step", "experts averaged over edp") + (
            ("counts not exchanged",) if n == 4 else ()):
        ratios = [c[n, what] for c in checks]
        r, name = max(ratios)
        print(f"ep = {n} {what:25s}: worst over ranks {r:10.3g} x tolerance ({name})")
    scale = [x for c in checks for x in c[n, "too large by"]]
    print(f"ep = {n}: the control's expert gradients / one device's: {min(scale):.4f} to {max(scale):.4f}")
    assert scale and all(abs(x - n) < 1e-3 * n for x in scale), "the control is ep times too large"
    print(f"ep = {n}, token bytes each rank sends to others in forward: formula from the counts "
          f"{[c[n, 'bytes'][0] for c in checks]}, tracer {[int(c[n, 'bytes'][1]) for c in checks]} "
          f"(+ the count exchange, ring model: {int(checks[0][n, 'bytes'][2])} B)")
    gathered = [{op: int(b) for op, b in c[n, "allgather bytes"].items()} for c in checks]
    print(f"  all-gather dispatcher, tracer (ring model): {gathered}")
    ag = [c[n, "allgather sent"] for c in checks]
    assert all(sent == formula for sent, formula, _, _ in ag), ag
    ratio = sum(a[2] for a in ag) / sum(c[n, "bytes"][0] for c in checks)
    print(f"  all-gather: (N-1)(8 + T(4h + 12k + 4h)) = {ag[0][1]:,} B forward on every rank, the tracer's "
          f"too | its token bytes / the all-to-all's, all ranks: {ratio:.2f} (uniform routing: N/k = "
          f"{ag[0][3]:g})")
for n in (2, 4):
    assert max(c[n, "experts averaged over edp"][0] for c in checks) > 1, "ep x too large must fail"
assert max(c[4, "counts not exchanged"][0] for c in checks) > 100, "a dispatch without the counts must fail"

# %% [markdown]
# At both sizes the layer gives one device's outputs, input gradients, router gradient and expert
# gradients within the measured tolerance, with either dispatcher, and the data-parallel step hands the
# optimizer one device's gradients of the mean loss. The two controls fail the same check: the expert
# gradients averaged over the expert-data-parallel group come out $ep$ times one device's (2 and 4, to
# the printed digits), the direction of pytorch/pytorch#160285. (Rank 3's experts at ep = 4 have zero gradients
# in every variant, which is why that control is judged over all ranks.) The bytes the tracer measured
# from the split sizes are the formula's.
#
# **Two dispatchers.** Megatron-LM's default "allgather" dispatcher needs no counts: every rank gathers
# every rank's tokens and routing, computes its experts' share of every token, and a reduce-scatter sums
# the shares back to the tokens' owners. It moves $(N-1)Th$ elements in and as many out per rank whatever
# the routing, where the all-to-all moves only the rows that leave the rank, $\frac{N-1}{N}kTh$ each way
# under uniform routing: the all-gather moves $N/k$ times the all-to-all's bytes (twice at ep = 4, top 2;
# as many at ep = 2, top 2), never fewer while $k \le N$. What it buys is simplicity: no count exchange
# and no uneven splits. Megatron-LM, whose default it is, recommends the all-to-all once expert
# parallelism is applied. (Both sets of bytes are printed above: the all-gather's equal their formula,
# which also counts the gathered routing, and the measured ratio of token bytes sits near $N/k$, off it
# as far as this routing is not uniform; the all-gather and reduce-scatter figures are the ring model's,
# chapter 02.)
#
# ## 5. Load balance, measured
#
# Does balancing matter in training, and what does it cost? A toy task that rewards specialisation: each
# token comes from one of 16 clusters, and its target is a linear map of the token that depends on the
# cluster. One MoE layer (8 experts, top 2) learns it with AdamW, three ways: without balancing, with the
# balance loss ($\alpha = 0.1$), with DeepSeek-V3's bias ($u = 0.01$, updated before each step from the
# step's load). We record, at every step, the most-loaded expert's tokens over the mean, $kT/E$ (1 is
# perfect balance; $E/k$ means the busiest expert got every token), and the task's error on that step's
# batch, without the balance loss.

# %%
HB, EB, KB, CLUSTERS, TB, STEPS_B = 16, 8, 2, 16, 256, 40
g = torch.Generator().manual_seed(0)
centres = torch.randn(CLUSTERS, HB, generator=g) * 2
maps = torch.randn(CLUSTERS, HB, HB, generator=g) / HB**0.5


def toy_batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    c = torch.randint(0, CLUSTERS, (TB,), generator=gen)
    x = centres[c] + 0.5 * torch.randn(TB, HB, generator=gen)
    return x, torch.einsum("th,thk->tk", x, maps[c])


def train_toy(aux=0.0, bias_rate=None):
    moe = MoE(dim=HB, hidden=32, num_experts=EB, top_k=KB, aux_loss_coeff=aux,
              expert_bias=bias_rate is not None, seed=0)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2)
    imbalance, error = [], []
    for step in range(STEPS_B):
        x, target = toy_batch(step)
        mse = (moe(x) - target).square().mean()
        (mse + moe.aux_loss).backward()
        if bias_rate is not None:
            moe.update_expert_bias(bias_rate)  # from this step's tokens per expert
        opt.step()
        opt.zero_grad(set_to_none=True)
        imbalance.append(float(moe.tokens_per_expert.max()) / (KB * TB / EB))
        error.append(mse.item())
    return imbalance, error


balance = {"no balancing": train_toy(), "balance loss, alpha = 0.1": train_toy(aux=0.1),
           "expert bias, u = 0.01": train_toy(bias_rate=0.01)}
late = {name: (np.mean(imb[STEPS_B // 2:]), np.mean(err[-10:])) for name, (imb, err) in balance.items()}
for name, (imb, err) in late.items():
    print(f"{name:26s}: max / mean tokens per expert, mean of the last {STEPS_B // 2} steps {imb:.2f} | "
          f"task error, last 10 steps {err:.3f}")
none, aux, bias = late.values()
assert bias[0] < none[0] and aux[0] < none[0], "both balance the load better than nothing"
fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4))
for name, (imb, err) in balance.items():
    ax.plot(imb, label=name)
    bx.plot(err, label=name)
ax.axhline(1, color="grey", ls=":", label="perfect balance")
ax.set_xlabel("step")
ax.set_ylabel("max / mean tokens per expert")
ax.set_title(f"expert load, {EB} experts, top {KB}, {TB} tokens a step")
bx.set_yscale("log")
bx.set_xlabel("step")
bx.set_ylabel("task error (MSE, without the balance loss)")
bx.set_title("what the balancing costs")
ax.legend(fontsize=7)
bx.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# On this task both methods keep the busiest expert closer to the mean than no balancing does, the bias
# more so than the balance loss, and the task errors of the three runs stay close to each other (right
# panel, printed above): here balance is free. It is not always: the balance loss adds a gradient that
# competes with the task's, and DeepSeek-V3 reports that a loss strong enough to balance well hurts the
# model's quality, which is why it steers with the bias and keeps only a very small balance loss. (A toy
# task, a few dozen steps: the figures are this run's, not a law. The trainer has both:
# `--moe-load-balance bias` adds the bias to a balance loss whose weight you choose, 0 for none.)
#
# ## 6. The trainer: `--ep 2` over `--dp 4`
#
# In the trainer expert parallelism is a **second view of the data-parallel ranks** (torchtitan's dp2ep,
# Megatron-LM's "MoE parallel folding"): with `--dp 4 --ep 2`, ranks {0, 1} and {2, 3} each split the
# experts of every MoE block, and ranks {0, 2} and {1, 3}, which hold the same experts, form the
# **expert-data-parallel** group (`edp`). Dense weights are averaged over all 4 ranks; expert gradients
# are **summed over edp and divided by dp x cp** (the global token count), not averaged over edp, which
# would make them ep times too large (`refimpl/parallel/expert_parallel_gpt.py`). The balance loss is
# DeepSeek-V3's sequence-wise one (a mean over sequences, `refimpl.models.moe`), so it does not depend on how the
# batch is cut into ranks: the run must train like one device. The run is the trainer itself,
# `refimpl.train.train`, called on the 4 ranks of section 4: what `python -m refimpl.train
# --nproc-per-node 4 --dp 4 --ep 2 ...` runs on each of its processes (chapter 11 launches it with
# `torchrun`). The one-device reference runs here, in the whole batch at once and one sequence per
# micro-batch: the distance of the two is the spread.

# %%
CORPUS = make_corpus_file(WORK / "corpus.txt", num_bytes=20_000)
# the run as config objects: what `--num-layers 2 --hidden-size 32 --num-heads 4 --seq-len 16 --batch-size 8
# --lr 1e-2 --warmup-steps 2 --steps 4 --log-every 1 --moe-experts 4 --moe-top-k 2 --moe-aux-loss-coeff 0.1`
# builds (the layout goes in a ParallelConfig per run)
TRAIN = TrainConfig(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=16,
                                      num_experts=4, top_k=2, aux_loss_coeff=0.1),
                    data=DataConfig(data=str(CORPUS), cache_dir=str(WORK / "cache"), seq_len=16,
                                    global_batch_size=8),
                    optim=OptimConfig(lr=1e-2, warmup_steps=2), steps=4, log_every=1)
QUIET = RunOptions(report=False)  # no checkpoint, no report at the end: the chapter reads the records
_ = ranks.view.push({"TRAIN": TRAIN, "QUIET": QUIET, "EP_OUT": str(WORK / "ep2")})

# %%
# %%px
# the engines' own imports (the same names as the kernel's)
import contextlib  # noqa: F811
import dataclasses  # noqa: F811
import io  # noqa: F811

from refimpl.config import ParallelConfig  # noqa: F811
from refimpl.distributed import DistributedContext  # noqa: F811
from refimpl.train import train  # noqa: F811

ctx = DistributedContext(rank=rank, world_size=world_size, local_rank=rank, device=device,
                         backend=dist.get_backend(), timeout_s=120)
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its log
    ep_records = train(dataclasses.replace(TRAIN, out=EP_OUT), ctx,
                       dataclasses.replace(QUIET, parallel=ParallelConfig(dp=4, ep=2)))

# %%
records = [json.loads(line) for line in (WORK / "ep2" / "metrics.jsonl").read_text().splitlines()]
assert [r["loss"] for r in records] == [r["loss"] for r in ranks.run(lambda: ep_records)[0]], "rank 0 wrote it"

# %%
# the one-device reference on the ranks' kind of device
ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device(ranks.devices[0]),
                         backend=ranks.backend)
one = {}
for order, micro in (("batch", None), ("micro", 1)):
    config = dataclasses.replace(TRAIN, out=str(WORK / f"one-{order}"), log_every=100,
                                 data=dataclasses.replace(TRAIN.data, micro_batch_size=micro))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its log
        one["fp32", order] = [r["loss"] for r in train(config, ctx, QUIET)]
tol = order_tolerance(one, "fp32", factor=FACTOR)
losses = [r["loss"] for r in records]
drift = max(abs(a - b) for a, b in zip(losses, one["fp32", "batch"], strict=True))
mean = 2 * 8 * 16 / 4  # k T / E for the global batch's T = 8 x 16 tokens
for r in records:
    print(f"step {r['step']}: loss {r['loss']:.4f} = lm {r['lm_loss']:.4f} + balance {r['moe_aux_loss']:.4f}"
          f" | tokens per expert max {r['moe_tokens_per_expert_max']:.0f}, "
          f"mean {r['moe_tokens_per_expert_mean']:.0f} | dropped {r['moe_dropped_fraction']:.0%} | "
          f"bytes sent by rank 0: ep {r['bytes_sent']['ep']:,.0f}, edp {r['bytes_sent']['edp']:,.0f}")
print(f"one device: {[round(v, 4) for v in one['fp32', 'batch']]} | |ep 2 - one device| {drift:.1e}, "
      f"tolerance {tol:.1e}")
assert drift <= tol, (losses, one)
assert all(r["moe_tokens_per_expert_mean"] == mean <= r["moe_tokens_per_expert_max"] for r in records)
assert all(r["moe_dropped_fraction"] == 0 and r["bytes_sent"]["ep"] > 0 and r["bytes_sent"]["edp"] > 0
           for r in records)
assert all(abs(r["lm_loss"] + r["moe_aux_loss"] - r["loss"]) < 1e-9 for r in records)
assert one["fp32", "batch"][-1] < one["fp32", "batch"][0], "it trains"

# %% [markdown]
# The losses are one device's within the tolerance, the balance loss is part of the loss the trainer
# logs, and the `ep` and `edp` groups both carried bytes: the token all-to-alls and the experts' gradient
# sum. In the load columns, `max` is the busiest expert over the blocks and `mean` is $kT/E$ by
# construction (every token makes $k$ assignments), so their ratio is the imbalance section 5 plotted.

# %% [markdown]
# **With the other dimensions.** The same MoE model composes with the pipeline, context and sequence
# parallelism. Each needs one thing of its own, and the run must still be one device's:
#
# * `--pp 2 --dp 2 --ep 2`: each stage holds some blocks, so some balance losses live on stages that
#   never see the loss. The pipeline executor backpropagates a stage's balance loss in that stage's own
#   backward, beside the gradient it receives (`autograd.backward([output, aux], [grad, None])`;
#   Megatron-LM attaches it to the activation instead, the same gradient), and the step's MoE figures are
#   summed over the stages.
# * `--cp 2 --dp 2 --ep 4`: a rank holds half of each sequence, so the sequence-wise loss sums each
#   sequence's counts over the cp ranks (its $f$) and keeps its own mean probability (its $P$): the cp
#   ranks' losses average to the sequence's. The expert-parallel group of 4 spans the cp ranks.
# * `--tp 2 --sequence-parallel --dp 2 --ep 2`: each tensor-parallel rank routes its own $s/t$ tokens (no
#   expert computed twice), so the routers' and experts' gradients are summed over tp, like the layer
#   norms'; the tp ranks hold one loss, so each rank's balance loss counts $1/t$ in its gradient.

# %%
# %%px
MORE = {"pp2-dp2-ep2": ParallelConfig(pp=2, dp=2, ep=2),  # 2 sequences per micro-batch
        "cp2-dp2-ep4": ParallelConfig(cp=2, dp=2, ep=4),
        "tp2-sp-dp2-ep2": ParallelConfig(tp=2, sequence_parallel=True, dp=2, ep=2)}
more_records = {}
for name, parallel in MORE.items():
    micro = 2 if parallel.pp > 1 else None
    config = dataclasses.replace(TRAIN, out=f"{EP_OUT}-{name}",
                                 data=dataclasses.replace(TRAIN.data, micro_batch_size=micro))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its log
        more_records[name] = train(config, ctx, dataclasses.replace(QUIET, parallel=parallel))

# %%
more = ranks.run(lambda: {name: [r["loss"] for r in recs] for name, recs in more_records.items()})
for name in more[0]:
    got = more[0][name]
    assert all(out[name] == got for out in more), "every rank logs the same loss"
    worst = max(abs(a - b) for a, b in zip(got, one["fp32", "batch"], strict=True))
    print(f"{name:>15}: {[round(v, 4) for v in got]} | |{name} - one device| {worst:.1e}, tolerance {tol:.1e}")
    assert worst <= tol, (name, got, one)

# %% [markdown]
# Every layout gives one device's losses within the tolerance. The losses alone would not catch a
# gradient off by a constant factor: tests/trainer/ranks/lane2/test_train_moe.py compares each layout's first-step gradients
# with one device's too, and plants the mistakes (a stage's balance loss left out of its backward, the
# counts not summed over cp, each tp rank's balance loss whole), each of which fails by far.
#
# **The dispatch, overlapped.** The two all-to-alls sit on the critical path: nothing the experts compute
# can start before their tokens arrive. The shared experts need no routing, so DeepSeek-V3 computes them
# while the dispatch is in flight (section 3.2.2). `MoE(x, beside=shared)` does that
# (`dispatch_beside`: post the all-to-all, run `beside()`, then wait), and the block's shared experts go
# there (`MoEMLP`). Timed as the other overlaps of the course are: two ranks behind a loopback shaped to
# 1 Gbit/s, where the link and not the two cores sets the pace (`refimpl.parallel.overlap.moe_dispatch_overlap`:
# ep 2, 4 experts, top 2, 1024 tokens of width 512 per rank, a shared expert 512 -> 1024 -> 512, the
# layer's forward), against the control that waits for the tokens before the shared expert computes.
# The two outputs must be bitwise equal, the overlapped forward at most 0.9 of the control's.

# %%
from refimpl.parallel.overlap import moe_dispatch_overlap, time_overlap  # noqa: E402
from refimpl.viz import plot_timed_overlap  # noqa: E402

timed = time_overlap(moe_dispatch_overlap)  # asserts bitwise-equal outputs and a ratio <= 0.9
if isinstance(timed, str):
    print(f"no shaped link on this machine ({timed}): the timing is skipped")
else:
    print(f"1 Gbit/s link: shared expert beside the dispatch {timed['overlapped']:.3f} s, after it "
          f"{timed['serialized']:.3f} s per forward: {timed['ratio']:.2f} of it; outputs bitwise equal")
    fig = plot_timed_overlap(timed, xlabel="seconds per MoE forward (median of 5, slowest rank)",
                             title="shared expert beside the dispatch vs its serialized control, 1 Gbit/s")

# %%
ranks.stop()
shutil.rmtree(WORK, ignore_errors=True)

# %% [markdown]
# ## What to take away
#
# * An MoE block holds $E$ experts and a token pays for $k$: FLOPs per token follow the **active**
#   parameters, memory the **total**. Expert parallelism spreads the total.
# * The router is a top-$k$ of scores whose weights carry its gradient: renormalised above $k = 1$, the
#   raw score at $k = 1$ (renormalised, it would be 1 and learn nothing from the task). Balance comes
#   from outside the language-model loss: a balance loss (whose gradient, not its minimum, balances, and
#   which competes with the task) or DeepSeek-V3's bias (which only steers the choice). Capacity trades
#   dropped tokens for static shapes; which ones drop is a policy (by position in GShard and Switch, by
#   score here).
# * Grouped experts are one matmul per projection over expert-sorted rows.
# * Expert parallelism is two all-to-alls with **uneven** splits, agreed by exchanging the counts first;
#   its backward is the same all-to-all reversed. Compare gradients, not losses: expert gradients off by
#   the ep factor train almost as well and are wrong.
#
# In the trainer: `python -m refimpl.train --nproc-per-node 4 --dp 4 --ep 2 --moe-experts 8 --moe-top-k 2`
# (`--moe-capacity-factor`, `--moe-load-balance bias`, `--moe-every` for the rest).
#
# ## Exercise
#
# Open `exercises/09_mixture_of_experts.py` and implement the router's bookkeeping and the dispatch:
# `load_balancing_loss` (Switch's $\alpha E \sum_i f_i P_i$, its gradient through $P$ only),
# `expert_capacity` and `capacity_keep` ($C = \lceil kT/E \cdot cf \rceil$ slots, each expert keeping its
# highest-scored assignments), `sort_by_expert` and `combine` (the stable sort of the kept assignments by
# expert, and the experts' outputs back at their tokens, weighted and summed in fp32), then `rank_splits`
# and `expert_major_order` (the split sizes of the uneven all-to-all, and the permutation from the
# rank-major rows a rank receives to the expert-major rows its experts read). Then the distributed
# halves: `route` and `update_expert_bias` (the top-k router with section 1's renormalisation rule, raw
# probabilities at $k = 1$, and DeepSeek-V3's bias, which chooses but never weighs), the count exchange and
# the uneven all-to-all with its backward, and the expert gradients summed over their expert-data-parallel
# group and divided by $dp \times cp$. Grade your work with
#
# ```
# make grade CH=09
# ```
#
# It checks the loss exactly on scores that are binary fractions and against float64 (value and
# gradient) on softmax and sigmoid scores, the dropped assignments against a sort by score (many ties: an
# unstable sort fails), the dispatch order and the combine against loops (bf16 experts, dropped
# assignments), simulates expert-parallel groups of 2, 3 and 4 ranks (uneven and empty splits) whose
# experts must receive exactly the rows one device gives them, checks the router's choices exactly and its
# weights and gate gradient against float64, and runs the exchange, the all-to-all's backward and the
# expert gradients on 4 gloo ranks (a group that is not the world, a rank without rows, two layouts). A
# loss without the factor $E$ fails, and so do a capacity rounded down, a top-1 router that renormalises
# (its gate gets no gradient), a bias in the combine weights, a backward that reuses the forward's splits
# and expert gradients divided by the expert-data-parallel size (ep times too large).
#
# ## Questions
#
# 1. A token of the DeepSeek-V3-sized model costs a small fraction of the dense model's FLOPs. Why is it
#    not also that fraction of the memory, and what does that mean for how it is trained?
# 2. Why is $f_i$ in the balance loss a count without gradient, and why does the loss need the product
#    $f_i P_i$ rather than either factor alone? What does DeepSeek-V3's bias do that the loss cannot, and
#    why does it move by a fixed step $u$ (its sign) rather than by the size of the imbalance?
# 3. Why must the ranks exchange their counts before the token all-to-all? What would a fixed capacity do
#    instead, and what does it cost?
# 4. With `--dp 4 --ep 2`, why are expert gradients summed over the expert-data-parallel group and
#    divided by 4, and not averaged over it? Why would the loss curve barely show the mistake?
# 5. Capacity is counted per rank's forward. Why does a run with a capacity factor equal one device only
#    at the same number of tokens per rank, and how did the one-device reference of section 4 reproduce
#    the ranks' routing?
