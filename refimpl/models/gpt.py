"""The running example of the course: a small GPT over bytes (chapter 01).

Decoder-only, pre-LayerNorm blocks (GPT-2, Radford et al. 2019), causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, a GELU MLP, learned position embeddings and an
optional tie between the input embedding and the output layer (Press & Wolf 2017). Module names follow
Megatron-LM (``query_key_value``, ``dense``, ``dense_h_to_4h``, ``dense_4h_to_h``) so that the tensor
parallel chapter can replace them one for one. Each is a ``refimpl.nn.Linear`` (``nn.Linear`` through the
one linear seam, ``refimpl.nn.linear.linear_with_grad``, so zero-bubble's deferred ``dW`` sets a store
on it instead of patching it).

With ``config.num_experts > 0`` the MLP of every ``moe_every``-th block is a mixture of experts
(``refimpl.models.moe.MoEMLP``, chapter 09); a dense configuration builds exactly the model it
always did. With ``config.attention_type == "mla"`` (the DeepSeek-V3 form) each block's attention is
multi-head latent attention (``refimpl.models.mla.MultiLatentAttention``), under the same name
``self_attention``.

Shapes: b = micro-batch, s = sequence length, h = hidden size, a = attention heads, d = h / a, v = vocab.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from refimpl.config import ModelConfig
from refimpl.models.mla import MultiLatentAttention
from refimpl.models.rope import RotaryEmbedding, apply_rotary
from refimpl.nn.linear import Linear
from refimpl.nn.loss import lm_loss
from refimpl.parallel.declarations import ContextParallelModules

if TYPE_CHECKING:
    from refimpl.models.gpt_stages import GPTStage
    from refimpl.models.moe import MoEMLP
    from refimpl.parallel.pipeline_parallel import Balance
    from refimpl.parallel.pipeline_parallel.schedules import Placement

__all__ = ["GPT", "MLP", "CausalSelfAttention", "Embedding", "TransformerBlock", "generate", "lm_loss"]


def norm(config: ModelConfig) -> nn.Module:
    """The block's normalisation: GPT-2's LayerNorm (with a bias when the model has biases) or Llama's
    RMSNorm, ``x / sqrt(mean(x^2) + eps) * g`` (Zhang & Sennrich 2019)."""
    if config.normalization == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps, bias=config.add_bias)


class CausalSelfAttention(nn.Module):
    """softmax(Q K^T / sqrt(d) + causal mask) V over ``a`` query heads and ``g`` key/value heads, then a
    projection (``g = a``: multi-head; ``g < a``: grouped-query attention, Ainslie et al. 2023, each k/v head
    serving ``a/g`` query heads; ``g = 1``: multi-query, Shazeer 2019).

    ``query_key_value`` is one fused linear in Megatron-LM's layout by query group: the outputs are ``g``
    groups of ``(a/g + 2) d`` rows, the ``a/g`` query heads of the group, then its key, then its value head
    (with ``g = a``: per head ``[q, k, v]``, rows ``3d i + j d + c``). A contiguous block of rows is then
    whole groups, so tensor parallelism (chapter 06) splits it by rows when ``t`` divides ``g``, and the
    forward, which infers the groups from the width, runs on ``g/t`` of them. With RoPE (``position_embedding
    = "rope"``) q and k are rotated by their positions (``refimpl.models.rope``) before the scores.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query_groups = config.query_groups
        self.q_per_group = config.num_attention_heads // config.query_groups
        rows = config.query_groups * (self.q_per_group + 2) * self.head_dim  # = 3h without GQA
        self.query_key_value = Linear(config.hidden_size, rows, bias=config.add_bias)
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=config.add_bias)
        self.rotary = RotaryEmbedding(config) if config.position_embedding == "rope" else None

    @staticmethod
    def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax attention of ``[b, a, s, d]`` queries over ``[b, g, s, d]`` keys and values (query
        head ``i`` reads k/v head ``i // (a/g)``). Context parallelism (chapter 07) replaces it on the
        instance by attention across the ranks that hold the other parts of the sequence."""
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def held_query_heads(self) -> int:
        """The query heads this rank's ``query_key_value`` yields: ``a``, ``a/t`` under tensor parallelism
        (its groups, read from its width or declared by a module that yields one group per rank)."""
        groups = getattr(self.query_key_value, "held_query_groups", None)
        if groups is None:
            groups = self.query_key_value.weight.shape[0] // ((self.q_per_group + 2) * self.head_dim)
        return groups * self.q_per_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.query_key_value(x)  # [b, s, g (a/g + 2) d] (tp: g/t groups, or one shared by t/g ranks)
        b, s = qkv.shape[:2]
        # Megatron-LM's layout by query group: a contiguous block of rows of the weight holds whole groups
        qkv = qkv.view(b, s, -1, self.q_per_group + 2, self.head_dim)  # [b, s, g, a/g + 2, d]
        parts = qkv.permute(3, 0, 2, 1, 4)  # [a/g + 2, b, g, s, d]
        q = parts[: self.q_per_group].permute(1, 2, 0, 3, 4).reshape(b, -1, s, self.head_dim)  # [b, a, s, d]
        k, v = parts[self.q_per_group], parts[self.q_per_group + 1]  # [b, g, s, d] each
        if self.rotary is not None:
            cos, sin = self.rotary(s, device=x.device, dtype=q.dtype)  # [s, d] each
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.core_attention(q, k, v)  # [b, a, s, d]
        y = y.transpose(1, 2).reshape(b, s, -1)  # [b, s, a*d] = [b, s, h] (tp: [b, s, h/t])
        return self.dense(y)


class MLP(nn.Module):
    """GELU(x W1 + b1) W2 + b2 (GPT-2), or SwiGLU: (SiLU(x W_gate) * x W_up) W2 (Shazeer 2020; Llama), with
    W1: h -> ``ffn_hidden_size`` (4h by default).

    SwiGLU's gate and up projections are one fused ``dense_h_to_4h`` of ``2f`` rows, interleaved: row ``2i``
    is feature ``i``'s gate, row ``2i + 1`` its up projection. A contiguous block of rows then holds both
    halves of its features, so tensor parallelism splits it by rows like GELU's (the per-head qkv's lesson,
    chapter 06).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        f, h, bias = config.ffn_size, config.hidden_size, config.add_bias
        self.swiglu = config.activation == "swiglu"
        self.dense_h_to_4h = Linear(h, 2 * f if self.swiglu else f, bias=bias)
        self.dense_4h_to_h = Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense_h_to_4h(x)  # [b, s, f] (SwiGLU: [b, s, 2f]; tp: f/t, 2f/t)
        if self.swiglu:
            gate, up = y.view(*y.shape[:-1], -1, 2).unbind(-1)  # [b, s, f] each: rows 2i and 2i + 1
            return self.dense_4h_to_h(F.silu(gate) * up)
        return self.dense_4h_to_h(F.gelu(y, approximate="tanh"))


class TransformerBlock(nn.Module):
    """x + Attn(LN(x)), then + MLP(LN(.)): the pre-norm residual block. Block ``layer`` of an MoE
    configuration (``ModelConfig.is_moe_layer``) has a mixture-of-experts MLP (chapter 09); the
    attention is multi-head latent attention with ``attention_type="mla"`` (DeepSeek-V3)."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = norm(config)
        self.self_attention: MultiLatentAttention | CausalSelfAttention = (
            MultiLatentAttention(config) if config.attention_type == "mla" else CausalSelfAttention(config))
        self.post_attention_layernorm = norm(config)
        self.mlp: MoEMLP | MLP
        if config.is_moe_layer(layer):
            from refimpl.models.moe import MoEMLP  # the expert-parallel layer: only for MoE configurations

            self.mlp = MoEMLP(config, layer=layer)
        else:
            self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, s, h]
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    """Token embedding plus, in GPT-2's form, a learned absolute position embedding (RoPE: none, the
    attention rotates q and k instead)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (nn.Embedding(config.max_seq_len, config.hidden_size)
                                    if config.position_embedding == "learned" else None)

    @staticmethod
    def position_ids(seq_len: int, device: torch.device) -> torch.Tensor:
        """The positions of ``seq_len`` tokens, ``[0, seq_len)``; context parallelism (chapter 07) replaces
        it on the instance by the global positions of this rank's part of the sequence."""
        return torch.arange(seq_len, device=device)  # [s]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        words = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is None:
            return words
        positions = self.position_ids(input_ids.shape[1], input_ids.device)  # [s]
        return words + self.position_embeddings(positions)  # [b, s, h]


class GPT(nn.Module):
    """The course's language model: embedding, ``num_layers`` blocks, final LayerNorm, output layer.

    ``forward(input_ids [b, s]) -> logits [b, s, v]``. Initialisation is a pure function of ``seed``
    (a private ``torch.Generator``; the global RNG is not touched): normal(0, 0.02) weights, zero biases,
    and the residual output projections scaled by 1 / sqrt(2 * num_layers) as in GPT-2 (an MoE block's
    router and experts alike: each expert's ``w2`` is a residual output projection).
    """

    def __init__(self, config: ModelConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        # The layers' own default init draws from the global RNG; fork it so that building a model leaves
        # the caller's random stream untouched (our init below uses a private generator).
        with torch.random.fork_rng(devices=[]):
            self.embedding = Embedding(config)
            self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_layers))
            self.final_layernorm = norm(config)
            self.output_layer = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.output_layer.weight = self.embedding.word_embeddings.weight
        self.reset_parameters(seed=seed)

    @torch.no_grad()
    def reset_parameters(self, *, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():  # tied weights appear once
            if name.endswith("bias"):
                p.zero_()
            elif "layernorm" in name:
                p.fill_(1.0)
            else:
                residual = name.endswith(("dense.weight", "dense_4h_to_h.weight", "experts.w2"))
                std = residual_std if residual else 0.02
                # Draw on the CPU so that every device gets the same numbers from the same seed.
                p.copy_(torch.randn(p.shape, generator=generator) * std)

    # -- declarations: how each technique applies to this model (refimpl.parallel.declarations) --------

    def tensor_parallel_plan(self, *, tp_size: int, sequence_parallel: bool = False,
                             pad_vocab: bool = False) -> dict[str, object]:
        """``{module-name pattern: style}`` for ``tp_size`` ranks (``refimpl/models/gpt_sharding.py``).
        Multi-head latent attention has no tensor-parallel plan (``refimpl.support.shape_refusals`` refuses
        it at tp > 1, a ``ValueError`` here); at one rank its attention is left out of the plan."""
        from refimpl.models.gpt_sharding import gpt_tensor_parallel_plan

        mla = self.config.attention_type == "mla"
        if mla and tp_size > 1:
            raise ValueError(f"tensor parallelism: multi-head latent attention is not built under tensor "
                             f"parallelism (tp_size={tp_size}); DeepSeek-V3 trains it at tp 1 with expert "
                             "and pipeline parallelism")
        plan = gpt_tensor_parallel_plan(self, tp_size=tp_size, sequence_parallel=sequence_parallel,
                                        pad_vocab=pad_vocab)
        if mla:
            plan = {k: v for k, v in plan.items() if not k.startswith("layers.*.self_attention")}
        return plan

    def float8_filter(self, module: nn.Module, name: str) -> bool:
        """``--precision fp8`` converts the layers of the linear seam (its dense linears), not an MoE
        router's ``nn.Linear`` gate (``refimpl.precision.fp8.seam_layers``)."""
        from refimpl.precision.fp8.training import seam_layers

        return seam_layers(module, name)

    def shard_units(self) -> tuple[type[nn.Module], ...]:
        """ZeRO-3's and activation checkpointing's units: the transformer block."""
        return (TransformerBlock,)

    def context_parallel_modules(self) -> ContextParallelModules:
        """Context parallelism replaces each block's ``core_attention`` and the ``position_ids`` of the
        embedding and (RoPE) of each block's rotation; the heads are the query heads this rank's fused qkv
        holds (``a/t`` under tp; multi-head latent attention: all ``a``, and it is refused at cp > 1 by
        ``refimpl.support.shape_refusals``)."""
        blocks = cast("Iterable[TransformerBlock]", self.layers)  # an nn.ModuleList of them
        attention = [block.self_attention for block in blocks]
        heads = [a.held_query_heads() for a in attention]
        rotary = [a.rotary for a in attention if a.rotary is not None]  # RoPE: each block rotates its q, k
        return ContextParallelModules(attention=attention, positions=[self.embedding, *rotary], heads=heads)

    def pipeline_stages(self, *, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                        balance: str = "layers", placement: str = "loop") -> dict[int, GPTStage]:
        """The stages pipeline rank ``pp_rank`` holds, by index (``refimpl/models/gpt_stages.py``;
        ``placement`` ``"v"``: ZB-V's)."""
        from refimpl.models.gpt_stages import build_stages

        return build_stages(self, pp_rank=pp_rank, pp_size=pp_size, virtual_stages=virtual_stages,
                            balance=cast("Balance", balance),  # split_blocks refuses another value
                            placement=cast("Placement", placement))  # stage_rank refuses another value

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids)  # [b, s, h]
        for layer in self.layers:
            x = layer(x)  # [b, s, h]
        return self.output_layer(self.final_layernorm(x))  # [b, s, v]


@torch.no_grad()
def generate(
    model: GPT, prompt: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.8, seed: int = 0
) -> torch.Tensor:
    """Sample ``max_new_tokens`` continuation tokens of ``prompt`` ([s] int64); returns [s + new]."""
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = prompt.clone()
    for _ in range(max_new_tokens):
        context = tokens[-model.config.max_seq_len :].unsqueeze(0)  # [1, s]
        logits = model(context)[0, -1].float()  # [v]
        probs = torch.softmax(logits / max(temperature, 1e-6), dim=-1)
        next_token = torch.multinomial(probs, 1, generator=generator)  # [1]
        tokens = torch.cat([tokens, next_token])
    return tokens
