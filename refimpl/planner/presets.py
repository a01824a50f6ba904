"""Published model shapes the planner can be asked about by name: ``python -m refimpl.plan --model
llama3-70b`` (chapter 12).

Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", table 3; the shapes of the model cards'
``config.json``): the Llama form (``refimpl.config.LLAMA``: RMSNorm, RoPE with theta 500,000, SwiGLU, no
biases, an untied output layer) with 8 key/value heads and a vocabulary of 128,256.

DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 4.2; the model card's
``config.json``) and Kimi K2 (Moonshot AI 2025, the model card: the DeepSeek-V3 architecture at 384 experts,
64 heads, one dense block): the DeepSeek-V3 form (``refimpl.config.DEEPSEEK_V3``: multi-head latent
attention, a sigmoid router over 256 (384) experts with top-8 and one shared expert, the first 3 (1) blocks
dense), 61 blocks. Their multi-token-prediction module (DeepSeek-V3's 14B of its 685B checkpoint) is not
part of the 671B, nor of our model.

``published`` is the total the model card prints and ``published_active`` the parameters it says a token
activates, as printed ("8.03B", "1T"). ``refimpl.planner.param_count`` of the preset gives the total to
its last printed digit (tests/planner/test_planner.py); the activated count is the weights a token multiplies
(``ParamCount.matmul``: attention, the router, the ``k`` routed and the shared experts, the output layer;
the embedding is a lookup): DeepSeek-V3's 36.6B prints as its 37B (with the embedding table it would be
37.6B).
"""

from __future__ import annotations

from dataclasses import dataclass

from refimpl.config import DEEPSEEK_V3, LLAMA, ModelConfig

__all__ = ["MODEL_PRESETS", "ModelPreset", "printed_like"]

UNITS = {"B": 1e9, "T": 1e12}


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """A published model: its shape as ``refimpl.config.ModelConfig`` fields and its published size."""

    fields: dict
    published: str  # the total parameters as printed by the model card: "70.6B", "1T"
    source: str
    published_active: str | None = None  # MoE: the parameters a token activates, as printed

    def config(self, *, max_seq_len: int) -> ModelConfig:
        return ModelConfig(**self.fields, max_seq_len=max_seq_len)


def printed_like(count: float, published: str) -> str:
    """``count`` printed in the unit and to the digits of ``published`` ("70.6B", "1T"): what a preset's
    count is compared with."""
    number, unit = published[:-1], published[-1]
    digits = len(number.partition(".")[2])
    return f"{count / UNITS[unit]:.{digits}f}{unit}"


def _llama3(hidden: int, layers: int, heads: int, ffn: int, published: str) -> ModelPreset:
    shape = {"hidden_size": hidden, "num_layers": layers, "num_attention_heads": heads,
             "num_key_value_heads": 8, "ffn_hidden_size": ffn, "vocab_size": 128256, "rope_theta": 500000.0,
             "layernorm_eps": 1e-5}
    return ModelPreset(fields={**LLAMA, **shape},
                       published=published, source="Dubey et al. 2024, table 3; the model card")


def _deepseek_v3(*, heads: int, vocab: int, experts: int, first_dense: int, rope_theta: float,
                 published: str, published_active: str, source: str) -> ModelPreset:
    shape = {"hidden_size": 7168, "num_layers": 61, "num_attention_heads": heads, "ffn_hidden_size": 18432,
             "vocab_size": vocab, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts": experts, "top_k": 8,
             "moe_ffn_hidden_size": 2048, "moe_shared_experts": 1, "moe_first_dense": first_dense,
             "rope_theta": rope_theta, "layernorm_eps": 1e-6}
    return ModelPreset(fields={**DEEPSEEK_V3, **shape}, published=published,
                       published_active=published_active, source=source)


MODEL_PRESETS: dict[str, ModelPreset] = {
    "llama3-8b": _llama3(4096, 32, 32, 14336, "8.03B"),
    "llama3-70b": _llama3(8192, 80, 64, 28672, "70.6B"),
    "llama3-405b": _llama3(16384, 126, 128, 53248, "405.9B"),
    "deepseek-v3": _deepseek_v3(heads=128, vocab=129280, experts=256, first_dense=3, rope_theta=10000.0,
                                published="671B", published_active="37B",
                                source="DeepSeek-AI 2024, section 4.2; the model card"),
    "kimi-k2": _deepseek_v3(heads=64, vocab=163840, experts=384, first_dense=1, rope_theta=50000.0,
                            published="1T", published_active="32B",
                            source="Moonshot AI 2025, the model card"),
}
