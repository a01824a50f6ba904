"""Activation memory before anything runs: Korthikanti et al.'s formula, and the same count for our model,
per rank under tensor, sequence and context parallelism (chapters 05, 06 and 07).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sections 4.1-4.2)
count the bytes one Megatron GPT layer keeps for backward in 16-bit training, per rank of ``t``
tensor-parallel ranks (Shoeybi et al. 2019)::

    s b h (34 + 5 a s / h)                   one device (eq. 1)
    s b h (10 + 24 / t + 5 a s / (h t))      tensor parallel (eq. 2)
    s b h (34 / t + 5 a s / (h t))           tensor + sequence parallel (eq. 4)

s = sequence, b = micro-batch, h = hidden, a = heads. 34 s b h: attention 11 (QKV input 2, Q and K 4, V 2,
projection input 2, dropout mask 1), MLP 19 (input 2, GELU input 8, GELU output 8, dropout mask 1), two
LayerNorm inputs 4; 5 a s^2 b: the softmax output (2), its dropout mask (1) and the dropout output (2).
Tensor parallelism splits the 24 (and the a s^2 terms) by ``t``; the 10 (LayerNorm inputs, the inputs of
QKV and of the first MLP linear, the two dropout masks) sits outside the parallel regions, and sequence
parallelism splits it along the sequence: Megatron's column layers save their ``s/t`` input shard and
all-gather it again in backward.

Our block (``refimpl.models.TransformerBlock``, ``refimpl.parallel.tensor_parallel.
apply_tensor_parallel``) differs, and ``activation_bytes_per_layer`` counts it exactly, term by term,
for a compute dtype (``p`` bytes), the residual stream's dtype (``r``), ``t`` ranks and ``u = t`` under
sequence parallelism (else ``u = 1``):

* no dropout: the two s b h masks and the attention dropout go;
* fused (flash) attention, as ``scaled_dot_product_attention`` runs on the CPU: no a s^2 b tensors; it
  keeps its output and a float32 log-sum-exp of ``a b s / t`` values instead;
* under autocast the residual stream and the LayerNorms stay in float32 (r = 4): the two LayerNorm
  inputs cost ``2 r s b h / u``, plus each LayerNorm's mean and reciprocal std ``2 x 2 r s b / u``;
* the FFN width f is a config field (4h by default);
* sequence parallelism as Megatron's: a column layer's input arrives as ``[b, s/t, h]``, is all-gathered for
  the matmul, and only the ``s/t`` shard is saved (gathered again in backward,
  ``refimpl.parallel.tensor_parallel.sequence_parallel_linear``): the QKV and MLP inputs cost
  ``2 p s b h / u`` (autograd's default would keep the gathered ``[b, s, h]``, ``2 p s b h`` at every ``t``).

Per layer and rank::

    2 r sbh/u + 4 r sb/u                     LayerNorm inputs, mean + rstd (replicated; SP: s/t tokens)
    + 2 p sbh/u                              QKV and MLP inputs (SP: the s/t shard)
    + (4 p + 2 p f/h) sbh/t + 4 a sb/t       Q, K, V, attention output; GELU input and output; lse

So in 16-bit (p = 2, r = 4, f = 4h): ``sbh (12 + 24/t) + 16 sb + 4 a sb/t`` without and
``36 sbh/t + 16 sb/t + 4 a sb/t`` with sequence parallelism (``t = 1``: ``36 sbh + 16 sb + 4 a sb``), where
Korthikanti et al. have ``10 + 24/t`` and ``34/t``: fp32 LayerNorm inputs (+4), no dropout masks (-2),
flash attention (no ``5 a s/h`` term);
a checkpointed layer keeps only its input, ``r s b h / u``. ``outside_block_bytes`` counts what the
model saves outside the blocks.

Context parallelism (``cp`` ranks, chapter 07): ``seq_len`` stays the whole sequence, each rank holds
``s_c = s/cp`` of its tokens, and everything but attention acts on each token alone, so every term above
holds ``s_c`` tokens (SP then splits ``s_c`` over ``t``). Attention saves other tensors than SDPA's
(measured with ``refimpl.measure.activations.SavedTensorMeter`` on a rank of
``refimpl.parallel.context_parallel.apply_context_parallel``'s GPT, tests/planner/ranks/test_planner_cp.py):

* ring attention (Liu et al. 2023; the zig-zag layout, ``2 cp`` chunks with rank ``r`` holding chunks ``r``
  and ``2 cp - 1 - r``, as Megatron-LM's context parallelism balances causal work, or contiguous: the same
  bytes; zig-zag is not Brandon et al. 2023's Striped Attention, which deals the tokens out round-robin,
  token ``i`` to rank ``i mod cp``): its autograd
  function saves q, k, v (views of the QKV output, ``3 p s_c bh/t``), and its merged output and
  log-sum-exp in its block dtype (``q`` bytes): ``q s_c bh/t + q a s_c b/t``; the projection's input is a
  separate copy, ``p s_c bh/t`` (the ring's ``[b, a, s_c, d]`` output is transposed to ``[b, s_c, h]``;
  SDPA's output, laid out ``[b, s, a, d]``, is not copied). ``q = 4``: the ring computes its blocks in
  float32, with autocast off inside;
* DeepSpeed-Ulysses (Jacobs et al. 2023): SDPA on the all-to-all outputs ``[b, a/(t cp), s, d]``: three
  copies q, k, v ``3 p s_c bh/t`` (the QKV output itself is not kept), SDPA's output ``p s_c bh/t`` and
  float32 lse ``4 a s_c b/t``; the projection's input is the second all-to-all's output, ``p s_c bh/t``.

Per layer and rank, attention's ``(4 p) sbh/t + 4 a sb/t`` becomes at ``s_c`` tokens::

    (4 p + q) s_c bh/t + q a s_c b/t         ring
    5 p s_c bh/t + 4 a s_c b/t               Ulysses

**The Llama form** (chapter 01; measured the same way, tests/planner/ranks/test_planner_3d.py at seven
layouts), per rank with ``a_t`` query and ``g_t`` key/value heads (``g/t``, or one that ``t/g`` ranks share):

* RMSNorm keeps its input, ``rstd`` and ``x * rstd``, in float32 at least (a 16-bit input is upcast and
  its float32 copy kept): ``(2 n sbh + n sb)/u`` per norm with ``n = max(r, 4)``;
* the fused qkv output ``p sb (a_t + 2 g_t) d`` is kept because V is a view of it; RoPE adds its cos and
  sin ``2 p s d`` and the rotated q and k ``p sb (a_t + g_t) d``;
* the queries ``[b, a_t, s, d]`` are a view of the qkv output when the group dim or the heads-per-group dim
  is 1 (MHA, MQA, one group per rank); otherwise a contiguous copy, after which SDPA's output is
  contiguous too and the projection's input a second copy ``p sb a_t d``;
* SwiGLU keeps the first linear's ``2f/t``-wide output (gate and up are views of it), ``SiLU(gate)`` and
  the product: ``4 p sb f/t``;
* outside the blocks the final RMSNorm's three tensors, and no positions (RoPE has no position embedding).

So in 16-bit under autocast (p = 2, q = r = 4, f = 4h): ring ``s_c bh (12 + 28/t) + 16 s_c b + 4 a s_c b/t``,
Ulysses ``s_c bh (12 + 26/t) + 16 s_c b + 4 a s_c b/t``, against SDPA's ``12 + 24/t`` at ``s_c`` tokens:
both pay ``2/t`` for the projection's copy, the ring ``2/t`` more for its float32 output.
``refimpl.measure.activations.SavedTensorMeter`` measures the same numbers
(tests/unit/measure/test_activations.py, tests/planner/ranks/test_planner_tp.py at tp 2 and 4,
tests/planner/ranks/test_planner_cp.py at cp 2 and 4 and tp 2 x cp 2);
``refimpl.planner.memory.run_memory_per_rank`` adds them up per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from refimpl.config import CP_METHODS, ModelConfig

__all__ = ["METHODS", "ActivationBreakdown", "BlockSplit", "activation_bytes", "activation_bytes_per_layer",
           "check_tp", "korthikanti_bytes_per_layer", "local_tokens", "outside_block_bytes"]

METHODS = CP_METHODS  # the context-parallel methods, named in refimpl.config


class BlockSplit(TypedDict):
    """How a rank's blocks are split: over ``tp`` tensor-parallel ranks (``sequence_parallel``: their
    token-wise regions too) and ``cp`` context-parallel ranks (``cp_method``, ``cp_layout``); keyword
    arguments of ``activation_bytes_per_layer``, ``outside_block_bytes`` and the pipeline's terms."""

    tp: int
    sequence_parallel: bool
    cp: int
    cp_method: str
    cp_layout: str | None


def _attention_layout(config: ModelConfig, tp: int) -> tuple[int, int, bool]:
    """``(a_t, g_t, copied)``: the query and key/value heads of one rank's attention under ``tp``
    (``t/g`` ranks share one key/value head when ``g < t``), and whether the queries reach attention as a
    copy: the fused qkv output ``[b, s, g_t, a/g + 2, d]`` viewed as ``[b, a_t, s, d]`` merges the group
    dim with the heads-per-group dim (module docstring, the Llama form)."""
    a, g = config.num_attention_heads, config.query_groups
    a_t, g_t = a // tp, max(g // tp, 1)
    return a_t, g_t, g_t > 1 and a_t // g_t > 1


def check_tp(config: ModelConfig, tp: int) -> None:
    """A ValueError unless ``tp`` is a positive integer that divides the heads and the FFN width (the
    planner's tensor-parallel sizes check; ``param_table`` adds the untied vocabulary)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    for what, size in (("num_attention_heads", config.num_attention_heads),
                       ("ffn_hidden_size", config.ffn_size)):
        if size % tp:
            raise ValueError(f"tensor parallelism: {what}={size} does not divide by tp={tp}")


def _check_tp(config: ModelConfig, *, tp: int, sequence_parallel: bool, seq_len: int, cp: int = 1) -> int:
    """``u``, the split of the sequence-parallel regions (``tp`` under SP, else 1), after ``check_tp``
    (``seq_len``: the tokens the rank's tensor-parallel group holds, ``s/cp`` of ``cp`` ranks)."""
    check_tp(config, tp)
    if sequence_parallel and seq_len % tp:
        tokens = f"seq_len={seq_len}" if cp == 1 else f"the {seq_len} tokens of each rank (seq_len / cp={cp})"
        raise ValueError(f"sequence parallelism: {tokens} does not divide by tp={tp}")
    return tp if sequence_parallel else 1


def local_tokens(config: ModelConfig, *, seq_len: int, cp: int, cp_method: str, cp_layout: str | None,
                  tp: int) -> int:
    """``s/cp``, the tokens of each sequence one rank holds, after the checks of the method: the ring's
    zig-zag layout cuts ``s`` into ``2 cp`` chunks (contiguous: ``cp``), Ulysses into ``cp`` parts and gives
    each rank ``(a/t)/cp`` heads (``refimpl.parallel.context_parallel``)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    if cp_method not in METHODS:
        raise ValueError(f"cp_method must be one of {METHODS}, got {cp_method!r}")
    layout = cp_layout or ("zigzag" if cp_method == "ring" else "contiguous")
    if layout not in ("zigzag", "contiguous") or (cp_method == "ulysses" and layout != "contiguous"):
        raise ValueError(f"cp_layout {cp_layout!r} is not a layout of {cp_method} (ring: zigzag or "
                         "contiguous; Ulysses: contiguous)")
    if cp == 1:
        return seq_len
    parts = 2 * cp if layout == "zigzag" else cp
    if seq_len % parts:
        raise ValueError(f"context parallelism ({cp_method}, {layout}) cuts the sequence into {parts} equal "
                         f"parts: seq_len={seq_len} does not divide by {parts}")
    heads = config.num_attention_heads // tp
    if cp_method == "ulysses" and heads % cp:
        raise ValueError(f"Ulysses gives each of the cp={cp} ranks whole heads: {heads} heads per "
                         f"tensor-parallel rank do not divide by {cp}")
    return seq_len // cp


def korthikanti_bytes_per_layer(*, seq_len: int, micro_batch: int, hidden_size: int, num_heads: int,
                                tp: int = 1, sequence_parallel: bool = False) -> int:
    """A Megatron GPT layer in 16 bits per rank (Korthikanti et al. 2022, eqs. 1, 2 and 4):
    ``s b h (10 + 24/t + 5 a s/(h t))``, with sequence parallelism ``s b h (34/t + 5 a s/(h t))``; the
    paper's GPT-2 form (``f = 4h``, dropout, no flash) of ``paper_bytes_per_layer``. Exact integers when
    ``t`` divides ``a`` (and so ``h``)."""
    gpt = ModelConfig(num_layers=1, hidden_size=hidden_size, num_attention_heads=num_heads,
                      max_seq_len=seq_len)
    return paper_bytes_per_layer(gpt, seq_len=seq_len, micro_batch=micro_batch, tp=tp,
                                 sequence_parallel=sequence_parallel)


def paper_bytes_per_layer(config: ModelConfig, *, seq_len: int, micro_batch: int, tp: int = 1,
                          sequence_parallel: bool = False, flash: bool = False, dropout: bool = True,
                          key_len: int | None = None, moe: bool = False) -> int:
    """Korthikanti et al.'s 16-bit count for a layer of ``config``'s form, per rank of ``tp``: the paper's
    tensors at the model's own sizes.

    Outside the tensor-parallel regions (``/t`` under sequence parallelism): the two norms' inputs ``4 sbh``,
    the QKV and MLP inputs ``4 sbh``, the two dropout masks ``2 sbh`` (``dropout``). Inside (``/t``): Q and
    the attention output ``4 sbh``, K and V ``4 s b d g`` over the ``g`` key/value heads (a rank holds
    ``g/t`` of them, or one that ``t/g`` ranks share), the MLP's GELU input and output ``4 s b f`` or
    SwiGLU's gate, up and product ``6 s b f``; without ``flash`` the scores ``5 a s k b`` (softmax output,
    dropout mask and output; ``2 a s k b`` without dropout) over ``k = key_len`` keys. GPT-2's form at
    ``f = 4h``, ``g = a`` with dropout is the paper's ``34 sbh + 5 a s^2 b``.

    The same tensors, counted alike, for the forms the paper predates (an estimate: the byte-exact count of
    the trainer's is ``activation_bytes_per_layer``): an MoE block (``moe``) keeps, instead of the
    MLP's, each token's ``k`` routed and its shared experts' intermediates at ``f_e``, its ``k`` dispatched
    rows and their outputs ``4 k sbh`` and the fp32 router scores ``4 s b E`` (every tp rank routes its own
    ``s/t`` tokens); multi-head latent attention keeps its latents' inputs and the norms' ``4 sb (r_q +
    r_kv)``, q and k ``4 s b a (d_n + d_r)``, v and the output ``4 s b a d_v`` instead of Q, K, V and the
    output."""
    s, b, h, a, t = seq_len, micro_batch, config.hidden_size, config.num_attention_heads, tp
    g, d, f, k = config.query_groups, config.head_dim, config.ffn_size, key_len or seq_len
    if a % t or f % t:
        raise ValueError(f"tp={t} must divide num_heads={a} and the FFN width {f}")
    outside = (8 + 2 * dropout) * s * b * h // (t if sequence_parallel else 1)
    kv_heads = max(g // t, 1)
    c = 6 if config.activation == "swiglu" else 4
    mlp = c * s * b * f // t
    if moe:
        c = 6 if config.moe_activation == "swiglu" else 4
        rows = config.top_k * s * b
        mlp = (c * (rows + config.moe_shared_experts * s * b) * config.expert_hidden_size + 4 * rows * h
               + 4 * s * b * config.num_experts) // t
    scores = 0 if flash else (5 if dropout else 2) * (a // t) * s * k * b
    if config.attention_type == "mla":
        mla = config.mla
        latents = 4 * s * b * ((mla.q_lora_rank or 0) + mla.kv_lora_rank)
        qk, v = mla.qk_head_dim, mla.v_head_dim
        return outside + (latents + 4 * s * b * a * (qk + v)) // t + mlp + scores
    return outside + 4 * s * b * h // t + 4 * s * b * d * kv_heads + mlp + scores


@dataclass(frozen=True, kw_only=True)
class ActivationBreakdown:
    """Bytes one layer saves for backward, term by term (``terms[name] = bytes``)."""

    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def activation_bytes_per_layer(
    config: ModelConfig,
    *,
    micro_batch: int,
    seq_len: int,
    compute_dtype: torch.dtype = torch.float32,
    residual_dtype: torch.dtype = torch.float32,
    checkpointed: bool = False,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    cp_method: str = "ring",
    cp_layout: str | None = None,
) -> ActivationBreakdown:
    """Saved-for-backward bytes of one ``refimpl.models.TransformerBlock`` on one rank of ``tp``
    tensor-parallel ranks (with ``sequence_parallel``: Korthikanti et al.'s sequence parallelism) and ``cp``
    context-parallel ranks (``cp_method`` ``"ring"`` or ``"ulysses"``, ``cp_layout`` the ring's
    ``"zigzag"``, its default, or ``"contiguous"``); see the module docstring for the terms.

    ``seq_len`` is the whole sequence; a rank holds ``s/cp`` of its tokens (a ValueError when the layout
    cannot cut it so, or when Ulysses' heads do not divide). ``compute_dtype``: what the matmuls run in
    (autocast's dtype, or the weights' dtype); ``residual_dtype``: the dtype of the residual stream and the
    LayerNorm inputs (float32 under autocast; the weights' dtype when the model itself is 16-bit). LayerNorm
    keeps its mean and reciprocal std in the residual dtype (measured on the CPU); SDPA's log-sum-exp is
    float32 in every case, the ring's is in its block dtype. ``sequence_parallel`` at ``tp = 1`` is the
    plain block (as ``apply_tensor_parallel`` does).
    """
    b, h, d = micro_batch, config.hidden_size, config.head_dim
    f, t = config.ffn_size, tp
    s = local_tokens(config, seq_len=seq_len, cp=cp, cp_method=cp_method, cp_layout=cp_layout, tp=tp)
    u = _check_tp(config, tp=tp, sequence_parallel=sequence_parallel, seq_len=s, cp=cp)
    p, r = compute_dtype.itemsize, residual_dtype.itemsize
    if checkpointed:
        return ActivationBreakdown(terms={"block input (checkpoint)": r * s * b * h // u})
    a_t, g_t, copied = _attention_layout(config, t)
    if config.normalization == "rmsnorm":  # x * rsqrt(mean(x^2) + eps), then * g: x, rstd and x * rstd kept,
        n = max(r, 4)  # in float32 at least: a 16-bit input is upcast first (and its float32 copy kept)
        terms = {"rmsnorm inputs (2)": 2 * n * s * b * h // u, "rmsnorm rstd (2)": 2 * n * s * b // u,
                 "rmsnorm x * rstd (2)": 2 * n * s * b * h // u}
    else:
        terms = {"layernorm inputs (2)": 2 * r * s * b * h // u,
                 "layernorm mean + rstd (2 x 2)": 2 * 2 * r * s * b // u}
    qkv = p * s * b * (a_t + 2 * g_t) * d  # the fused output: V (and without RoPE K, Q) are views of it
    q_bytes, kv_bytes, out = p * s * b * a_t * d, p * s * b * g_t * d, p * s * b * a_t * d
    terms["QKV input"] = p * s * b * h // u
    rope = config.position_embedding == "rope"
    if rope:  # cos and sin [s, d] in the activations' dtype; q and k rotated into new tensors
        terms["RoPE cos, sin"] = 2 * p * s * d
    if cp == 1 or cp_method == "ring":
        terms["QKV output (holds V)"] = qkv
        if rope:
            terms["Q, K rotated"] = q_bytes + kv_bytes
        elif copied:
            terms["Q (a copy)"] = q_bytes
    if cp == 1:
        terms |= {"attention log-sum-exp (fp32)": 4 * a_t * s * b, "attention output": out}
        if copied:
            terms["projection input (a copy of the output)"] = out
    elif cp_method == "ring":
        q = 4  # the ring's block dtype: float32 (autocast off inside)
        terms |= {"ring output (block dtype)": q * s * b * a_t * d,
                  "ring log-sum-exp (block dtype)": q * a_t * s * b,
                  "projection input (a copy of the output)": out}
    else:
        terms |= {"Q, K, V (head shards, 3 all-to-all outputs)": q_bytes + 2 * kv_bytes,
                  "attention log-sum-exp (fp32)": 4 * a_t * s * b,
                  "attention output (head shard)": out,
                  "projection input (all-to-all output, a copy)": out}
    terms["MLP input"] = p * s * b * h // u
    width = p * s * b * (f // t)  # one f/t-wide tensor
    if config.activation == "swiglu":
        terms |= {"gate | up (the first linear's output)": 2 * width, "SiLU(gate)": width,
                  "SiLU(gate) * up = second linear input": width}
    else:
        terms |= {"GELU input": width, "GELU output = second linear input": width}
    return ActivationBreakdown(terms=terms)


def activation_bytes(
    config: ModelConfig, *, checkpointed_blocks: set[int] | list[int] | tuple[int, ...] = (), **per_layer: Any
) -> list[int]:
    """Saved bytes of every block of the model on one rank, in order (checkpointed ones keep only their
    input).

    ``per_layer``: the keyword arguments of ``activation_bytes_per_layer`` (``micro_batch``,
    ``seq_len``, ``compute_dtype``, ``residual_dtype``, ``tp``, ``sequence_parallel``, ``cp``,
    ``cp_method``, ``cp_layout``), the same for every block.
    """
    if "checkpointed" in per_layer:
        raise TypeError("activation_bytes takes checkpointed_blocks (block indices), not checkpointed")
    chosen = set(checkpointed_blocks)
    return [activation_bytes_per_layer(config, checkpointed=i in chosen, **per_layer).total
            for i in range(config.num_layers)]


def outside_block_bytes(config: ModelConfig, *, micro_batch: int, seq_len: int,
                        compute_dtype: torch.dtype = torch.float32, tp: int = 1,
                        sequence_parallel: bool = False, cp: int = 1, cp_method: str = "ring",
                        cp_layout: str | None = None) -> dict[str, int]:
    """What one rank saves for backward outside the blocks (embedding, final LayerNorm, output layer,
    loss), with the residual stream in float32, term by term, for the rank's ``s = seq_len / cp`` tokens
    (everything outside attention acts on each token alone; the embedding saves the int64 global positions
    of those tokens; the same checks as ``activation_bytes_per_layer``).

    One device (``tp = 1``, ``refimpl.models.lm_loss``): the final LayerNorm's input ``4 s b h`` and
    statistics ``2 x 4 s b``, the output layer's input ``p s b h``, the float32 log-softmax ``4 s b V``, the
    int64 token ids, labels and positions ``8 (2 s b + s)`` and ``cross_entropy``'s float32 total weight.

    Tensor parallel (``t > 1``, ``refimpl.parallel.tensor_parallel.tp_lm_loss``): the final LayerNorm
    sees ``s/u`` tokens and the head saves its ``p s b h / u`` input (under SP the shard, gathered again in
    backward, as the blocks' column layers); the
    vocab-parallel loss saves its float32 softmax shard ``4 s b V_t`` (``V_t = ceil(V/t)`` columns, the
    padding rule of ``refimpl.parallel.tensor_parallel.vocab_parallel``), its int64 target index and two
    bool masks (owned, valid); the vocab-parallel embedding its int64 local ids and bool mask; int64
    positions. The full ``[b, s, V]`` logits are never built.

    The Llama form: the final RMSNorm keeps its input, ``rstd`` and ``x * rstd`` (``4 s b h + 4 s b + 4 s b
    h``), and without a position embedding no positions are saved (RoPE's cos and sin are the blocks').
    """
    b, h, v, t = micro_batch, config.hidden_size, config.vocab_size, tp
    s = local_tokens(config, seq_len=seq_len, cp=cp, cp_method=cp_method, cp_layout=cp_layout, tp=tp)
    u = _check_tp(config, tp=tp, sequence_parallel=sequence_parallel, seq_len=s, cp=cp)
    p = compute_dtype.itemsize
    norm = 4 * s * b * h + (4 * s * b + 4 * s * b * h if config.normalization == "rmsnorm" else 2 * 4 * s * b)
    positions = 0 if config.position_embedding == "rope" else s
    if t == 1:
        return {"final layernorm + output layer inputs": norm + p * s * b * h,
                "log-softmax (fp32)": 4 * s * b * v,
                "token ids, labels, positions": 8 * (2 * s * b + positions) + 4}
    return {"final layernorm + output layer inputs": (norm + p * s * b * h) // u,
            "vocab-parallel softmax shard (fp32)": 4 * s * b * -(-v // t),
            "token ids, labels, positions": 8 * (2 * s * b + positions),
            "embedding + loss masks (bool)": 3 * s * b}
