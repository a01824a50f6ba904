"""Hugging Face's Llama <-> the course model in its Llama form (chapter 01): :func:`llama_from_hf`,
:func:`llama_to_hf`.

A ``transformers.LlamaForCausalLM`` and :class:`refimpl.models.GPT` built with ``ModelConfig(**LLAMA)``
compute the same function; only the layout of three weights differs:

* HF's ``q_proj [a d, h]``, ``k_proj [g d, h]``, ``v_proj [g d, h]`` are our one ``query_key_value`` in
  Megatron's layout by query group: for each key/value head ``j``, the rows of its ``a/g`` query heads, then
  its key, then its value (:class:`refimpl.models.CausalSelfAttention`);
* HF's ``gate_proj [f, h]`` and ``up_proj [f, h]`` are our ``dense_h_to_4h [2f, h]`` with the rows
  interleaved (row ``2i`` gate ``i``, row ``2i + 1`` up ``i``: :class:`refimpl.models.MLP`);
* the rest is renamed one for one (``embed_tokens`` -> ``embedding.word_embeddings``, ``input_layernorm``,
  ``o_proj`` -> ``self_attention.dense``, ``down_proj`` -> ``dense_4h_to_h``, ``norm`` -> ``final_layernorm``,
  ``lm_head`` -> ``output_layer``).

Both use the rotate-half RoPE convention, so q and k need no permutation (a checkpoint from Meta's original
code, interleaved pairs, would). Supported: GQA and MQA, tied and untied embeddings, ``rope_theta``, the
``default`` and ``llama3`` rope types (transformers 5 keeps them under ``rope_parameters`` in
``to_dict()``; older versions under ``rope_theta`` / ``rope_scaling``: both are read). Anything else (other
rope types, ``attention_bias``, ``mlp_bias``, a ``head_dim`` other than ``hidden / heads``) is a
``ValueError`` naming the field. Proven in float64: logits and every gradient equal to
``LlamaForCausalLM``'s (tests/test_convert.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from refimpl.config import LLAMA, ModelConfig
from refimpl.models.gpt import GPT

__all__ = ["llama_config_from_hf", "llama_from_hf", "llama_to_hf"]

_RENAMES = {"input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "post_attention_layernorm.weight",
            "self_attn.o_proj.weight": "self_attention.dense.weight",
            "mlp.down_proj.weight": "mlp.dense_4h_to_h.weight"}


def _rope(hf: Mapping) -> dict:
    """Our rope fields from a Hugging Face config dict (``rope_parameters``, or the older keys)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind != "llama3":
        raise ValueError(f"rope_parameters.rope_type={kind!r}: only 'default' and 'llama3' are supported")
    return {"rope_theta": float(theta), "rope_type": "llama3", "rope_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_max_position": int(params["original_max_position_embeddings"])}


def llama_config_from_hf(hf: Mapping) -> ModelConfig:
    """Our :class:`ModelConfig` (the Llama form) for a ``LlamaConfig(...).to_dict()``."""
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{flag}=True: the Llama form has no biases")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"head_dim={hf['head_dim']}: only hidden_size / num_attention_heads = "
                         f"{hidden // heads} is supported")
    fields = {**LLAMA, "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
              "layernorm_eps": hf.get("rms_norm_eps", 1e-6), **_rope(hf)}
    return ModelConfig(**fields, vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"],
                       hidden_size=hidden, num_attention_heads=heads,
                       num_key_value_heads=hf.get("num_key_value_heads") or heads,
                       ffn_hidden_size=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"])


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """HF's three projections -> our rows by query group: ``[g, a/g + 2, d, h]`` flattened."""
    g, d = config.query_groups, config.head_dim
    q = q.reshape(g, -1, d, q.shape[-1])  # [g, a/g, d, h]
    k, v = k.reshape(g, 1, d, k.shape[-1]), v.reshape(g, 1, d, v.shape[-1])  # [g, 1, d, h] each
    return torch.cat((q, k, v), dim=1).reshape(-1, q.shape[-1])  # [g (a/g + 2) d, h]


def _split_qkv(fused: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_fused_qkv`."""
    g, d = config.query_groups, config.head_dim
    per = fused.reshape(g, -1, d, fused.shape[-1])  # [g, a/g + 2, d, h]
    q, k, v = per[:, :-2], per[:, -2], per[:, -1]
    return q.reshape(-1, fused.shape[-1]), k.reshape(-1, fused.shape[-1]), v.reshape(-1, fused.shape[-1])


def _ours(hf_state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    embed = hf_state["model.embed_tokens.weight"]
    out = {"embedding.word_embeddings.weight": embed, "final_layernorm.weight": hf_state["model.norm.weight"],
           "output_layer.weight": hf_state.get("lm_head.weight", embed)}  # tied: the same table
    for i in range(config.num_layers):
        hf = {k.removeprefix(f"model.layers.{i}."): t for k, t in hf_state.items()
              if k.startswith(f"model.layers.{i}.")}
        ours = {f"layers.{i}.{mine}": hf[theirs] for theirs, mine in _RENAMES.items()}
        q, k, v = (hf[f"self_attn.{n}_proj.weight"] for n in "qkv")
        ours[f"layers.{i}.self_attention.query_key_value.weight"] = _fused_qkv(q, k, v, config)
        gate, up = hf["mlp.gate_proj.weight"], hf["mlp.up_proj.weight"]  # [f, h] each
        interleaved = torch.stack((gate, up), dim=1)  # [f, 2, h]: row 2i gate i, row 2i + 1 up i
        ours[f"layers.{i}.mlp.dense_h_to_4h.weight"] = interleaved.reshape(-1, gate.shape[1])
        out.update(ours)
    return out


def llama_from_hf(hf_config: Mapping, hf_state_dict: Mapping[str, torch.Tensor]) -> GPT:
    """Our model in its Llama form with HF's weights loaded (the state dict's dtype kept):
    ``model(input_ids [b, s]) -> logits [b, s, v]``, equal to ``LlamaForCausalLM``'s."""
    config = llama_config_from_hf(hf_config)
    dtype = hf_state_dict["model.embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = GPT(config)
    model = model.to_empty(device=hf_state_dict["model.embed_tokens.weight"].device).to(dtype)
    model.load_state_dict(_ours(hf_state_dict, config), strict=True)
    if config.tie_word_embeddings:
        model.output_layer.weight = model.embedding.word_embeddings.weight
    return model


def llama_to_hf(model: GPT) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(hf_config, hf_state_dict)`` of our Llama-form model: a strict ``load_state_dict`` into
    ``LlamaForCausalLM(LlamaConfig(**hf_config))`` gives the same logits (tied: both ``embed_tokens`` and
    ``lm_head`` keys, as HF's own ``state_dict()``)."""
    c = model.config
    form = (c.position_embedding, c.normalization, c.activation, c.add_bias)
    if form != ("rope", "rmsnorm", "swiglu", False):
        raise ValueError("llama_to_hf takes the Llama form (ModelConfig(**LLAMA, ...)), got "
                         f"{c.position_embedding}, {c.normalization}, {c.activation}, bias={c.add_bias}")
    rope = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.rope_type == "llama3":
        rope |= {"factor": c.rope_factor, "low_freq_factor": c.rope_low_freq_factor,
                 "high_freq_factor": c.rope_high_freq_factor,
                 "original_max_position_embeddings": c.rope_original_max_position}
    hf_config = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                 "intermediate_size": c.ffn_hidden_size,
                 "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
                 "num_key_value_heads": c.num_key_value_heads, "max_position_embeddings": c.max_seq_len,
                 "rms_norm_eps": c.layernorm_eps, "tie_word_embeddings": c.tie_word_embeddings,
                 "rope_parameters": rope, "attention_bias": False, "mlp_bias": False}
    state = {k: t.detach() for k, t in model.state_dict().items()}
    hf = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
          "model.norm.weight": state["final_layernorm.weight"],
          "lm_head.weight": state["output_layer.weight"]}
    for i in range(c.num_layers):
        for theirs, mine in _RENAMES.items():
            hf[f"model.layers.{i}.{theirs}"] = state[f"layers.{i}.{mine}"]
        q, k, v = _split_qkv(state[f"layers.{i}.self_attention.query_key_value.weight"], c)
        hf[f"model.layers.{i}.self_attn.q_proj.weight"] = q
        hf[f"model.layers.{i}.self_attn.k_proj.weight"] = k
        hf[f"model.layers.{i}.self_attn.v_proj.weight"] = v
        fused = state[f"layers.{i}.mlp.dense_h_to_4h.weight"]  # [2f, h], gate and up interleaved
        gate, up = fused.reshape(-1, 2, fused.shape[1]).unbind(1)
        hf[f"model.layers.{i}.mlp.gate_proj.weight"] = gate
        hf[f"model.layers.{i}.mlp.up_proj.weight"] = up
    return hf_config, {k: t.contiguous() for k, t in hf.items()}
