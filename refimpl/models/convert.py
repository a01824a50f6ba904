"""Hugging Face's Llama <-> the course model in its Llama form (chapter 01): ``llama_from_hf``,
``llama_to_hf``; Hugging Face's DeepSeek-V3 -> its DeepSeek-V3 form: ``deepseek_v3_from_hf`` (below).

A ``transformers.LlamaForCausalLM`` and ``refimpl.models.GPT`` built with ``ModelConfig(**LLAMA)``
compute the same function; only the layout of three weights differs:

* HF's ``q_proj [a d, h]``, ``k_proj [g d, h]``, ``v_proj [g d, h]`` are our one ``query_key_value`` in
  Megatron's layout by query group: for each key/value head ``j``, the rows of its ``a/g`` query heads, then
  its key, then its value (``refimpl.models.CausalSelfAttention``);
* HF's ``gate_proj [f, h]`` and ``up_proj [f, h]`` are our ``dense_h_to_4h [2f, h]`` with the rows
  interleaved (row ``2i`` gate ``i``, row ``2i + 1`` up ``i``: ``refimpl.models.MLP``);
* the rest is renamed one for one (``embed_tokens`` -> ``embedding.word_embeddings``, ``input_layernorm``,
  ``o_proj`` -> ``self_attention.dense``, ``down_proj`` -> ``dense_4h_to_h``, ``norm`` -> ``final_layernorm``,
  ``lm_head`` -> ``output_layer``).

Both use the rotate-half RoPE convention, so q and k need no permutation (a checkpoint from Meta's original
code, interleaved pairs, would). Supported: GQA and MQA, tied and untied embeddings, ``rope_theta``, the
``default`` and ``llama3`` rope types (transformers 5 keeps them under ``rope_parameters`` in
``to_dict()``; older versions under ``rope_theta`` / ``rope_scaling``: both are read). Anything else (other
rope types, ``attention_bias``, ``mlp_bias``, a ``head_dim`` other than ``hidden / heads``) is a
``ValueError`` naming the field. Proven in float64: logits and every gradient equal to
``LlamaForCausalLM``'s (tests/unit/models/test_convert.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from refimpl.config import DEEPSEEK_V3, LLAMA, ModelConfig
from refimpl.models.gpt import GPT

__all__ = ["deepseek_v3_config_from_hf", "deepseek_v3_from_hf", "deepseek_v3_state_from_hf",
           "llama_config_from_hf", "llama_from_hf", "llama_to_hf"]

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
    """Our ``ModelConfig`` (the Llama form) for a ``LlamaConfig(...).to_dict()``."""
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
    """The inverse of ``_fused_qkv``."""
    g, d = config.query_groups, config.head_dim
    per = fused.reshape(g, -1, d, fused.shape[-1])  # [g, a/g + 2, d, h]
    q, k, v = per[:, :-2], per[:, -2], per[:, -1]
    return q.reshape(-1, fused.shape[-1]), k.reshape(-1, fused.shape[-1]), v.reshape(-1, fused.shape[-1])


def _outer_states(hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our embedding, final norm and output layer from a Hugging Face decoder's state (tied: the same
    table)."""
    embed = hf_state["model.embed_tokens.weight"]
    return {"embedding.word_embeddings.weight": embed,
            "final_layernorm.weight": hf_state["model.norm.weight"],
            "output_layer.weight": hf_state.get("lm_head.weight", embed)}


def _layer_states(hf_state: Mapping[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Block ``i``'s tensors of a Hugging Face decoder's state, by their names inside the block."""
    return {k.removeprefix(f"model.layers.{i}."): t for k, t in hf_state.items()
            if k.startswith(f"model.layers.{i}.")}


def _ours(hf_state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out = _outer_states(hf_state)
    for i in range(config.num_layers):
        hf = _layer_states(hf_state, i)
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


# -- DeepSeek-V3 ------------------------------------------------------------------------------------------

_DEEPSEEK_RENAMES = {"input_layernorm.weight": "input_layernorm.weight",
                     "post_attention_layernorm.weight": "post_attention_layernorm.weight",
                     "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
                     "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
                     "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
                     "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
                     "self_attn.o_proj.weight": "self_attention.dense.weight",
                     "mlp.gate.weight": "mlp.moe.router.gate.weight",
                     "mlp.gate.e_score_correction_bias": "mlp.moe.router.expert_bias"}
"""HF's DeepSeek-V3 names -> ours where only the name changes (the rest: ``deepseek_v3_state_from_hf``)."""


def deepseek_v3_config_from_hf(hf: Mapping) -> ModelConfig:
    """Our ``ModelConfig`` (the DeepSeek-V3 form) for a ``DeepseekV3Config(...).to_dict()``.

    The DeepSeek-V3 form (``DEEPSEEK_V3``): multi-head latent attention with HF's ``q_lora_rank`` (None
    too), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; the first
    ``first_k_dense_replace`` blocks dense (all of them: our dense model), the others MoE blocks of
    ``n_routed_experts`` SwiGLU experts of ``moe_intermediate_size``, ``num_experts_per_tok`` chosen by
    sigmoid scores plus the expert bias (HF's ``e_score_correction_bias``), ``norm_topk_prob``, and
    ``n_shared_experts`` shared experts. Refused with a ``ValueError`` naming the field: rope scaling
    (``rope_parameters`` of a type other than ``default``: DeepSeek-V3's own YaRN is not built),
    ``n_group`` / ``topk_group`` above 1 (group-limited routing), ``routed_scaling_factor`` other than 1,
    ``attention_bias``, an ``hidden_act`` other than ``silu``, ``num_key_value_heads`` other than the heads
    (HF repeats its keys by their ratio), and ``rms_norm_eps`` other than 1e-6 (HF's latent norms use
    1e-6 whatever it says, ours ``layernorm_eps``)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope_parameters.rope_type={kind!r}: only 'default' (no rope scaling) is "
                         "supported; DeepSeek-V3's YaRN scaling (and its softmax mscale) is not built")
    for field, ok in (("n_group", (None, 1)), ("topk_group", (None, 1)), ("routed_scaling_factor", (1, 1.0)),
                      ("attention_bias", (None, False)), ("hidden_act", (None, "silu")),
                      ("rms_norm_eps", (None, 1e-6))):
        if hf.get(field) not in ok:
            raise ValueError(f"{field}={hf[field]!r}: only {' or '.join(map(repr, ok[1:]))} is supported")
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    if hf.get("num_key_value_heads") not in (None, heads):
        raise ValueError(f"num_key_value_heads={hf['num_key_value_heads']}: multi-head latent attention has "
                         "no key/value heads of its own; HF's attention repeats the keys by "
                         f"num_attention_heads / num_key_value_heads, so only {heads} (the heads) is "
                         "supported")
    first_dense = hf.get("first_k_dense_replace") or 0
    moe = {}
    if first_dense < layers:
        moe = {"num_experts": hf["n_routed_experts"], "top_k": hf["num_experts_per_tok"],
               "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_first_dense": first_dense,
               "moe_shared_experts": hf.get("n_shared_experts") or 0,
               "moe_normalize_topk": bool(hf.get("norm_topk_prob", True))}
    fields = {**DEEPSEEK_V3, "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
              "rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), **moe}
    return ModelConfig(**fields, vocab_size=hf["vocab_size"], num_layers=layers,
                       hidden_size=hf["hidden_size"], num_attention_heads=heads,
                       ffn_hidden_size=hf["intermediate_size"],
                       max_seq_len=hf["max_position_embeddings"], q_lora_rank=hf.get("q_lora_rank"),
                       kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                       qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"])


def _halves(rows: torch.Tensor, start: int, r: int) -> torch.Tensor:
    """``rows`` with each block ``[start + j (n + r) ...]``'s last ``r`` rows, DeepSeek's interleaved rope
    pairs ``(0, 1), (2, 3), ...``, reordered to rotate-half's halves ``0, 2, 4, ..., 1, 3, 5, ...``: the
    rotation HF's ``rope_interleave`` applies to the interleaved dims is ours on the reordered ones (and the
    scores, a dot product over the same permutation of the query's and the key's dims, are unchanged)."""
    order = torch.cat((torch.arange(0, r, 2, device=rows.device), torch.arange(1, r, 2, device=rows.device)))
    out = rows.clone()
    out[start:start + r] = rows[start:start + r][order]
    return out


def _rope_rows(weight: torch.Tensor, heads: int, nope: int, r: int) -> torch.Tensor:
    """A query projection ``[a (n + r), ...]`` with every head's rope rows in halves (``_halves``)."""
    per_head = weight.reshape(heads, nope + r, *weight.shape[1:])  # [a, n + r, ...]
    return torch.stack([_halves(w, nope, r) for w in per_head]).reshape(weight.shape)


def _interleaved_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's ``gate_proj``, ``up_proj [f, h]`` -> our ``dense_h_to_4h [2f, h]``: row ``2i`` gate ``i``,
    row ``2i + 1`` up ``i`` (``refimpl.models.MLP``)."""
    return torch.stack((gate, up), dim=1).reshape(-1, gate.shape[1])


def deepseek_v3_state_from_hf(hf_config: Mapping,
                              hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's DeepSeek-V3 tensors under our names and layout. Every step is a renaming, a transpose, an
    interleave or a permutation of rows, so the same map takes HF's *gradients* to ours (the test's
    comparison). The layout changes: with ``rope_interleave`` (HF's default, DeepSeek's checkpoints) the
    rope rows of the query projection and of ``kv_a_proj_with_mqa`` reordered (``_halves``); the dense
    and shared MLPs' gate and up rows interleaved into one ``dense_h_to_4h``; the experts' ``gate_up_proj
    [E, 2f, h]`` and ``down_proj [E, h, f]`` as our ``w1, w3 [E, h, f]`` and ``w2 [E, f, h]``."""
    config = deepseek_v3_config_from_hf(hf_config)
    mla = config.mla
    a, n, r, c = config.num_attention_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
    interleaved = hf_config.get("rope_interleave", True)
    out = _outer_states(hf_state)
    for i in range(config.num_layers):
        hf = _layer_states(hf_state, i)
        ours = {f"layers.{i}.{mine}": hf[theirs] for theirs, mine in _DEEPSEEK_RENAMES.items()
                if theirs in hf}
        q_name, q_mine = (("self_attn.q_proj.weight", "linear_q_proj") if config.q_lora_rank is None
                          else ("self_attn.q_b_proj.weight", "linear_q_up_proj"))
        kv_down = hf["self_attn.kv_a_proj_with_mqa.weight"]  # [c + r, h]: the latent, then the rotated key
        q = hf[q_name]  # [a (n + r), h or q_lora_rank]
        if interleaved:
            q, kv_down = _rope_rows(q, a, n, r), _halves(kv_down, c, r)
        ours[f"layers.{i}.self_attention.{q_mine}.weight"] = q
        ours[f"layers.{i}.self_attention.linear_kv_down_proj.weight"] = kv_down
        if "mlp.gate_proj.weight" in hf:  # a dense block
            ours[f"layers.{i}.mlp.dense_h_to_4h.weight"] = _interleaved_gate_up(hf["mlp.gate_proj.weight"],
                                                                               hf["mlp.up_proj.weight"])
            ours[f"layers.{i}.mlp.dense_4h_to_h.weight"] = hf["mlp.down_proj.weight"]
        else:  # an MoE block
            gate_up = hf["mlp.experts.gate_up_proj"]  # [E, 2f, h]: the gates, then the ups
            down = hf["mlp.experts.down_proj"]  # [E, h, f]
            gate, up = gate_up.chunk(2, dim=1)  # [E, f, h] each
            ours[f"layers.{i}.mlp.moe.experts.w1"] = gate.transpose(1, 2)  # [E, h, f]
            ours[f"layers.{i}.mlp.moe.experts.w3"] = up.transpose(1, 2)
            ours[f"layers.{i}.mlp.moe.experts.w2"] = down.transpose(1, 2)  # [E, f, h]
            if config.moe_shared_experts:
                shared = f"layers.{i}.mlp.shared_experts"
                ours[f"{shared}.dense_h_to_4h.weight"] = _interleaved_gate_up(
                    hf["mlp.shared_experts.gate_proj.weight"], hf["mlp.shared_experts.up_proj.weight"])
                ours[f"{shared}.dense_4h_to_h.weight"] = hf["mlp.shared_experts.down_proj.weight"]
        out.update(ours)
    return out


def deepseek_v3_from_hf(hf_config: Mapping, hf_state_dict: Mapping[str, torch.Tensor]) -> GPT:
    """Our model in its DeepSeek-V3 form with HF's weights loaded (the state dict's dtype kept):
    ``model(input_ids [b, s]) -> logits [b, s, v]``, equal to ``DeepseekV3ForCausalLM``'s
    (tests/unit/models/test_mla.py: float64 logits and every gradient, dense and MoE blocks, with and without
    the query latent)."""
    config = deepseek_v3_config_from_hf(hf_config)
    embed = hf_state_dict["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = GPT(config)
    model = model.to_empty(device=embed.device).to(embed.dtype)
    model.load_state_dict(deepseek_v3_state_from_hf(hf_config, hf_state_dict), strict=True)
    if config.tie_word_embeddings:
        model.output_layer.weight = model.embedding.word_embeddings.weight
    return model
