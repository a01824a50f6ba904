"""The course model's DeepSeek-V3 form (multi-head latent attention, shared experts, dense first blocks;
``refimpl.models.mla``, ``refimpl.models.moe``, ``refimpl.models.convert.deepseek_v3_from_hf``) against
Hugging Face's ``DeepseekV3ForCausalLM``, built from configs, never downloaded; and what the form adds to
the configuration, the model's declarations and the trainer's flags (the support table's rows:
tests/unit/test_support.py).

* **The model, in float64**: HF's weights converted by ``deepseek_v3_from_hf``; logits and every gradient
  (HF's mapped to our names and layout by the same map as the weights: each step of it is a renaming, a
  transpose, an interleave or a permutation of rows) against HF's, for all blocks dense with and without
  the query latent (``q_lora_rank`` None: DeepSeek-V2-Lite's direct query projection), HF's default
  ``rope_interleave=True`` (DeepSeek's checkpoints: interleaved rope pairs, turned into our rotate-half
  halves by permuting the rope rows of the query projection and of ``kv_a_proj_with_mqa``) and ``False``
  (no permutation), and the MoE form: first block dense (``first_k_dense_replace = 1``), two MoE blocks of
  4 experts, top 2 by sigmoid scores plus a (random, nonzero) expert bias, renormalised, one shared expert,
  ``routed_scaling_factor = 1``, ``n_group = topk_group = 1``. HF's softmax scale is ``(n + r)^-1/2``
  (no YaRN mscale without rope scaling), SDPA's default for our ``[.., n + r]`` queries.
  HF computes its RMSNorms, its RoPE angles and its router in float32 even in a float64 model; in the
  float64 run its norms compute in the input's dtype, its rotary is given float64 angles of our
  frequencies and its router runs the same lines in float64 (with ``n_group = 1`` the group mask selects
  every expert), so both sides are float64 throughout. The float32 run, HF's own code unchanged, measures
  the yardstick and shows these replacements hide nothing: it agrees with ours to float32 rounding.
  Tolerance (tests/unit/models/test_convert.py's rule): 16 x the float32 distance x ``eps64 / eps32``, floored
  at 4 float64 ulps of the largest element.
* **Negative controls**: the rope rows left interleaved (the permutation skipped) and the shared expert
  left out miss the tolerance by orders of magnitude; unsupported HF fields are refused by name.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
import torch.nn.functional as F

from refimpl.config import DEEPSEEK_V3, ConfigError, ModelConfig
from refimpl.models import GPT
from refimpl.models.mla import MultiLatentAttention
from refimpl.models.moe import MoEMLP, SharedExperts
from refimpl.models.rope import rope_frequencies
from refimpl.train import build_parser, config_from_args
from tests.support.hf_compare import (
    EPS64_OVER_EPS32,
    distances,
    rms_norm_in_input_dtype,
    rotary_in_float64,
    scales,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from configs: never download

HF_BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2,
               n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
               max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
               attn_implementation="sdpa", experts_implementation="eager")
CASES = {
    "dense, query latent": dict(q_lora_rank=12, num_hidden_layers=2, first_k_dense_replace=2),
    "dense, no query latent": dict(q_lora_rank=None, num_hidden_layers=2, first_k_dense_replace=2),
    "dense, rope not interleaved": dict(q_lora_rank=12, num_hidden_layers=2, first_k_dense_replace=2,
                                        rope_interleave=False),
    "moe, shared expert, first block dense": dict(q_lora_rank=12, num_hidden_layers=3,
                                                  first_k_dense_replace=1),
}
TINY = dict(**DEEPSEEK_V3, vocab_size=64, num_layers=3, hidden_size=32, num_attention_heads=4, max_seq_len=16,
            kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def _transformers():
    return pytest.importorskip("transformers")


def _hf_config(case: str):
    return _transformers().DeepseekV3Config(**{**HF_BASE, **CASES[case]})


def _router(gate: torch.nn.Module, hidden_states: torch.Tensor):
    """HF's ``DeepseekV3TopkRouter.forward`` in the input's dtype (it casts to float32), ``n_group = 1``."""
    hidden_states = hidden_states.view(-1, gate.hidden_dim)
    router_logits = F.linear(hidden_states, gate.weight)
    scores = router_logits.sigmoid()
    scores_for_choice = scores + gate.e_score_correction_bias  # one group: the group mask keeps every expert
    topk_indices = torch.topk(scores_for_choice, k=gate.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if gate.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * gate.routed_scaling_factor, topk_indices


def _float64_throughout(hf_model: torch.nn.Module, ours_config: ModelConfig) -> None:
    """HF's model in float64 throughout (module docstring): norms in the input's dtype, float64 angles of
    our (rotate-half, ``qk_rope_head_dim``) frequencies, the router's lines in float64."""
    freqs = rope_frequencies(ours_config, dim=ours_config.qk_rope_head_dim)
    for module in hf_model.modules():
        name = type(module).__name__
        if name == "DeepseekV3RMSNorm":
            module.forward = functools.partial(rms_norm_in_input_dtype, module)
        elif name == "DeepseekV3TopkRouter":
            assert module.num_group == 1
            module.forward = functools.partial(_router, module)

    hf_model.model.rotary_emb.forward = rotary_in_float64(freqs)


def _hf_model(case: str, dtype: torch.dtype):
    transformers = _transformers()
    config = _hf_config(case)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).to(dtype)
    with torch.no_grad():  # norms and the expert bias away from their init (1, 0), so a swap shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return config, hf


def _run(case: str, dtype: torch.dtype, *, rope_interleave: bool | None = None, drop_shared: bool = False):
    """Logits and gradients (both in our names and layout) of HF's model and ours on one batch."""
    from refimpl.models.convert import deepseek_v3_from_hf, deepseek_v3_state_from_hf

    config, hf = _hf_model(case, dtype)
    hf_dict = config.to_dict()
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    convert_dict = hf_dict if rope_interleave is None else {**hf_dict, "rope_interleave": rope_interleave}
    ours = deepseek_v3_from_hf(convert_dict, hf_state)
    if drop_shared:  # the negative control: the shared expert's output left out
        for block in ours.layers:
            if isinstance(block.mlp, MoEMLP):
                block.mlp.shared_experts.dense_4h_to_h.weight.data.zero_()
    if dtype == torch.float64:
        _float64_throughout(hf, ours.config)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    out = {}
    for name, model, logits_of in (("hf", hf, lambda m: m(input_ids=ids, use_cache=False).logits),
                                   ("ours", ours, lambda m: m(ids))):
        logits = logits_of(model)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if name == "hf":  # HF's gradients in our names and layout: the weights' map (module docstring)
            grads = deepseek_v3_state_from_hf(hf_dict, grads)
        out[name] = {"logits": logits.detach(), "grads": grads}
    assert set(out["hf"]["grads"]) == set(out["ours"]["grads"])  # every parameter has its counterpart
    return out


def _tolerances(d32: dict[str, float], scale: dict[str, float]) -> dict[str, float]:
    ulp = torch.finfo(torch.float64).eps
    return {n: max(16 * d32[n] * EPS64_OVER_EPS32, 4 * ulp * scale[n]) for n in d32}


@pytest.mark.numerics
@pytest.mark.parametrize("case", list(CASES))
def test_the_deepseek_form_equals_hugging_faces_deepseek_v3_in_float64(case):
    start = time.perf_counter()
    run32, run64 = _run(case, torch.float32), _run(case, torch.float64)
    d32, d64, scale = distances(run32), distances(run64), scales(run64)
    # the yardstick is float32 rounding (HF's own code, unpatched): no routing flip, no hidden difference
    assert all(d32[n] <= 1e-4 * max(scale[n], 1e-3) for n in d32), d32
    tol = _tolerances(d32, scale)
    ratios = {n: d64[n] / tol[n] for n in d64}
    worst = max(ratios, key=ratios.get)
    print(f"{case}: logits within {d64['logits']:.1e} (tolerance {tol['logits']:.1e}), worst {worst} at "
          f"{ratios[worst]:.3g} of its tolerance, {len(d64) - 1} gradients, "
          f"{time.perf_counter() - start:.1f} s")
    assert ratios[worst] <= 1, ratios
    names = set(run64["ours"]["grads"])
    if case.startswith("moe"):  # the MoE form was compared: experts, router, shared expert, dense first block
        assert {"layers.1.mlp.moe.experts.w1", "layers.2.mlp.moe.router.gate.weight",
                "layers.0.mlp.dense_h_to_4h.weight",
                "layers.2.mlp.shared_experts.dense_4h_to_h.weight"} <= names
    if CASES[case]["q_lora_rank"] is None:
        assert "layers.0.self_attention.linear_q_proj.weight" in names


@pytest.mark.parametrize(("control", "case", "kw"), [
    ("rope rows left interleaved", "dense, query latent", {"rope_interleave": False}),
    ("shared expert left out", "moe, shared expert, first block dense", {"drop_shared": True}),
])
def test_a_wrong_conversion_misses_by_orders_of_magnitude(control, case, kw):
    d32 = distances(_run(case, torch.float32))
    wrong = _run(case, torch.float64, **kw)
    tol = _tolerances(d32, scales(wrong))["logits"]
    off = distances(wrong)["logits"]
    print(f"{control}: logits off by {off:.1e}, {off / tol:.1e} x the tolerance")
    assert off > 1e6 * tol, control


@pytest.mark.parametrize(("field", "value"), [("n_group", 2), ("routed_scaling_factor", 2.5),
                                              ("attention_bias", True), ("num_key_value_heads", 128),
                                              ("rms_norm_eps", 1e-5)])
def test_unsupported_hf_fields_are_refused_by_name(field, value):
    from refimpl.models.convert import deepseek_v3_config_from_hf

    hf = {**_hf_config("moe, shared expert, first block dense").to_dict(), field: value}
    with pytest.raises(ValueError, match=field):
        deepseek_v3_config_from_hf(hf)
    hf = _hf_config("dense, query latent").to_dict()
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0}
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        deepseek_v3_config_from_hf(hf)
    assert deepseek_v3_config_from_hf(_hf_config("dense, query latent").to_dict()).num_experts == 0


# -- the configuration, the model's declarations, the trainer's flags -------------------------------------

def test_mla_needs_its_dimensions_rope_and_no_key_value_heads():
    with pytest.raises(ConfigError, match="needs qk_nope_head_dim, v_head_dim"):
        ModelConfig(**{**TINY, "qk_nope_head_dim": None, "v_head_dim": None})
    with pytest.raises(ConfigError, match="position_embedding='rope'"):
        ModelConfig(**{**TINY, "position_embedding": "learned"})
    with pytest.raises(ConfigError, match="qk_rope_head_dim = 5 must be even"):
        ModelConfig(**{**TINY, "qk_rope_head_dim": 5})
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        ModelConfig(**TINY, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="kv_lora_rank given"):
        ModelConfig(kv_lora_rank=16)  # the GPT-2 form's multi-head attention
    with pytest.raises(ConfigError, match="attention_type"):
        ModelConfig(**{**TINY, "attention_type": "gqa"})
    with pytest.raises(ConfigError, match="moe_first_dense"):
        ModelConfig(**TINY, num_experts=4, moe_first_dense=4)
    with pytest.raises(ConfigError, match="moe_shared_experts"):
        ModelConfig(**TINY, num_experts=4, moe_shared_experts=-1)
    config = ModelConfig(**TINY)  # the negative control: the whole form is accepted
    assert config.qk_head_dim == 12 and ModelConfig().qk_head_dim is None


def test_the_new_fields_stay_out_of_older_configurations_dicts():
    moe = ModelConfig(num_experts=4, num_layers=2)
    new = {"moe_shared_experts", "moe_first_dense", "attention_type", "kv_lora_rank"}
    assert not new & set(moe.to_dict())
    assert "attention_type" not in ModelConfig().to_dict()
    deepseek = ModelConfig(**TINY, num_experts=4, moe_shared_experts=1, moe_first_dense=1)
    d = deepseek.to_dict()
    assert d["moe_shared_experts"] == 1 and d["attention_type"] == "mla" and ModelConfig(**d) == deepseek


def test_the_first_dense_blocks_and_the_moe_rule():
    config = ModelConfig(**{**TINY, "num_layers": 6}, num_experts=4, moe_first_dense=3, moe_every=2)
    assert config.moe_layers == [4]  # index >= 3 and index % 2 == 0
    assert ModelConfig(**TINY, num_experts=4, moe_first_dense=1).moe_layers == [1, 2]
    assert ModelConfig(**TINY, num_experts=4, moe_first_dense=3).moe_layers == []
    model = GPT(ModelConfig(**TINY, num_experts=4, moe_first_dense=1, moe_shared_experts=1))
    kinds = [type(block.mlp).__name__ for block in model.layers]
    assert kinds == ["MLP", "MoEMLP", "MoEMLP"]
    assert all(isinstance(block.self_attention, MultiLatentAttention) for block in model.layers)


def test_the_shared_expert_is_dense_whole_kept_by_shard_experts_and_initialised_as_a_residual():
    config = ModelConfig(**TINY, num_experts=4, moe_first_dense=1, moe_shared_experts=2)
    model = GPT(config, seed=3)
    block = model.layers[1].mlp
    assert isinstance(block.shared_experts, SharedExperts)
    assert block.shared_experts.dense_4h_to_h.weight.shape == (32, 2 * config.expert_hidden_size)
    assert all(not n.startswith("shared_experts") for n in block.expert_parallel_parameters())
    shards = block.local_shards()
    for name, shard in shards.items():
        if name.startswith("shared_experts."):
            assert tuple(shard.box.global_shape) == tuple(shard.tensor.shape)  # whole
    shared = block.shared_experts
    block.shard_experts(None)  # one ep rank: every expert, the shared expert untouched
    assert block.shared_experts is shared
    # GPT-2's residual scaling covers the shared expert's output projection and MLA's dense; norms are ones
    residual = 0.02 / (2 * config.num_layers) ** 0.5
    std = float(model.layers[1].mlp.shared_experts.dense_4h_to_h.weight.detach().std())
    assert 0.8 * residual < std < 1.2 * residual, (std, residual)
    attention = model.layers[0].self_attention
    assert 0.8 * residual < float(attention.dense.weight.detach().std()) < 1.2 * residual
    assert float(attention.linear_kv_up_proj.weight.detach().std()) > 0.015  # not a residual: 0.02
    assert torch.equal(attention.q_layernorm.weight, torch.ones(12))
    assert torch.equal(attention.kv_layernorm.weight, torch.ones(16))
    x = torch.randn(2, 8, 32)  # routed + shared: the shared expert's output is added
    with torch.no_grad():
        both = block(x)
        block.shared_experts = None
        assert torch.allclose(both - block(x), shared(x), atol=1e-6)


def test_mla_declarations_at_one_rank_and_refusal_above():
    model = GPT(ModelConfig(**TINY))
    plan = model.tensor_parallel_plan(tp_size=1)
    assert not any("self_attention" in k for k in plan)
    with pytest.raises(ValueError, match="not built under tensor parallelism"):
        model.tensor_parallel_plan(tp_size=2)
    modules = model.context_parallel_modules()
    assert modules.heads == [4, 4, 4] and len(modules.positions) == 4


def _flags(*extra: str):
    return build_parser().parse_args(["--arch", "deepseek", "--num-layers", "3", "--hidden-size", "32",
                                      "--seq-len", "16", *extra])


def test_the_trainers_deepseek_flags():
    dims = ["--kv-lora-rank", "16", "--q-lora-rank", "12", "--qk-nope-head-dim", "8", "--qk-rope-head-dim",
            "4", "--v-head-dim", "6"]
    model = config_from_args(_flags(*dims, "--moe-experts", "4", "--moe-shared-experts", "1",
                                    "--moe-first-dense", "1")).model
    assert (model.attention_type, model.kv_lora_rank, model.q_lora_rank, model.qk_nope_head_dim,
            model.qk_rope_head_dim, model.v_head_dim) == ("mla", 16, 12, 8, 4, 6)
    assert (model.score_func, model.moe_load_balance, model.moe_activation, model.moe_normalize_topk,
            model.moe_shared_experts, model.moe_first_dense, model.moe_layers) == (
                "sigmoid", "bias", "swiglu", True, 1, 1, [1, 2])
    aux = config_from_args(_flags(*dims, "--moe-experts", "4", "--moe-load-balance", "aux")).model
    assert aux.moe_load_balance == "aux"
    with pytest.raises(ConfigError, match="needs kv_lora_rank"):
        config_from_args(_flags(*dims[2:]))
    with pytest.raises(ConfigError, match="--moe-experts"):
        config_from_args(_flags(*dims, "--moe-shared-experts", "1"))


def test_a_missing_mla_dimension_exits_2_with_one_line(capsys):
    from refimpl.train.cli import main

    assert main(["--arch", "deepseek", "--kv-lora-rank", "16", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ModelConfig: attention_type='mla' needs qk_nope_head_dim"), err
    assert "--v-head-dim" in err and err.count("\n") == 1
