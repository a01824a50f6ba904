"""The course's GPT: shapes, parameter count, seeded init, tied weights, causality, loss, sampling."""

from __future__ import annotations

import math

import pytest
import torch

from refimpl.config import ModelConfig
from refimpl.models import GPT, generate, lm_loss
from refimpl.planner import num_param_tensors, param_count

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=16)


def _ids(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


def test_output_shapes():
    model = GPT(TINY)
    for b, s in [(3, 16), (1, 1), (2, 7)]:
        assert model(_ids(b, s)).shape == (b, s, TINY.vocab_size)


@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=16,
                    tie_word_embeddings=False),
        ModelConfig(num_layers=3, hidden_size=24, num_attention_heads=3, ffn_hidden_size=37, max_seq_len=9),
        ModelConfig(num_layers=1, hidden_size=24, num_attention_heads=2, ffn_hidden_size=37, max_seq_len=9,
                    vocab_size=300, tie_word_embeddings=False),
        ModelConfig(),
    ],
    ids=["tied", "untied", "odd-ffn", "odd-ffn-untied", "default"],
)
def test_param_count_matches_planner(cfg):
    model = GPT(cfg)
    params = list(model.parameters())  # a tied weight appears once
    assert sum(p.numel() for p in params) == param_count(cfg).total
    assert len(params) == num_param_tensors(cfg)


def test_tied_and_untied_differ_by_one_output_matrix():
    untied = ModelConfig(**{**TINY.to_dict(), "tie_word_embeddings": False})
    diff = param_count(untied).total - param_count(TINY).total
    assert diff == TINY.hidden_size * TINY.vocab_size
    assert sum(p.numel() for p in GPT(untied).parameters()) - sum(p.numel() for p in GPT(TINY).parameters()) \
        == diff


def test_tied_weights_are_the_same_tensor():
    model = GPT(TINY)
    assert model.output_layer.weight is model.embedding.word_embeddings.weight
    untied = GPT(ModelConfig(**{**TINY.to_dict(), "tie_word_embeddings": False}))
    assert untied.output_layer.weight is not untied.embedding.word_embeddings.weight
    assert not torch.equal(untied.output_layer.weight, untied.embedding.word_embeddings.weight)


def test_init_is_a_pure_function_of_the_seed():
    a, b, c = GPT(TINY, seed=7), GPT(TINY, seed=7), GPT(TINY, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k  # bitwise
    random_tensors = [k for k in sa if k.endswith("weight") and "layernorm" not in k]
    assert random_tensors
    for k in random_tensors:
        assert not torch.equal(sa[k], sc[k]), k  # a different seed gives different weights


def test_init_does_not_touch_the_global_rng():
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    GPT(TINY, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    # Negative control: drawing from the global RNG does change the state this test watches.
    torch.randn(1)
    assert not torch.equal(torch.random.get_rng_state(), before)


def test_init_statistics():
    model = GPT(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_seq_len=64))
    layer = model.layers[0]
    assert torch.all(layer.self_attention.query_key_value.bias == 0)
    assert torch.all(layer.input_layernorm.weight == 1)
    assert abs(layer.mlp.dense_h_to_4h.weight.std().item() - 0.02) < 0.002
    residual_std = 0.02 / math.sqrt(2 * 2)
    assert abs(layer.mlp.dense_4h_to_h.weight.std().item() - residual_std) < 0.002


def test_causality():
    model = GPT(TINY)
    x = _ids(2, 12)
    y = x.clone()
    t = 7
    y[:, t] = (y[:, t] + 1) % 256  # change one future token
    with torch.no_grad():
        lx, ly = model(x), model(y)
    assert torch.equal(lx[:, :t], ly[:, :t])  # earlier positions cannot see it
    assert not torch.allclose(lx[:, t:], ly[:, t:])  # negative control: later positions do


def test_lm_loss_with_global_token_count_sums_to_the_mean():
    model = GPT(TINY)
    x, y = _ids(6, 10, seed=1), _ids(6, 10, seed=2)
    with torch.no_grad():
        logits = model(x)
    mean = lm_loss(logits, y)
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
    torch.testing.assert_close(mean, reference)
    # Uneven chunks (as on ranks with unequal batches): each normalised by the total token count.
    chunks = [(0, 1), (1, 4), (4, 6)]
    summed = sum(lm_loss(logits[a:b], y[a:b], num_tokens=y.numel()) for a, b in chunks)
    torch.testing.assert_close(summed, mean, rtol=1e-6, atol=0)
    # Negative control: averaging per-chunk means of unequal chunks is not the global mean.
    naive = sum(lm_loss(logits[a:b], y[a:b]) for a, b in chunks) / len(chunks)
    assert abs(naive.item() - mean.item()) > 1e-4


def test_initial_loss_is_close_to_uniform():
    model = GPT(ModelConfig())
    x = _ids(4, 64, seed=5)
    with torch.no_grad():
        loss = lm_loss(model(x[:, :-1]), x[:, 1:]).item()
    assert abs(loss - math.log(256)) < 0.5


def test_generate_is_deterministic_for_a_seed():
    model = GPT(TINY).eval()
    prompt = torch.tensor([10, 20, 30], dtype=torch.long)
    out = generate(model, prompt, max_new_tokens=20, seed=4)  # longer than max_seq_len: context is cropped
    assert out.shape == (23,) and out.dtype == torch.long
    assert torch.equal(out[:3], prompt)
    assert torch.equal(out, generate(model, prompt, max_new_tokens=20, seed=4))
    assert int(out.min()) >= 0 and int(out.max()) < 256
    others = [generate(model, prompt, max_new_tokens=20, seed=s) for s in (5, 6)]
    assert any(not torch.equal(out, o) for o in others)  # the seed matters
