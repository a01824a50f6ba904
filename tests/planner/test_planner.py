"""The planner checked against measurements: FLOPs (FlopCounterMode), state bytes (AdamW), MFU from counted
FLOPs, and a run's memory per rank (SavedTensorMeter, the ZeRO formulas)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from refimpl.config import ModelConfig
from refimpl.distributed import ParallelDims
from refimpl.measure import measure_saved_activations
from refimpl.models import GPT, lm_loss
from refimpl.parallel.activation_checkpoint import apply_activation_checkpointing
from refimpl.planner import (
    flops_per_token,
    model_flops_utilization,
    num_param_tensors,
    param_count,
    param_shapes,
    run_memory_per_rank,
    state_memory,
    zero_memory,
)

ONE = ParallelDims(dp=1)  # one rank: the layout of a single-device run

CONFIGS = {
    "default": ModelConfig(),
    "untied-odd": ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=3, ffn_hidden_size=100,
                              max_seq_len=40, tie_word_embeddings=False),
}


def _measured_train_flops(cfg: ModelConfig, b: int, s: int) -> int:
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    # The math backend is plain matmuls + softmax, which the counter sees; fused kernels are counted by
    # their own formulas, which may differ.
    with sdpa_kernel(SDPBackend.MATH), counter:
        loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(("name", "b", "s"), [("default", 2, 128), ("untied-odd", 3, 40)])
def test_flops_per_token_matches_flop_counter(name, b, s):
    cfg = CONFIGS[name]
    measured = _measured_train_flops(cfg, b, s)
    predicted = flops_per_token(cfg, s, matmul_only=True) * b * s
    assert predicted == measured  # exact: every matmul is counted, nothing else
    total = flops_per_token(cfg, s) * b * s
    assert total > measured  # 6N counts embeddings, LayerNorms and biases that do no matmul
    if name == "default":
        # At the course's default size the PaLM formula with all N parameters is within 5%. (Not for
        # the tiny untied model, whose position and word embeddings are a quarter of N.)
        assert abs(total - measured) / measured < 0.05


def test_default_flops_per_token_documented_value():
    # b=16, s=128 for the defaults was measured as 11_676_942_336 FLOPs with FlopCounterMode; FLOPs are
    # linear in the batch, so the test above (b=2) covers the measurement and this pins the number.
    assert flops_per_token(ModelConfig(), 128, matmul_only=True) * 16 * 128 == 11_676_942_336


def test_flops_formula_terms():
    cfg = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=8, max_seq_len=32)
    n = param_count(cfg).total
    assert flops_per_token(cfg, 32) == 6 * n + 12 * 3 * 8 * 8 * 32
    # Doubling T adds exactly the attention term again.
    assert flops_per_token(cfg, 64) - flops_per_token(cfg, 32) == 12 * 3 * 8 * 8 * 32


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_memory_matches_measured_bytes(name):
    cfg = CONFIGS[name]
    model = GPT(cfg)
    params = list(model.parameters())
    assert len(params) == num_param_tensors(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    planned = state_memory(cfg)
    assert planned.weights == _tensor_bytes(params)
    assert planned.grads == _tensor_bytes(p.grad for p in params)
    assert planned.optimizer == _tensor_bytes(state)
    assert planned.total == planned.weights + planned.grads + planned.optimizer
    # Negative control: the step counters are real tensors, two moments alone would not match.
    moments = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    assert _tensor_bytes(moments) != planned.optimizer


def test_state_memory_other_precisions_and_optimizers():
    cfg = ModelConfig()
    n = param_count(cfg).total
    mixed = state_memory(cfg, param_bytes=2, grad_bytes=2)
    assert (mixed.weights, mixed.grads) == (2 * n, 2 * n)
    assert state_memory(cfg, optimizer="sgd").optimizer == 0
    with pytest.raises(ValueError, match="unknown optimizer"):
        state_memory(cfg, optimizer="lion")


def test_mfu_equals_counted_flops_over_peak():
    # MFU from the formula side (tokens/s x flops_per_token) must equal the FLOP/s a FlopCounterMode
    # counts over a real training step, divided by the peak: the two sides come from different sources.
    cfg, b, s = CONFIGS["untied-odd"], 3, 40
    counted = _measured_train_flops(cfg, b, s)
    elapsed, peak = 0.5, 67e12  # any duration and peak: the identity holds for all of them
    mfu = model_flops_utilization(b * s / elapsed, flops_per_token(cfg, s, matmul_only=True), 1, peak)
    assert mfu == pytest.approx(counted / elapsed / peak, rel=1e-12)
    # Negative control: the default (all-N) formula over-counts, so its MFU is higher than the counted one.
    assert model_flops_utilization(b * s / elapsed, flops_per_token(cfg, s), 1, peak) > mfu * 1.01


# -- the run's memory per rank (the trainer's preflight) -------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_param_shapes_are_the_models(tied):
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, max_seq_len=16,
                         tie_word_embeddings=tied)
    assert param_shapes(config) == [tuple(p.shape) for p in GPT(config, seed=0).parameters()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointed", [(), (1,)])
def test_run_memory_activations_equal_the_measured_saved_bytes(precision, checkpointed):
    """The planner's saved-activation terms equal, to the byte, what SavedTensorMeter measures in one
    forward + loss of a small model: per block, and outside the blocks (final LayerNorm, output layer input,
    fp32 log-softmax, int64 ids). The transient logits term is not a saved tensor and is left out."""
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, max_seq_len=16)
    b, s = 3, 16
    model = GPT(config, seed=0)
    apply_activation_checkpointing(model, list(checkpointed))
    x, y = torch.randint(0, 256, (b, s)), torch.randint(0, 256, (b, s))
    dtype = {"fp32": None, "bf16": torch.bfloat16}[precision]

    def forward():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        return lm_loss(logits, y)

    measured = measure_saved_activations(model, forward)
    plan = run_memory_per_rank(config, ONE, micro_batch=b, seq_len=s, precision=precision,
                               checkpointed_blocks=checkpointed)
    a = plan.activations
    assert a["block activations"] == sum(measured.per_block())
    saved = (a["block activations"] + a["final layernorm + output layer inputs"] + a["log-softmax (fp32)"]
             + a["token ids, labels, positions"])
    assert saved == measured.total
    # Negative control: another micro-batch is another figure (the comparison can fail).
    other = run_memory_per_rank(config, ONE, micro_batch=b + 1, seq_len=s, precision=precision,
                                checkpointed_blocks=checkpointed)
    assert other.activations["block activations"] != sum(measured.per_block())


def test_run_memory_state_follows_the_zero_stage():
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, max_seq_len=16)
    shapes = [tuple(p.shape) for p in GPT(config, seed=0).parameters()]
    plain = run_memory_per_rank(config, ONE, micro_batch=1, seq_len=16)
    assert sum(plain.state.values()) == state_memory(config).total  # stage 0, one rank: the full replica
    for stage in (1, 2, 3):
        plan = run_memory_per_rank(config, ParallelDims(dp=4), micro_batch=1, seq_len=16, zero_stage=stage)
        z = zero_memory(shapes, 4, stage)
        assert (plan.state["weights"], plan.state["grads"], plan.state["AdamW state"]) == (
            z.weights, z.grads, z.optimizer)
    assert "ZeRO-3 gathered units" in plan.state
    bf16 = run_memory_per_rank(config, ONE, micro_batch=1, seq_len=16, precision="bf16")
    assert bf16.state["autocast weight copies"] == 2 * param_count(config).matmul
    with pytest.raises(ValueError, match="unknown precision"):
        run_memory_per_rank(config, ONE, micro_batch=1, seq_len=16, precision="fp4")


# Llama 3's published shapes and sizes (Dubey et al. 2024, "The Llama 3 Herd of Models"; the model cards)
LLAMA3 = {"8B": (4096, 32, 32, 14336, 8.03), "70B": (8192, 80, 64, 28672, 70.6),
          "405B": (16384, 126, 128, 53248, 405.9)}


@pytest.mark.parametrize("size", list(LLAMA3))
def test_the_llama_form_counts_llama3s_published_parameters(size):
    """The Llama form's count (GQA's k/v at 8 heads, SwiGLU, RMSNorm, no biases, an untied head over a
    vocabulary of 128,256) gives Llama 3's published sizes to their last printed digit; GPT-2's form of the
    same shape does not."""
    from refimpl.config import LLAMA

    h, layers, heads, ffn, published = LLAMA3[size]
    shape = dict(hidden_size=h, num_layers=layers, num_attention_heads=heads, ffn_hidden_size=ffn,
                 vocab_size=128256, max_seq_len=8192)
    llama = ModelConfig(**LLAMA, num_key_value_heads=8, **shape)
    digits = 2 if published < 10 else 1
    assert round(param_count(llama).total / 1e9, digits) == published
    assert round(param_count(ModelConfig(**shape)).total / 1e9, digits) != published


# The DeepSeek-V3 form in miniature: multi-head latent attention (with and without the query latent), a
# shared expert, a dense first block; dims chosen apart so that a swapped term changes the count
def _deepseek_form(**fields) -> ModelConfig:
    from refimpl.config import DEEPSEEK_V3

    shape = dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=64,
                 max_seq_len=16, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=6, num_experts=4, top_k=2, moe_ffn_hidden_size=20, moe_shared_experts=1,
                 moe_first_dense=1)
    return ModelConfig(**{**DEEPSEEK_V3, **shape, **fields})


@pytest.mark.parametrize("fields", [{}, {"q_lora_rank": None},
                                    {"moe_shared_experts": 2, "moe_first_dense": 0}])
def test_the_deepseek_form_counts_its_parameters_and_a_flop_counters_flops(fields):
    """``param_count`` of the DeepSeek-V3 form is the model's ``numel`` (MLA's projections and two norms, the
    shared experts, the dense first blocks), and its matmul FLOPs (``6 x`` the weights a token multiplies
    plus ``6 L a (d_qk + d_v) s`` for the scores and the weighted sum) equal FlopCounterMode's in float64
    (the experts' per-expert loop, plain matmuls)."""
    config = _deepseek_form(**fields)
    model = GPT(config, seed=1).double()
    assert sum(p.numel() for p in model.parameters()) == param_count(config).total
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    assert counter.get_total_flops() == flops_per_token(config, 16, matmul_only=True) * 2 * 16


# DeepSeek-V3 (DeepSeek-AI 2024): 671B total, 37B activated; Kimi K2 (Moonshot AI 2025): 1T, 32B
@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_the_deepseek_form_counts_the_published_sizes(name):
    """The presets' count gives the model cards' totals and activated sizes to their last printed digit
    (activated: the weights a token multiplies, ``ParamCount.matmul``); negative controls: no shared expert,
    and for DeepSeek-V3 every block MoE (no dense first blocks), is another model (Kimi K2's one dense block
    changes its count below the digits its card prints)."""
    import dataclasses

    from refimpl.planner.presets import MODEL_PRESETS, printed_like

    preset = MODEL_PRESETS[name]
    config = preset.config(max_seq_len=4096)
    count = param_count(config)
    assert printed_like(count.total, preset.published) == preset.published
    assert printed_like(count.matmul, preset.published_active) == preset.published_active
    assert count.experts == len(config.moe_layers) * config.num_experts * 3 * 7168 * 2048
    for wrong in [{"moe_shared_experts": 0}] + [{"moe_first_dense": 0}] * (name == "deepseek-v3"):
        other = param_count(dataclasses.replace(config, **wrong))
        printed = (printed_like(other.total, preset.published),
                   printed_like(other.matmul, preset.published_active))
        assert printed != (preset.published, preset.published_active), wrong


def test_the_exact_planner_refuses_multi_head_latent_attention():
    """``predict_run`` and ``run_memory_of`` count the saved tensors of the course's attention, not MLA's:
    they refuse the DeepSeek form (dense here) in one sentence instead of predicting wrong bytes, and the
    same layout of the Llama form is predicted (the control)."""
    from refimpl.config import LLAMA, ConfigError, ParallelConfig
    from refimpl.planner import predict_run, run_memory_of

    mla = _deepseek_form(num_experts=0, moe_shared_experts=0, moe_first_dense=0)
    llama = ModelConfig(**LLAMA, num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64,
                        max_seq_len=16)
    parallel = ParallelConfig(dp=2)
    for config in (mla, llama):
        refused = config is mla
        for call in (lambda c=config: predict_run(c, parallel, seq_len=16, global_batch=4),
                     lambda c=config: run_memory_of(c, parallel, world_size=2, micro_batch=2, seq_len=16)):
            if refused:
                with pytest.raises(ConfigError, match="do not model multi-head latent attention"):
                    call()
            else:
                call()
