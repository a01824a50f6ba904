"""Multi-head latent attention, MLA (DeepSeek-AI 2024, "DeepSeek-V2", section 2.1; used unchanged by
"DeepSeek-V3"): the attention of the course model's DeepSeek-V3 form (``ModelConfig(**DEEPSEEK_V3, ...)``,
``attention_type="mla"``; chapter 01 builds the attention, chapter 09 the DeepSeek MoE around it).

Shapes: b = micro-batch, s = sequence length, h = hidden size, a = attention heads; ``n`` =
``qk_nope_head_dim``, ``r`` = ``qk_rope_head_dim``, ``v`` = ``v_head_dim``, ``c`` = ``kv_lora_rank``,
``c'`` = ``q_lora_rank``.

**Keys and values from one latent.** Multi-head attention caches ``2 a d`` numbers per token and layer
(a key and a value per head); grouped-query attention shares them between heads. MLA instead projects each
token's hidden state ``x`` down to a latent ``c_kv = x W_DKV`` of ``c`` dims (``c`` much smaller than
``a d``), normalises it (RMSNorm) and projects it up to every head's key and value:

    k_nope = RMSNorm(c_kv) W_UK   [a, n],      value = RMSNorm(c_kv) W_UV   [a, v].

Position is kept apart, "decoupled RoPE" (a rotation between the up projection and the score would stop
``W_UK`` from being absorbed into the queries at inference): the down projection also yields ``r`` dims
``k_rope = RoPE(x W_KR)``, **one** rotated key shared by all heads (multi-query-like, broadcast), and each
head's key is ``[k_nope, k_rope]`` (``n + r`` dims). The queries are ``[q_nope, RoPE(q_rope)]`` per
head, from the hidden state directly (``q_lora_rank`` None, as DeepSeek-V2-Lite) or through their own
latent (``x W_DQ`` of ``c'`` dims, RMSNorm, up projection: it saves activation memory in training, not
cache). Then causal softmax attention with the scale ``1 / sqrt(n + r)``, the heads' ``v``-dim outputs
concatenated and projected back to ``h``.

**What the KV cache keeps**: ``c + r`` numbers per token and layer (DeepSeek-V3: 512 + 64 = 576) instead
of ``2 a d`` (128 heads of 128: 32768), since ``W_UK`` can be absorbed into the queries and ``W_UV`` into
the output projection at inference. Training, as here, runs the up projections explicitly (as
Megatron-Core's ``MLASelfAttention`` does) and the attention itself is ordinary attention over ``a`` heads
whose values (``v``) are narrower or wider than their queries and keys (``n + r``):
``F.scaled_dot_product_attention`` takes that (checked on CPU in float32 and float64).

Names follow Megatron-Core's ``MLASelfAttention``: ``linear_q_proj`` or ``linear_q_down_proj`` /
``q_layernorm`` / ``linear_q_up_proj``, ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``,
and the output projection ``dense`` (the course GPT's name, so ``GPT.reset_parameters`` scales it as a
residual output projection and sets the two norms, whose names contain "layernorm", to ones). Every linear
is a ``refimpl.nn.linear.Linear`` (the one linear seam), with biases when ``config.add_bias``.

RoPE is rotate-half on the ``r`` rotated dims (``refimpl.models.rope``), Hugging Face's convention with
``rope_interleave=False``; DeepSeek's own checkpoints pair the dims interleaved, which
``refimpl.models.convert.deepseek_v3_from_hf`` turns into halves by permuting the rows of the rotated part
of the projections (proven equal to ``transformers.DeepseekV3ForCausalLM``: tests/unit/models/test_mla.py).

Not built (refused by ``refimpl.support.shape_refusals``): tensor parallelism (the heads of the up
projections and ``dense`` would split, the down projections and the shared rotated key would be replicated;
DeepSeek-V3 trains at tp 1 with expert and pipeline parallelism) and context parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from refimpl.config import ModelConfig
from refimpl.models.rope import RotaryEmbedding, apply_rotary
from refimpl.nn.linear import Linear

__all__ = ["MultiLatentAttention"]


class MultiLatentAttention(nn.Module):
    """Multi-head latent attention (module docstring): ``forward(x [b, s, h]) -> [b, s, h]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.attention_type != "mla":
            raise ValueError(f"MultiLatentAttention needs attention_type='mla', got "
                             f"{config.attention_type!r}")
        h, a, bias, mla = config.hidden_size, config.num_attention_heads, config.add_bias, config.mla
        self.num_heads = a
        self.q_lora_rank, self.kv_lora_rank = mla.q_lora_rank, mla.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.v_head_dim = mla.v_head_dim
        self.qk_head_dim = mla.qk_head_dim
        q_rows = a * self.qk_head_dim  # a (n + r)
        if self.q_lora_rank is None:
            self.linear_q_proj = Linear(h, q_rows, bias=bias)
        else:
            self.linear_q_down_proj = Linear(h, self.q_lora_rank, bias=bias)
            self.q_layernorm = nn.RMSNorm(self.q_lora_rank, eps=config.layernorm_eps)
            self.linear_q_up_proj = Linear(self.q_lora_rank, q_rows, bias=bias)
        self.linear_kv_down_proj = Linear(h, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=config.layernorm_eps)
        self.linear_kv_up_proj = Linear(self.kv_lora_rank, a * (self.qk_nope_head_dim + self.v_head_dim),
                                        bias=bias)
        self.dense = Linear(a * self.v_head_dim, h, bias=bias)
        self.rotary = RotaryEmbedding(config, dim=self.qk_rope_head_dim)

    @staticmethod
    def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax attention of ``[b, a, s, n + r]`` queries and keys over ``[b, a, s, v]`` values,
        scaled by ``1 / sqrt(n + r)`` (SDPA's default: the queries' width)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def held_query_heads(self) -> int:
        """The query heads this rank computes: all ``a`` (MLA is not split by tensor parallelism)."""
        return self.num_heads

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``x [b, s, h] -> [b, s, a (n + r)]``: directly, or through the query latent ``[b, s, c']``."""
        if self.q_lora_rank is None:
            return self.linear_q_proj(x)
        return self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        n, r, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q = self.queries(x).view(b, s, -1, n + r).transpose(1, 2)  # [b, s, a, n + r] -> [b, a, s, n + r]
        q_nope, q_rope = q.split([n, r], dim=-1)  # [b, a, s, n], [b, a, s, r]
        latent = self.linear_kv_down_proj(x)  # [b, s, c + r]: what the KV cache would keep
        c_kv, k_rope = latent.split([self.kv_lora_rank, r], dim=-1)  # [b, s, c], [b, s, r]
        kv = self.linear_kv_up_proj(self.kv_layernorm(c_kv))  # [b, s, a (n + v)]
        kv = kv.view(b, s, -1, n + v).transpose(1, 2)  # [b, s, a, n + v] -> [b, a, s, n + v]
        k_nope, value = kv.split([n, v], dim=-1)  # [b, a, s, n], [b, a, s, v]
        cos, sin = self.rotary(s, device=x.device, dtype=q.dtype)  # [s, r] each
        q_rope = apply_rotary(q_rope, cos, sin)  # [b, a, s, r]
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin)  # [b, s, r] -> [b, 1, s, r]: one for all heads
        heads = q.shape[1]
        q = torch.cat((q_nope, q_rope), dim=-1)  # [b, a, s, n + r]
        k = torch.cat((k_nope, k_rope.expand(b, heads, s, r)), dim=-1)  # [b, a, s, n + r]
        y = self.core_attention(q, k, value)  # [b, a, s, v]
        y = y.transpose(1, 2).reshape(b, s, -1)  # [b, s, a, v] -> [b, s, a v]
        return self.dense(y)  # [b, s, h]

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim}")
