"""Published model shapes the planner can be asked about by name: ``python -m refimpl.plan --model
llama3-70b`` (chapter 12).

Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", table 3; the shapes of the model cards'
``config.json``): the Llama form (:data:`refimpl.config.LLAMA`: RMSNorm, RoPE with theta 500,000, SwiGLU, no
biases, an untied output layer) with 8 key/value heads and a vocabulary of 128,256. ``published`` is the
parameter count the model cards print, in billions; :func:`refimpl.planner.param_count` of the preset gives
it to its last printed digit (tests/test_planner.py).

DeepSeek-V3 (671B total, 37B active) is not a preset: its multi-head latent attention, shared expert and
dense first blocks are not part of :class:`~refimpl.config.ModelConfig`, so no count of ours could be
checked against its published one.
"""

from __future__ import annotations

from dataclasses import dataclass

from refimpl.config import LLAMA, ModelConfig

__all__ = ["MODEL_PRESETS", "ModelPreset"]


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """A published model: its shape as :class:`~refimpl.config.ModelConfig` fields and its published size."""

    fields: dict
    published: float  # billions of parameters, as printed by the model card
    source: str

    def config(self, *, max_seq_len: int) -> ModelConfig:
        return ModelConfig(**self.fields, max_seq_len=max_seq_len)


def _llama3(hidden: int, layers: int, heads: int, ffn: int, published: float) -> ModelPreset:
    shape = {"hidden_size": hidden, "num_layers": layers, "num_attention_heads": heads,
             "num_key_value_heads": 8, "ffn_hidden_size": ffn, "vocab_size": 128256, "rope_theta": 500000.0,
             "layernorm_eps": 1e-5}
    return ModelPreset(fields={**LLAMA, **shape},
                       published=published, source="Dubey et al. 2024, table 3; the model card")


MODEL_PRESETS: dict[str, ModelPreset] = {
    "llama3-8b": _llama3(4096, 32, 32, 14336, 8.03),
    "llama3-70b": _llama3(8192, 80, 64, 28672, 70.6),
    "llama3-405b": _llama3(16384, 126, 128, 53248, 405.9),
}
