"""The running example of the course: a small GPT over bytes (chapter 01).

Decoder-only, pre-LayerNorm blocks (GPT-2, Radford et al. 2019), causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, a GELU MLP, learned position embeddings and an
optional tie between the input embedding and the output layer (Press & Wolf 2017). Module names follow
Megatron-LM (``query_key_value``, ``dense``, ``dense_h_to_4h``, ``dense_4h_to_h``) so that the tensor
parallel chapter can replace them one for one. Each is a :class:`refimpl.nn.Linear` (``nn.Linear`` through the
one linear seam, :func:`refimpl.nn.linear.linear_with_grad`, so zero-bubble's deferred ``dW`` sets a store
on it instead of patching it).

With ``config.num_experts > 0`` the MLP of every ``moe_every``-th block is a mixture of experts
(:class:`refimpl.models.moe.MoEMLP`, chapter 09); a dense configuration builds exactly the model it
always did.

Shapes: b = micro-batch, s = sequence length, h = hidden size, a = attention heads, d = h / a, v = vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from refimpl.config import ModelConfig
from refimpl.nn.linear import Linear
from refimpl.nn.loss import lm_loss
from refimpl.parallel.declarations import ContextParallelModules

__all__ = ["GPT", "MLP", "CausalSelfAttention", "Embedding", "TransformerBlock", "generate", "lm_loss"]


class CausalSelfAttention(nn.Module):
    """softmax(Q K^T / sqrt(d) + causal mask) V over ``num_attention_heads`` heads, then a projection.

    ``query_key_value`` is one fused ``[3h, h]`` linear in Megatron-LM's layout: output row ``3d*i + j*d + c``
    is component ``c`` of q (j = 0), k (1) or v (2) of head ``i``. Tensor parallelism (chapter 06) keeps the
    forward as it is with a column-parallel ``query_key_value``: the forward infers the ``a/t`` heads.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query_key_value = Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = Linear(config.hidden_size, config.hidden_size)

    @staticmethod
    def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax attention of ``[b, a, s, d]`` blocks. Context parallelism (chapter 07) replaces it
        on the instance by attention across the ranks that hold the other parts of the sequence."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.query_key_value(x)  # [b, s, 3h] (under tensor parallelism [b, s, 3h/t]: a/t heads)
        b, s = qkv.shape[:2]
        # Megatron-LM's per-head layout: the 3h outputs are a heads of (q, k, v) x d, so a contiguous block
        # of rows of the weight holds whole heads and splits across tensor-parallel ranks (chapter 06)
        # (the heads are inferred from the width: a/t of them on a tensor-parallel rank)
        qkv = qkv.view(b, s, -1, 3, self.head_dim)  # [b, s, a, 3, d]
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # 3 x [b, a, s, d]
        y = self.core_attention(q, k, v)  # [b, a, s, d]
        y = y.transpose(1, 2).reshape(b, s, -1)  # [b, s, a*d] = [b, s, h] (tp: [b, s, h/t])
        return self.dense(y)


class MLP(nn.Module):
    """GELU(x W1 + b1) W2 + b2 with W1: h -> ffn_hidden_size (4h by default)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = Linear(config.hidden_size, config.ffn_hidden_size)
        self.dense_4h_to_h = Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    """x + Attn(LN(x)), then + MLP(LN(.)): the pre-LN residual block. Block ``layer`` of an MoE
    configuration (:meth:`ModelConfig.is_moe_layer`) has a mixture-of-experts MLP (chapter 09)."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.self_attention = CausalSelfAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        if config.is_moe_layer(layer):
            from refimpl.models.moe import MoEMLP  # the expert-parallel layer: only for MoE configurations

            self.mlp = MoEMLP(config, layer=layer)
        else:
            self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, s, h]
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    """Token embedding plus learned absolute position embedding."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_seq_len, config.hidden_size)

    @staticmethod
    def position_ids(seq_len: int, device: torch.device) -> torch.Tensor:
        """The positions of ``seq_len`` tokens, ``[0, seq_len)``; context parallelism (chapter 07) replaces
        it on the instance by the global positions of this rank's part of the sequence."""
        return torch.arange(seq_len, device=device)  # [s]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        positions = self.position_ids(input_ids.shape[1], input_ids.device)  # [s]
        return self.word_embeddings(input_ids) + self.position_embeddings(positions)  # [b, s, h]


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
            self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
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
        """``{module-name pattern: style}`` for ``tp_size`` ranks (``refimpl/models/gpt_sharding.py``)."""
        from refimpl.models.gpt_sharding import gpt_tensor_parallel_plan

        return gpt_tensor_parallel_plan(self, tp_size=tp_size, sequence_parallel=sequence_parallel,
                                        pad_vocab=pad_vocab)

    def float8_filter(self, module: nn.Module, name: str) -> bool:
        """``--precision fp8`` converts the layers of the linear seam (its dense linears), not an MoE
        router's ``nn.Linear`` gate (``refimpl.precision.fp8.seam_layers``)."""
        from refimpl.precision.fp8.training import seam_layers

        return seam_layers(module, name)

    def shard_units(self) -> tuple[type[nn.Module], ...]:
        """ZeRO-3's and activation checkpointing's units: the transformer block."""
        return (TransformerBlock,)

    def context_parallel_modules(self) -> ContextParallelModules:
        """Context parallelism replaces each block's ``core_attention`` and the embedding's
        ``position_ids``; the heads are those this rank's fused qkv holds (``a/t`` under tp)."""
        attention = [block.self_attention for block in self.layers]
        heads = [a.query_key_value.weight.shape[0] // (3 * a.head_dim) for a in attention]
        return ContextParallelModules(attention=attention, positions=[self.embedding], heads=heads)

    def pipeline_stages(self, *, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                        balance: str = "layers") -> dict[int, nn.Module]:
        """The stages pipeline rank ``pp_rank`` holds, by index (``refimpl/models/gpt_stages.py``)."""
        from refimpl.models.gpt_stages import build_stages

        return build_stages(self, pp_rank=pp_rank, pp_size=pp_size, virtual_stages=virtual_stages,
                            balance=balance)  # type: ignore[arg-type]

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
