"""The course model's Llama form against Hugging Face's ``LlamaForCausalLM`` (chapter 01;
``refimpl.models.convert``), built from configs, never downloaded.

* **The frequencies**: ``rope_frequencies`` (float64) against HF's own ``inv_freq`` (its rope init
  functions compute it in float32), default and ``llama3``: within 2 float32 ulps of each frequency.
* **The model, in float64**: HF's weights converted by ``llama_from_hf``; logits and every gradient (each
  mapped back to HF's names by ``llama_to_hf``'s layout) against HF's, for MHA tied, GQA untied with
  ``llama3`` RoPE, and MQA (HF's SDPA attention). HF computes the RoPE angles and its RMSNorm in float32
  even in a float64 model; there its rotary is given float64 angles of the frequencies checked above and
  its RMSNorm stays in float64, so both sides are float64 throughout.
  Tolerance (the numerics rule): the same comparison in float32 measures how far one rounding order is from
  the other at float32's precision; float64's is that distance times ``eps64 / eps32 = 2^-29``, and the bound
  is 16 times that (each side one rounding, a factor 4 for the reduction orders of the two
  implementations' different fusions), floored at 4 float64 ulps of the largest element. Measured worst
  ratios are printed by the test.
* **Round trip**: ``llama_to_hf(llama_from_hf(...))`` gives back HF's state dict bitwise, and a strict
  ``load_state_dict`` into ``LlamaForCausalLM`` takes it.
* **Negative controls**: the fused rows in HF's order (q, then k, then v: no regrouping) and the
  interleaved-pairs RoPE convention each miss the tolerance by orders of magnitude; an ``attention_bias``
  or an unknown rope type is refused by name.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from configs: never download
transformers = pytest.importorskip("transformers")

from refimpl.models import rope as rope_module  # noqa: E402
from refimpl.models.convert import llama_config_from_hf, llama_from_hf, llama_to_hf  # noqa: E402
from refimpl.models.rope import rope_frequencies  # noqa: E402
from tests.support.hf_compare import (  # noqa: E402
    EPS64_OVER_EPS32,
    distances,
    rms_norm_in_input_dtype,
    rotary_in_float64,
    scales,
)

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "mha tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa untied llama3": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                              rope_parameters=LLAMA3),
    "mqa untied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
}


def _hf_config(**kw) -> transformers.LlamaConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                max_position_embeddings=32, rms_norm_eps=1e-6, attn_implementation="sdpa")
    return transformers.LlamaConfig(**{**base, **kw})


def _float64_throughout(hf_model: torch.nn.Module, ours_config) -> None:
    """HF's model computing in float64 throughout: its RMSNorm casts to float32 and its rotary computes the
    angles in float32 even in a float64 model; here the norm stays in the input's dtype and the angles are
    float64 angles of our (checked) frequencies."""
    freqs = rope_frequencies(ours_config)

    for module in hf_model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = functools.partial(rms_norm_in_input_dtype, module)
    hf_model.model.rotary_emb.forward = rotary_in_float64(freqs)


def _run(case: str, dtype: torch.dtype, *, qkv_in_hf_order: bool = False, interleaved_rope: bool = False):
    """Logits and gradients (by HF's names) of HF's model and ours on one batch, in ``dtype``."""
    config = _hf_config(**CASES[case])
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to(dtype)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    ours = llama_from_hf(config.to_dict(), hf_state)
    if qkv_in_hf_order:  # the negative control: HF's [q; k; v] rows taken as our grouped layout
        for i in range(config.num_hidden_layers):
            q, k, v = (hf_state[f"model.layers.{i}.self_attn.{n}_proj.weight"] for n in "qkv")
            ours.layers[i].self_attention.query_key_value.weight.data.copy_(torch.cat((q, k, v)))
    if dtype == torch.float64:
        _float64_throughout(hf, ours.config)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    out = {}
    for name, model, logits_of in (("hf", hf, lambda m: m(input_ids=ids, use_cache=False).logits),
                                   ("ours", ours, lambda m: m(ids))):
        logits = logits_of(model)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if name == "ours":  # our gradients in HF's names and layout
            view = type(model)(model.config).to(dtype)
            view.load_state_dict({n: grads.get(n, grads.get("embedding.word_embeddings.weight"))
                                  for n in model.state_dict()}, strict=True)
            grads = {k: v for k, v in llama_to_hf(view)[1].items()
                     if not (config.tie_word_embeddings and k == "lm_head.weight")}
        out[name] = {"logits": logits.detach(), "grads": grads}
    return out


@pytest.mark.parametrize("rope_parameters", [{"rope_type": "default", "rope_theta": 10000.0}, LLAMA3])
def test_rope_frequencies_are_hugging_faces(rope_parameters):
    config = _hf_config(num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope_parameters)
    theirs = transformers.LlamaForCausalLM(config).model.rotary_emb.inv_freq.double()
    ours = rope_frequencies(llama_config_from_hf(config.to_dict()))
    ulp32 = torch.finfo(torch.float32).eps * ours
    assert ((ours - theirs).abs() <= 2 * ulp32).all(), (ours - theirs).abs() / ulp32
    if rope_parameters["rope_type"] == "llama3":  # the scaling changed something: low frequencies divided
        plain = rope_frequencies(llama_config_from_hf(_hf_config(num_attention_heads=4).to_dict()))
        assert not torch.equal(ours, plain)


@pytest.mark.numerics
@pytest.mark.parametrize("case", list(CASES))
def test_the_llama_form_equals_hugging_faces_llama_in_float64(case):
    d32, d64 = distances(_run(case, torch.float32)), distances(_run(case, torch.float64))
    run64 = _run(case, torch.float64)
    scale = scales(run64)
    ratios = {}
    for name, dist in d64.items():
        ulp_floor = 4 * torch.finfo(torch.float64).eps * scale[name]
        tol = max(16 * d32[name] * EPS64_OVER_EPS32, ulp_floor)
        ratios[name] = dist / tol
    worst = max(ratios, key=ratios.get)
    print(f"{case}: worst {worst} at {ratios[worst]:.3g} of the tolerance")
    assert ratios[worst] <= 1, ratios
    assert len(d64) == 1 + len(run64["hf"]["grads"])  # every gradient compared


@pytest.mark.parametrize(("control", "kw"), [("qkv rows in HF's order", {"qkv_in_hf_order": True})])
def test_a_wrong_conversion_misses_by_orders_of_magnitude(control, kw):
    case = "gqa untied llama3"
    d32 = distances(_run(case, torch.float32))
    wrong = distances(_run(case, torch.float64, **kw))
    tol = max(16 * d32["logits"] * EPS64_OVER_EPS32, 1e-15)
    assert wrong["logits"] > 1e6 * tol, control


def test_interleaved_rope_pairs_are_not_hugging_faces(monkeypatch):
    """Meta's original RoPE rotates pairs (2i, 2i + 1); HF's rotate-half pairs (i, i + d/2): applied to
    HF's weights the interleaved convention gives other logits."""
    right = _run("mha tied", torch.float64)["ours"]["logits"]

    def interleaved(x: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)

    monkeypatch.setattr(rope_module, "rotate_half", interleaved)
    wrong = _run("mha tied", torch.float64)["ours"]["logits"]
    assert (wrong - right).abs().max() > 1e-3


def test_round_trip_and_strict_load():
    config = _hf_config(**CASES["gqa untied llama3"])
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    back_config, back = llama_to_hf(llama_from_hf(config.to_dict(), state))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(**back_config))
    fresh.load_state_dict(back, strict=True)
    assert math.isclose(fresh.config.rope_parameters["factor"], 8.0)


@pytest.mark.parametrize(("field", "value", "words"), [("attention_bias", True, "attention_bias"),
                                                         ("mlp_bias", True, "mlp_bias")])
def test_unsupported_fields_are_refused_by_name(field, value, words):
    config = _hf_config(num_attention_heads=4, **{field: value}).to_dict()
    with pytest.raises(ValueError, match=words):
        llama_config_from_hf(config)
    config = _hf_config(num_attention_heads=4).to_dict()
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        llama_config_from_hf(config)
