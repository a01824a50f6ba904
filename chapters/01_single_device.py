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
# # 01 · One device: the model, the data, the loop, and what a step costs
#
# Every later chapter splits something across devices and then proves that nothing changed: the loss,
# the gradients and the weights must equal those of **one device** training the same global batch.
# This chapter builds that baseline. It also answers the two questions that decide *which* split a run
# needs, before anything is split:
#
# * **Memory.** What does one device hold during a step: weights, gradients, optimizer state,
#   activations? How many bytes each, and which grow with the batch?
# * **Compute.** How many floating-point operations does one training token cost?
#
# `refimpl.planner` answers both with formulas. Here we *measure* both on the real model and assert that
# the measurement equals the formula, byte for byte and FLOP for FLOP. Later chapters then trust the
# planner when they shard.
#
# The pieces: `refimpl.models` (the GPT), `refimpl.data` (bytes in, batches out), `refimpl.optim`
# (AdamW and its schedule) and `refimpl.planner` (the formulas).

# %%
import contextlib
import dataclasses
import math
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from refimpl.config import ModelConfig, OptimConfig
from refimpl.data import ShardedBatches, decode, encode, prepare_corpus
from refimpl.measure import device_peak_flops, format_bytes, format_mfu, peak_dtype
from refimpl.models import GPT, generate, lm_loss
from refimpl.optim import build_optimizer, lr_at, set_lr
from refimpl.planner import flops_per_token, num_param_tensors, param_count, state_memory
from refimpl.viz import plot_bars, plot_loss

torch.set_num_threads(2)  # the course's budget: two CPU cores
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print("torch", torch.__version__, "| device:", device)

# %% [markdown]
# ## 1. The model
#
# The running example of the whole course is a small decoder-only transformer in the GPT-2 mould
# (Radford et al. 2019): a token embedding plus a learned position embedding, `num_layers` pre-LayerNorm
# blocks (attention, then an MLP, each added to a residual stream), a final LayerNorm and an output layer
# that maps back to the vocabulary. The vocabulary is the 256 byte values, so any text trains without a
# tokenizer download. The module names follow Megatron-LM (`query_key_value`, `dense`, `dense_h_to_4h`,
# `dense_4h_to_h`) because chapter 06 replaces exactly these layers with tensor-parallel ones.
#
# A `ModelConfig` holds the shape; it is keyword-only and validates itself.

# %%
cfg = ModelConfig()  # the default: 4 layers, hidden 128, 4 heads, sequence 128, tied embeddings
print(cfg)
model = GPT(cfg, seed=0)
print(model)

# %% [markdown]
# How many parameters? `refimpl.planner.param_count` counts them from the configuration alone, without
# building the model, by role. Per layer: the fused Q/K/V projection $h \times 3h$ plus bias, the output
# projection $h \times h$ plus bias, the MLP $h \times 4h$ and $4h \times h$ plus biases, and two
# LayerNorms of $2h$ each. With **tied** embeddings (Press & Wolf 2017) the output layer *is* the word
# embedding, so it is counted once.

# %%
counts = param_count(cfg)
measured = sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once
for role in ("embedding", "layers", "final_layernorm", "output_layer"):
    print(f"{role:>16s}: {getattr(counts, role):>9,d}")
print(f"{'total':>16s}: {counts.total:>9,d}   (measured: {measured:,d})")
assert counts.total == measured

untied = dataclasses.replace(cfg, tie_word_embeddings=False)
measured_untied = sum(p.numel() for p in GPT(untied).parameters())
assert param_count(untied).total == measured_untied == measured + cfg.hidden_size * cfg.vocab_size
print(f"untied: {measured_untied:,d} = tied + h*v = {measured:,d} + {cfg.hidden_size * cfg.vocab_size:,d}")

# %% [markdown]
# ## 2. The data
#
# **Tokenizer.** A byte is a token: `encode` gives the UTF-8 bytes of a string as ids in [0, 256) and
# `decode` inverts it. A character outside ASCII takes two to four tokens.

# %%
text = "naïve café ✓ def f(x): return x"
ids = encode(text)
print(ids.tolist())
print(f"{len(text)} characters -> {len(ids)} tokens")
assert decode(ids) == text
assert len(ids) == len(text.encode("utf-8")) > len(text)
assert int(ids.min()) >= 0 and int(ids.max()) < 256

# %% [markdown]
# **Corpus.** `prepare_corpus()` with no argument encodes a fixed, sorted selection of Python's own
# standard library source (about 4 MB, so no download) into a flat `uint8` token file, read through
# `numpy.memmap`, beside a manifest with the token count and a sha256. The second call finds the file and
# reuses it.

# %%
corpus = prepare_corpus()
m = corpus.manifest
print(f"{m['token_count']:,d} tokens from {len(m['sources'])} files of {m['source']}; sha256 {m['sha256'][:16]}...")
assert len(corpus) == m["token_count"] > 1_000_000
print(decode(torch.from_numpy(corpus.tokens[:120].copy())))

# %% [markdown]
# **Batches.** `ShardedBatches` cuts the corpus into windows of `seq_len + 1` tokens and serves step
# `k`'s batch as a **pure function of (seed, step, rank, world size)**: the inputs are the first `seq_len`
# tokens of each window and the labels the same window shifted by one, so position `t` learns to predict
# token `t + 1`. Being a pure function is what makes a resumed run (chapter 11) and a data-parallel run
# (chapter 03) see exactly the tokens a single device sees: rank `r` of `W` takes its slice of the same
# global batch.

# %%
SEQ_LEN, BATCH = 64, 16
batches = ShardedBatches(corpus.tokens, seq_len=SEQ_LEN, global_batch_size=BATCH, seed=0)
inputs, labels = batches.batch(0)
print("inputs", tuple(inputs.shape), inputs.dtype, "| labels", tuple(labels.shape))
print("row 0, inputs:", repr(decode(inputs[0])))
print("row 0, labels:", repr(decode(labels[0])))
assert inputs.shape == labels.shape == (BATCH, SEQ_LEN)
assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are the inputs shifted by one token
assert torch.equal(batches.batch(0)[0], inputs)  # the same step gives the same batch, always
halves = [batches.batch(0, rank=r, world_size=2)[0] for r in range(2)]
assert torch.equal(torch.cat(halves), inputs)  # two ranks split the same global batch (chapter 03)

# %% [markdown]
# ## 3. The training loop on one device
#
# Written out, so that nothing is hidden. Per step:
#
# 1. the learning rate from the schedule: `lr_at(step)` is a linear warm-up over `warmup_steps`, then
#    a cosine decay to `min_lr_ratio * lr`. It is a pure function of the step, like the batches;
# 2. forward: logits `[b, s, v]`; the loss is the mean next-token cross entropy (`lm_loss`);
# 3. backward: gradients of the loss with respect to every parameter;
# 4. clip the gradient norm to 1 and take an AdamW step (Loshchilov & Hutter 2019). `build_optimizer`
#    decays only the 2-D weight matrices, not biases, LayerNorms or embeddings.
#
# A uniform guess over 256 bytes has loss $\ln 256 \approx 5.55$ nats per token; a freshly initialised
# model is close to that. Training must bring the loss well below it. A small configuration (2 layers,
# sequences of 64 bytes) keeps this cell to seconds on two CPU cores.

# %%
train_cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, max_seq_len=SEQ_LEN)
optim_cfg = OptimConfig(lr=3e-3, warmup_steps=10)
STEPS = 80

train_model = GPT(train_cfg, seed=0).to(device)
optimizer = build_optimizer(train_model, optim_cfg)
losses = []
start = time.perf_counter()
for step in range(STEPS):
    set_lr(optimizer, lr_at(step, optim_cfg, STEPS))
    x, y = (t.to(device) for t in batches.batch(step))  # [b, s] each
    loss = lm_loss(train_model(x), y)  # mean over b*s tokens
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(train_model.parameters(), optim_cfg.grad_clip)
    optimizer.step()
    losses.append(loss.item())  # .item() waits for the device: the timing below is honest
elapsed = time.perf_counter() - start

tail = sum(losses[-10:]) / 10
print(f"step 0 loss {losses[0]:.3f} (ln 256 = {math.log(256):.3f}); mean of the last 10 steps {tail:.3f}")
plot_loss({"1 device": (range(STEPS), losses)}, title=f"{train_cfg.num_layers}-layer byte GPT, "
          f"batch {BATCH} x {SEQ_LEN} tokens")
assert abs(losses[0] - math.log(256)) < 0.5, "a fresh model should be close to a uniform guess"
assert tail < math.log(256) - 1.5, f"the loss did not fall clearly below ln 256: {tail:.3f}"

# %% [markdown]
# The loss falls from about 5.4 to about 2.9 nats per token in 80 steps (81,920 tokens). What has the
# model learnt? A loss does not say; a sample does. The cell below continues the prompt `def ` twice:
# **greedily** (always the most likely next byte) and **sampled** at temperature 0.8 with a fixed seed,
# and measures both against the corpus: the share of spaces, and which letter runs ("words") and Python
# keywords appear.

# %%
import keyword
import re

import numpy as np

prompt = encode("def ").to(device)
continuations = {
    name: decode(generate(train_model, prompt, max_new_tokens=80, temperature=temp, seed=0)[len(prompt):])
    for name, temp in (("greedy", 0.0), ("sampled", 0.8))
}
byte_counts = np.bincount(corpus.tokens, minlength=256)
top_byte = int(byte_counts.argmax())
print(f"most frequent byte of the corpus: {chr(top_byte)!r}, {byte_counts[top_byte] / len(corpus):.1%} of it")
words_found = {}
for name, text in continuations.items():
    words = re.findall(r"[A-Za-z_]+", text)
    words_found[name] = {w for w in words if keyword.iskeyword(w)}
    print(f"{name:>7s}: {text!r}")
    print(f"         spaces {text.count(' ') / len(text):.0%} | letter runs {words} | "
          f"Python keywords: {sorted(words_found[name]) or 'none'}")
assert set(continuations["greedy"]) == {chr(top_byte)}, "the greedy text is the corpus's most frequent byte"

# %% [markdown]
# The sample shows what the loss of 2.9 means. The greedy continuation is 80 spaces: after 80 steps the
# most likely next byte, in every context this continuation creates, is the corpus's most frequent byte
# (the space, 29.2% of the corpus). The sampled continuation is 61% spaces, more than twice the corpus's
# share; its letter runs (`sp`, `whh`, `stes`, `_yrelpnhlae`, `rnntr` on this CPU) are not words, and it
# holds no Python keyword. So far the model has learnt which bytes are frequent in Python source and
# that spaces come in runs (indentation), not yet words or syntax. (On a GPU the sampled bytes differ: its
# random generator is another one, and its kernels round differently.)

# %% [markdown]
# **Throughput.** Tokens per second of the loop above, and the arithmetic they represent: each token
# costs `flops_per_token` FLOPs (section 5). These are absolute times on *this* machine, shared with other
# work, so they are printed, never asserted; MFU is reported only where a dense peak is known (a GPU).
# This loop computes in float32, so its MFU divides by the **float32** peak (67 TFLOP/s on an H100, not
# the 989 of bf16; `peak_dtype` says "tf32" instead if the run enabled TF32 matmuls).

# %%
tokens_per_s = STEPS * BATCH * SEQ_LEN / elapsed
achieved = tokens_per_s * flops_per_token(train_cfg, SEQ_LEN)
peak = device_peak_flops(device, dtype=peak_dtype(torch.float32))  # an fp32 run
print(f"{tokens_per_s:,.0f} tokens/s, {achieved / 1e9:.2f} GFLOP/s achieved on {device}; "
      f"MFU {format_mfu(None if peak is None else achieved / peak)} of the {peak_dtype(torch.float32)} peak")

# %% [markdown]
# ## 4. Memory anatomy of a step
#
# During a training step one device holds:
#
# | what | bytes (float32, AdamW) | grows with |
# |---|---|---|
# | weights | $4N$ | model size |
# | gradients | $4N$ | model size |
# | AdamW state: first and second moments | $8N$ | model size |
# | AdamW state: the `step` counter | 4 per parameter *tensor* | number of tensors |
# | activations saved for backward | measured below | batch x sequence x model |
#
# The first four are the **model state**: 16 bytes per parameter, whatever the batch. PyTorch's Adam
# keeps `step` as a float32 scalar tensor per parameter tensor, so the formula of
# `refimpl.planner.state_memory` counts those too, and the measurement matches it **exactly**. We measure
# from the tensors themselves after one step, for the tied and the untied model.

# %%
def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state, read from the tensors themselves."""
    params = list(model.parameters())
    return {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "AdamW state": sum(t.numel() * t.element_size() for s in optimizer.state.values()
                           for t in s.values() if torch.is_tensor(t)),
    }


x, y = (t.to(device) for t in batches.batch(0))
measured_state = {}
for config in (cfg, untied):
    net = GPT(config).to(device)
    opt = build_optimizer(net, OptimConfig())
    lm_loss(net(x), y).backward()
    opt.step()  # AdamW creates its state lazily, at the first step
    got = measured_state[config.tie_word_embeddings] = state_bytes(net, opt)
    plan = state_memory(config)
    step_tensors = [s["step"] for s in opt.state.values()]
    print(f"tied={config.tie_word_embeddings}: {got} | planner: {plan}")
    assert got == {"weights": plan.weights, "gradients": plan.grads, "AdamW state": plan.optimizer}
    assert len(step_tensors) == num_param_tensors(config)
    assert all(t.dtype == torch.float32 and t.numel() == 1 for t in step_tensors)

n = counts.total
print(f"{n:,d} parameters x 16 bytes + {num_param_tensors(cfg)} step tensors x 4 bytes = "
      f"{16 * n + 4 * num_param_tensors(cfg):,d} = {format_bytes(state_memory(cfg).total)}")

# %% [markdown]
# **Activations.** The forward pass keeps some of its intermediate tensors for the backward pass: the
# input of every linear layer (to compute the weight gradient), the LayerNorm statistics, the GELU input,
# attention's output and log-sum-exp, the logits. `torch.autograd.graph.saved_tensors_hooks` calls a
# function on each tensor autograd saves; we record the **storage** each one lives in, so that two views
# of the same memory count once, and we leave out the parameters (autograd saves the weights too, but
# they are already counted above).

# %%
def long_batch(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``batch_size`` rows of step 0 at sequence length ``seq_len``, on the device."""
    rows = ShardedBatches(corpus.tokens, seq_len=seq_len, global_batch_size=batch_size).batch(0)
    return rows[0].to(device), rows[1].to(device)


def saved_activation_bytes(model: GPT, batch_size: int, seq_len: int) -> int:
    """Bytes of the distinct storages autograd keeps for backward, parameters excluded."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    x, y = long_batch(batch_size, seq_len)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x), y)
    loss.backward()  # the graph (and what it saved) is freed here
    return sum(storages.values())


T = cfg.max_seq_len
act = {b: saved_activation_bytes(model, b, T) for b in (8, 16)}
ratio = act[16] / act[8]
per_token_layer = act[8] / (8 * T * cfg.num_layers)
print({f"B={b}": format_bytes(v) for b, v in act.items()}, f"| ratio {ratio:.4f}")
print(f"about {per_token_layer:,.0f} bytes per token per layer (embedding and logits spread over the layers) "
      f"= {per_token_layer / 4 / cfg.hidden_size:.1f} "
      f"float32 numbers of width h")
assert abs(ratio - 2.0) < 0.01, ratio

plan, got, MiB = state_memory(cfg), measured_state[True], 2**20
fig = plot_bars(
    {
        "weights": {"planner": plan.weights / MiB, "measured": got["weights"] / MiB},
        "gradients": {"planner": plan.grads / MiB, "measured": got["gradients"] / MiB},
        "AdamW state": {"planner": plan.optimizer / MiB, "measured": got["AdamW state"] / MiB},
        f"activations\nB=8, T={T}": {"measured": act[8] / MiB},
        f"activations\nB=16, T={T}": {"measured": act[16] / MiB},
    },
    ylabel="MiB", title=f"what one device holds in a training step ({n / 1e6:.2f} M parameters)",
)

# %% [markdown]
# The model state does not depend on the batch; the activations grow **linearly** with it (and with the
# sequence length), and at a batch of 16 sequences they already outweigh everything else in this small
# model. That is the budget the later chapters cut: ZeRO/FSDP (chapter 04) shards the model state across
# data-parallel ranks; tensor and sequence parallelism (chapters 06-07) shard the activations; activation
# checkpointing trades them for recomputation; mixed precision (chapter 05) halves the bytes per number.
#
# Attention is where the kernel matters. The default CPU kernel (a flash-attention variant) saves only
# the output and one log-sum-exp per query row; the "math" kernel saves the full $s \times s$ matrix of
# attention probabilities per head: $b \cdot a \cdot s^2$ more numbers per layer, quadratic in the
# sequence length.

# %%
with sdpa_kernel(SDPBackend.MATH):
    act_math = saved_activation_bytes(model, 8, T)
extra = act_math - act[8]
scores = cfg.num_layers * 8 * cfg.num_attention_heads * T * T * 4  # one float32 s x s matrix per head
print(f"math kernel saves {format_bytes(act_math)} vs {format_bytes(act[8])}: +{format_bytes(extra)}; "
      f"L*b*a*s^2 float32 = {format_bytes(scores)}")

# %% [markdown]
# For scale: the same 16 bytes per parameter for a 1.3 B-parameter model (24 layers, hidden 2048) are
# about 20 GiB before a single activation, beyond most single GPUs once activations are added, which is
# where sharding starts.

# %%
big = ModelConfig(vocab_size=50257, num_layers=24, hidden_size=2048, num_attention_heads=16, max_seq_len=2048)
big_state = state_memory(big)
print(f"{param_count(big).total / 1e9:.2f} B parameters: weights {format_bytes(big_state.weights)}, "
      f"gradients {format_bytes(big_state.grads)}, AdamW {format_bytes(big_state.optimizer)}, "
      f"total {format_bytes(big_state.total)}")
assert 19 * 2**30 < big_state.total < 21 * 2**30

# %% [markdown]
# ## 5. FLOPs per token
#
# A matrix multiply of an $m \times k$ by a $k \times n$ matrix costs $2mkn$ FLOPs (a multiply and an
# add per term). A token passing through a weight matrix of $N_i$ entries costs $2N_i$ in the forward
# pass and $4N_i$ in the backward pass (one multiply for the gradient of the input, one for the gradient
# of the weight). Summed over the model: $6N$ per token. Attention adds the products $QK^\top$ and
# (probabilities)$\cdot V$, $2 \cdot 2 \cdot T \cdot Q$ per head per token forward, times 3 for forward
# plus backward: $12\,L\,H\,Q\,T$. Together (PaLM, Chowdhery et al. 2022, appendix B):
#
# $$\text{FLOPs per token} = 6N + 12\,L\,H\,Q\,T.$$
#
# We measure with PyTorch's `FlopCounterMode`, which counts the FLOPs of every matrix multiply it sees.
# One catch: it knows the FLOPs of the attention kernels it has a formula for (the CUDA flash, memory-
# efficient and cuDNN kernels), but on a CPU `scaled_dot_product_attention` runs
# `_scaled_dot_product_flash_attention_for_cpu`, which is **not in its registry**, so attention would
# silently count as zero. Inside `sdpa_kernel(SDPBackend.MATH)` attention is computed by plain batched
# matrix multiplies, which it does count. The math kernel computes the full $T \times T$ score matrix,
# masked half included, exactly as the formula assumes.

# %%
B = 4
x, y = long_batch(B, T)


def count_flops(model: GPT, backend: SDPBackend | None) -> tuple[int, int]:
    """(forward FLOPs, forward + backward FLOPs) of one step on (x, y); ``None``: the default kernel."""
    counter = FlopCounterMode(display=False)
    kernel = contextlib.nullcontext() if backend is None else sdpa_kernel(backend)
    with counter, kernel:
        loss = lm_loss(model(x), y)
        forward = counter.get_total_flops()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return forward, counter.get_total_flops()


forward, total = count_flops(model, SDPBackend.MATH)
tokens = B * T
exact = flops_per_token(cfg, T, matmul_only=True) * tokens
palm = flops_per_token(cfg, T) * tokens
print(f"measured {total:,d} FLOPs = {total / tokens:,.0f} per token")
print(f"6 N_matmul + 12LHQT: {exact:,.0f}   |   PaLM 6N + 12LHQT with all N: {palm:,.0f} "
      f"({100 * (palm / total - 1):+.2f}%)")
print(f"backward / forward = {(total - forward) / forward:.4f}")
assert total == exact
assert abs(palm / total - 1) < 0.03
assert abs((total - forward) / forward - 2.0) < 0.01

# %% [markdown]
# The measurement equals the matmul-only formula **exactly**. The PaLM figure with *all* N parameters is
# 2.5% higher for this model, because some parameters do no matrix multiply: the position embedding (a
# lookup, $T \cdot h$ numbers), the LayerNorm gains and biases, and the linear biases (an addition per
# entry, which the formula and the counter ignore). The word embedding does count here, but only because
# it is tied to the output layer, which *is* a matmul; an untied input embedding is another lookup. The
# gap shrinks as models grow, because these vectors scale with $h$ while the matrices scale with $h^2$:

# %%
for c in (cfg, untied, ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12, max_seq_len=1024),
          big):
    gap = flops_per_token(c, c.max_seq_len) / flops_per_token(c, c.max_seq_len, matmul_only=True) - 1
    print(f"L={c.num_layers:>2d} h={c.hidden_size:>4d} v={c.vocab_size:>5d} tied={c.tie_word_embeddings!s:>5s}: "
          f"PaLM with all N over-counts by {100 * gap:5.2f}%")

# %% [markdown]
# The backward pass costs **twice** the forward pass: every counted operation is a matrix multiply, and
# its backward is two multiplies of the same size (gradient of the input, gradient of the weight). Here
# the ratio is exactly 2 because even the first layer's input (the embedding output) needs a gradient.
#
# And the catch, measured: with the default kernel on a CPU, the counter misses exactly the attention
# term $12\,L\,H\,Q\,T$ per token (on a GPU the default kernel is in the registry, and nothing is missed).

# %%
_, total_default = count_flops(model, None)
attention_term = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.head_dim * T * tokens
print(f"default kernel on {device}: {total_default:,d} FLOPs counted; missing {total - total_default:,d} "
      f"= {(total - total_default) / attention_term:.3f} x the attention term")

# %% [markdown]
# ## 6. The block people train today: the Llama form
#
# GPT-2's block is where the course starts; the block of Llama, Mistral, Qwen and DeepSeek's dense layers
# changes five things, each by a flag of the same `ModelConfig` (as Megatron-Core's `GPTModel` covers both):
#
# * **RMSNorm** (Zhang & Sennrich 2019): $x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \cdot g$, no mean, no bias:
#   one reduction instead of two.
# * **RoPE** (Su et al. 2021): no position table; q and k are rotated by an angle proportional to their
#   position, so a score depends on the *distance* between tokens. Llama 3.1 stretches the low frequencies
#   (`rope_type="llama3"`) for long contexts.
# * **Grouped-query attention** (Ainslie et al. 2023): `num_key_value_heads` $g$ < heads $a$; each key/value
#   head serves $a/g$ query heads, so the K/V projections and the KV cache shrink by $a/g$ ($g = 1$:
#   multi-query). Our fused `query_key_value` keeps the rows of a group together (its $a/g$ query heads,
#   its key, its value), so chapter 06 can split it by rows.
# * **SwiGLU** (Shazeer 2020): $(\mathrm{SiLU}(x W_g) \odot x W_u) W_2$, a gated MLP of three matrices
#   (gate and up fused, their rows interleaved, again for chapter 06).
# * **No biases, an untied output layer.**
#
# `LLAMA` names those fields; the trainer's `--arch llama --num-kv-heads 2` trains this form. The planner
# counts it from the configuration, as it counted GPT-2's: the attention's projections are
# $h(h + 2gd) + h^2$, SwiGLU's $3hf$, each norm $h$.

# %%
from refimpl.config import LLAMA  # noqa: E402

llama_cfg = ModelConfig(**LLAMA, num_key_value_heads=2)  # 4 query heads in 2 groups
llama = GPT(llama_cfg, seed=0)
measured_llama = sum(p.numel() for p in llama.parameters())
assert param_count(llama_cfg).total == measured_llama
qkv_rows = llama.layers[0].self_attention.query_key_value.weight.shape[0]
print(f"Llama form: {measured_llama:,d} parameters (planner: {param_count(llama_cfg).total:,d}); fused qkv "
      f"{qkv_rows} rows = h + 2 g d = {cfg.hidden_size} + 2 x 2 x {llama_cfg.head_dim} (GPT-2's: 3h = "
      f"{3 * cfg.hidden_size})")

# %% [markdown]
# Is it really Llama? `refimpl.models.convert.llama_from_hf` takes a Hugging Face `LlamaForCausalLM`'s
# config and weights (here a small one built from a config: nothing is downloaded) and returns our model
# in its Llama form: the same function, only three weights laid out differently (q/k/v fused by group,
# gate/up interleaved). In float64 the logits should agree to the last few bits, and at first they do
# not: Hugging Face computes the RoPE angles and RMSNorm in **float32** even in a float64 model (for
# speed and memory in bf16 training). Made float64 there too, the two agree to float64's rounding.

# %%
try:
    import transformers  # a test dependency of the course (pip install transformers)
except ImportError:
    transformers = None
    print("transformers is not installed: pip install transformers to run this comparison")
if transformers is not None:
    from refimpl.models.convert import llama_from_hf
    from refimpl.models.rope import rope_frequencies

    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    hf_llama = transformers.LlamaForCausalLM(hf_cfg).double()
    ours = llama_from_hf(hf_cfg.to_dict(), hf_llama.state_dict())
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = (hf_llama(input_ids=ids).logits - ours(ids)).abs().max().item()
        freqs = rope_frequencies(ours.config)  # float64 angles in HF's rotary, float64 RMSNorm

        def rotary64(x, position_ids):
            angles = position_ids[..., None].double() * freqs
            angles = torch.cat((angles, angles), dim=-1)
            return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

        hf_llama.model.rotary_emb.forward = rotary64
        for norm in (m for m in hf_llama.modules() if type(m).__name__ == "LlamaRMSNorm"):
            norm.forward = lambda x, n=norm: n.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                         + n.variance_epsilon))
        after = (hf_llama(input_ids=ids).logits - ours(ids)).abs().max().item()
    print(f"max |logits HF - ours| in float64: {before:.1e} with HF's float32 angles and norms, "
          f"{after:.1e} with both float64 throughout")
    assert after < 1e-12 < before  # tests/unit/models/test_convert.py: every gradient too, with a measured tolerance

# %% [markdown]
# ## What to take away
#
# * The single-device run is the reference: a pure-function data order, a pure-function learning-rate
#   schedule and a seeded model make it reproducible, so a distributed run can be compared with it.
# * Model state costs 16 bytes per parameter with float32 AdamW (+4 bytes per tensor for `step`), and the
#   planner predicts it exactly. Activations grow linearly with the batch and soon dominate.
# * Training costs $6N + 12LHQT$ FLOPs per token, backward twice forward. Check a FLOP counter's blind
#   spots before trusting it: on a CPU, `FlopCounterMode` does not see the default attention kernel.
# * The Llama form (RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases) is the same model class by
#   configuration, equal to Hugging Face's `LlamaForCausalLM` once both compute in float64 throughout.
#
# ## Exercise
#
# Open `exercises/01_single_device.py` and implement the stubs: `count_parameters`, `flops_per_token`,
# `mfu`, `adam_state_bytes`, `next_token_loss` and `lr_at`. Their docstrings state the contract. Grade
# your work with
#
# ```
# make grade CH=01
# ```
#
# which prints a score per task and tells you what is wrong when a check fails.

# %% [markdown]
# ## Questions
#
# 1. The greedy continuation is nothing but spaces, yet the sampled one is 61% spaces where the corpus
#    has 29%. What would each be for a model that knew only the byte frequencies, and what do the
#    measured shares say the model knows beyond them? Which part of the gap is the temperature's doing?
# 2. At a batch of 8 sequences of 128 bytes the default model saves 34.1 MiB of activations, against
#    12.9 MiB of model state. From which batch size on do activations outweigh the state, and why does
#    splitting the batch over data-parallel ranks (chapter 03) shrink one but not the other?
# 3. The PaLM formula with all N over-counts the measured FLOPs by 2.45% for the tied model and by 5.90%
#    untied, although the untied model has one more matrix multiply's worth of weights. Where does the
#    extra over-count come from?
# 4. Backward cost exactly twice forward here. Name a change to the model or the training set-up that
#    makes the ratio smaller than 2, and say which matrix multiplies disappear.
# 5. A float32 run on an H100 achieves 30 TFLOP/s. What is its MFU against the fp32 peak and against the
#    bf16 peak, which one should it report, and what does the other one tell you?
