"""Activation checkpointing and saved-tensor measurement (chapter 05): identical gradients, bytes equal to the
planner's formula, and the recompute measured in FLOPs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from refimpl.config import ModelConfig
from refimpl.measure import OUTSIDE, measure_saved_activations
from refimpl.models import GPT, lm_loss
from refimpl.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    is_checkpointed,
    parse_block_selection,
)
from refimpl.planner import activation_bytes, activation_bytes_per_layer, korthikanti_bytes_per_layer

CONFIG = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, max_seq_len=24, ffn_hidden_size=48)
B, S = 3, 20  # odd sizes on purpose


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(seed))


def grads_of(model: GPT, x: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = lm_loss(model(x), x)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_checkpointed_and_plain_blocks_give_identical_gradients(dtype):
    x = batch()
    plain = GPT(CONFIG)
    checkpointed = copy.deepcopy(plain)
    assert apply_activation_checkpointing(checkpointed, [0, -1]) == [0, 2]
    expected = grads_of(plain, x, dtype)
    got = grads_of(checkpointed, x, dtype)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))  # bit for bit


def test_selection_and_module_tree():
    model = GPT(CONFIG)
    names = list(model.state_dict())
    assert apply_activation_checkpointing(model) == [0, 1, 2]
    assert list(model.state_dict()) == names  # parameter names unchanged: checkpoints still load
    assert apply_activation_checkpointing(model, lambda i: i % 2 == 1) == [1]
    assert checkpointed_blocks(model) == [1]  # the call states the whole selection
    assert apply_activation_checkpointing(model, "none") == [] and not is_checkpointed(model.layers[1])
    with pytest.raises(IndexError, match="out of range"):
        apply_activation_checkpointing(model, [3])
    for spec, want in (("all", [0, 1, 2]), ("none", []), ("every-2", [0, 2]), ("1,-1", [1, 2])):
        assert apply_activation_checkpointing(model, parse_block_selection(spec)) == want
    with pytest.raises(ValueError, match="bad block selection"):
        parse_block_selection("every-0")
    with pytest.raises(ValueError, match="bad block selection"):
        parse_block_selection("first")
    apply_activation_checkpointing(model, [2])
    twin = copy.deepcopy(model)
    assert checkpointed_blocks(twin) == [2]
    assert twin.layers[2].forward.module is twin.layers[2]  # the copy recomputes its own block


def measure(model: GPT, x: torch.Tensor, dtype: torch.dtype | None = None):
    def forward():
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            return lm_loss(model(x), x)

    return measure_saved_activations(model, forward)


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("blocks", [[], [1], [0, 1, 2]])
def test_measured_saved_bytes_equal_the_formula(dtype, blocks):
    model = GPT(CONFIG)
    apply_activation_checkpointing(model, blocks)
    report = measure(model, batch(), dtype)
    planned = activation_bytes(CONFIG, micro_batch=B, seq_len=S, compute_dtype=dtype or torch.float32,
                               checkpointed_blocks=blocks)
    assert report.per_block() == planned
    for i in blocks:  # a checkpointed block keeps exactly its float32 input
        assert report.block_bytes(i) == 4 * B * S * CONFIG.hidden_size
        assert f"block {i}" not in report.weights  # nor the autocast weight copies
    assert report.activations[OUTSIDE]  # embedding, head and loss are measured apart


def test_a_16_bit_model_matches_the_formula_too():
    model = GPT(CONFIG).half()
    report = measure(model, batch())
    planned = activation_bytes(CONFIG, micro_batch=B, seq_len=S, compute_dtype=torch.float16,
                               residual_dtype=torch.float16)
    assert report.per_block() == planned


def test_weights_are_not_counted_as_activations():
    model = GPT(CONFIG)
    report = measure(model, batch(2))
    # fp32: every Linear saves its weight (transposed view) and every LayerNorm its weight and bias
    block = model.layers[0]
    weight_bytes = sum(m.weight.numel() * 4 for m in block.modules() if isinstance(m, torch.nn.Linear))
    ln_bytes = sum(p.numel() * 4 for m in block.modules() if isinstance(m, torch.nn.LayerNorm)
                   for p in m.parameters())
    assert sum(report.weights["block 0"].values()) == weight_bytes + ln_bytes
    # and the activations grow with the batch, linearly (no s^2 term with fused attention)
    bigger = measure(model, torch.cat([batch(2), batch(3)]))
    assert bigger.block_bytes(0) == 2 * report.block_bytes(0)


def test_formula_terms():
    # 16-bit compute, fp32 residual, f = 4h: s b h (36) + 16 s b + 4 a s b (see the module docstring)
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, max_seq_len=128)
    s, b, h, a = 128, 2, 64, 4
    got = activation_bytes_per_layer(config, micro_batch=b, seq_len=s, compute_dtype=torch.bfloat16).total
    assert got == 36 * s * b * h + 16 * s * b + 4 * a * s * b
    assert korthikanti_bytes_per_layer(seq_len=s, micro_batch=b, hidden_size=h, num_heads=a) == (
        s * b * h * (34 + 5 * a * s // h))


def flops(model: GPT, x: torch.Tensor) -> tuple[int, dict]:
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(x), x).backward()
    return counter.get_total_flops(), counter.get_flop_counts()


def test_recompute_costs_one_forward_of_the_checkpointed_blocks():
    """Counted under the math attention kernel: the fused CPU kernel has no FLOP formula, and the
    recomputed attention would be missing from the count."""
    with sdpa_kernel(SDPBackend.MATH):
        x = batch()
        model = GPT(CONFIG)
        with FlopCounterMode(display=False) as counter:
            model(x)
        forward = counter.get_flop_counts()
        block_fwd = {i: sum(forward[f"GPT.layers.{i}"].values()) for i in range(CONFIG.num_layers)}
        last_linear = {i: sum(forward[f"GPT.layers.{i}.mlp.dense_4h_to_h"].values()) for i in range(3)}

        plain, _ = flops(model, x)
        apply_activation_checkpointing(model, [0, 2])
        with set_checkpoint_early_stop(False):
            full, _ = flops(model, x)
        early, _ = flops(model, x)
        b, t = x.shape
        attention = {i: forward[f"GPT.layers.{i}"].get(torch.ops.aten.bmm, 0) for i in (0, 2)}
        assert attention == {0: 4 * b * t * t * CONFIG.hidden_size, 2: 4 * b * t * t * CONFIG.hidden_size}
        assert full - plain == block_fwd[0] + block_fwd[2]  # one more forward of each, attention included
        # early stop: the recompute ends with the last tensor backward needs, so the last matmul is not rerun
        assert early - plain == block_fwd[0] + block_fwd[2] - last_linear[0] - last_linear[2]
