"""refimpl/nn/linear.py, the one linear seam: with nothing given it is ``F.linear`` (bitwise, autograd's own
backward); with a deferred weight gradient the backward returns ``dX`` and ``db`` bitwise as the plain layer
and queues ``dW`` until the store's ``W``; with a sequence gather (here a fake group of two: the gather
concatenates the rank's chunk with a fixed other chunk, the reduce-scatter keeps the rank's chunk of the
sum) the forward is the linear of the gathered input and only the local input is saved; the pluggable
matmul is the forward's product, and a matmul that brings its backward GEMMs (fp8's ``Float8Matmul``)
computes all three, under a gather and a store too, bit for bit as its own autograd does. Every model
linear and the defer swap go through it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from refimpl.config import ModelConfig
from refimpl.models import GPT
from refimpl.nn.linear import Linear, SequenceGather, linear_with_grad
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore, defer_weight_gradients
from refimpl.precision.fp8 import Float8Config, Float8Linear, Float8Matmul, float8_linear


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    w = torch.randn(5, 8, generator=g, requires_grad=True)
    b = torch.randn(5, generator=g, requires_grad=True)
    dy = torch.randn(2, 6, 5, generator=g)
    return x, w, b, dy


def test_without_options_it_is_f_linear_bitwise():
    x, w, b, dy = _inputs()
    linear_with_grad(x, w, b).backward(dy)
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.linear(x, w, b).backward(dy)
    assert all(torch.equal(a, t.grad) for a, t in zip(got, (x, w, b), strict=True))


def test_a_deferred_weight_gradient_waits_for_its_w():
    x, w, b, dy = _inputs()
    F.linear(x, w, b).backward(dy)
    want = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    store = WeightGradStore()
    with store.capture(("stage", 0)):
        linear_with_grad(x, w, b, weight_grad_store=store).backward(dy)
    assert w.grad is None and len(store) == 1  # B: dX and db only
    assert torch.equal(x.grad, want[0]) and torch.equal(b.grad, want[2])
    assert store.flush(("stage", 0)) == 1
    torch.testing.assert_close(w.grad, want[1], rtol=1e-6, atol=1e-6)  # W: dW = dY^T X


def _fake_gather(other: torch.Tensor, rank: int) -> SequenceGather:
    """Rank ``rank`` of a group of two whose other rank holds ``other`` (constant): the gather along the
    sequence and its adjoint (the sum over ranks of a replicated ``dX`` is ``2 dX``; my chunk of it)."""
    s = other.shape[1]

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        parts = [x, other.to(x.dtype)] if rank == 0 else [other.to(x.dtype), x]
        return torch.cat(parts, dim=1)

    def reduce_scatter(dx: torch.Tensor) -> torch.Tensor:
        return (2 * dx).narrow(1, rank * s, s)

    return SequenceGather(all_gather=all_gather, reduce_scatter=reduce_scatter)


def test_a_sequence_gather_saves_the_local_input_and_defers_on_request():
    x, w, b, _ = _inputs()
    other = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(2, 12, 5, generator=torch.Generator().manual_seed(6))
    full = torch.cat([x.detach(), other], dim=1).requires_grad_()
    F.linear(full, w, b).backward(dy)
    want_dx, want_dw, want_db = 2 * full.grad[:, :6], w.grad.clone(), b.grad.clone()
    for deferred in (False, True):
        w.grad = b.grad = x.grad = None
        store = WeightGradStore() if deferred else None
        y = linear_with_grad(x, w, b, sequence_gather=_fake_gather(other, 0), weight_grad_store=store)
        assert y.shape == (2, 12, 5)
        torch.testing.assert_close(y, F.linear(full, w, b), rtol=0, atol=0)
        saved = [t.shape for t in y.grad_fn.saved_tensors]
        assert (2, 6, 8) in saved and (2, 12, 8) not in saved  # only the local input
        with store.capture(0) if deferred else contextlib.nullcontext():
            y.backward(dy)
        if deferred:
            assert w.grad is None and store.flush(0) == 1
        torch.testing.assert_close(x.grad, want_dx, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w.grad, want_dw, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b.grad, want_db, rtol=1e-6, atol=1e-6)


def test_the_matmul_is_pluggable():
    x, w, b, dy = _inputs()
    calls = []

    def matmul(x, w, b):
        calls.append(x.shape)
        return F.linear(x, w, b)

    layer = Linear(8, 5)
    layer.matmul = matmul
    layer(x).backward(dy)
    store = WeightGradStore()
    linear_with_grad(x, w, b, weight_grad_store=store, matmul=matmul).backward(dy)
    assert calls == [(2, 6, 8), (2, 6, 8)]


def test_the_model_linears_are_the_seam_and_defer_sets_the_store():
    model = GPT(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, max_seq_len=8,
                            vocab_size=32), seed=0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 5 and all(type(m) is Linear for m in linears)
    store = WeightGradStore()
    defer_weight_gradients(model, store)
    assert all(m.weight_grad_store is store for m in linears)
    plain = nn.Sequential(nn.Linear(4, 3))  # a plain nn.Linear: its forward swapped as before
    defer_weight_gradients(plain, store)
    with store.capture(1):
        plain(torch.randn(2, 4)).sum().backward()
    assert plain[0].weight.grad is None and store.flush(1) == 1 and plain[0].weight.grad is not None


def _sum_bound(dy: torch.Tensor, rounding: float = 0.0) -> torch.Tensor:
    """How far two orders of ``db = sum_tokens dy`` may differ in fp32: ``2 (n - 1) eps sum |dy|`` per
    output (Higham's bound for any order), plus ``rounding`` of the result (when both sums are rounded
    to bf16 after: half an ulp each, at most 2^-8 of the value, so 2^-7)."""
    dy2 = dy.float().reshape(-1, dy.shape[-1])
    eps = torch.finfo(torch.float32).eps
    return 2 * (dy2.shape[0] - 1) * eps * dy2.abs().sum(0) + rounding * dy2.sum(0).abs()


def _fp8_grads(y: torch.Tensor, dy: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    for t in tensors:
        t.grad = None
    y.backward(dy)
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8s_split_matmul_keeps_all_three_gemms_fp8_under_a_gather_and_a_store(scaling):
    """The seam's own backward with ``Float8Matmul`` gives float8_linear's gradients: ``dX`` and ``dW`` bit
    for bit (the same casts, the same ``_scaled_mm`` calls), ``db`` within two fp32 orders of summation
    (the seam sums ``[tokens, out]``, autograd ``[b, s, out]``: ``_sum_bound``). Negative control:
    the fp8 product given as a plain callable (the seam then computes the backward GEMMs in high
    precision) is not fp8's."""
    config = Float8Config.recipe(scaling)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 16, generator=g, requires_grad=True)
    other = torch.randn(2, 8, 16, generator=g)
    w = (torch.randn(32, 16, generator=g) * 0.2).requires_grad_()
    b = torch.randn(32, generator=g, requires_grad=True)
    dy = torch.randn(2, 16, 32, generator=g)
    full = torch.cat([x.detach(), other], dim=1).requires_grad_()
    ref_dx, ref_dw, ref_db = _fp8_grads(float8_linear(full, w, b, config=config), dy, full, w, b)
    want_dx = 2 * ref_dx[:, :8]                  # the fake gather's adjoint: twice my chunk
    split = Float8Matmul(config=config)
    for deferred in (False, True):
        store = WeightGradStore() if deferred else None
        for t in (x, w, b):
            t.grad = None
        y = linear_with_grad(x, w, b, sequence_gather=_fake_gather(other, 0), weight_grad_store=store,
                             matmul=split)
        assert torch.equal(y, float8_linear(full, w, b, config=config).detach())
        with store.capture(0) if deferred else contextlib.nullcontext():
            y.backward(dy)
        if deferred:
            assert w.grad is None and store.flush(0) == 1
        assert torch.equal(x.grad, want_dx) and torch.equal(w.grad, ref_dw), (scaling, deferred)
        assert ((b.grad - ref_db).abs() <= _sum_bound(dy)).all()

    def plain(x, w, b):  # the same product, without backward GEMMs of its own
        return float8_linear(x, w, b, config=config)
    dx, dw = _fp8_grads(linear_with_grad(x, w, b, sequence_gather=_fake_gather(other, 0), matmul=plain),
                        dy, x, w)
    assert not torch.equal(dx, want_dx) and not torch.equal(dw, ref_dw)


def test_a_float8_linear_defers_its_weight_gradient_in_fp8():
    """zbh1 with fp8: the deferred ``dW`` of a Float8Linear is the one its plain backward computes, bitwise,
    under bf16 autocast too; the store holds it until ``W``."""
    layer = Float8Linear.from_linear(nn.Linear(16, 32))
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        want = _fp8_grads(y, dy.to(y.dtype), layer.weight, layer.bias)
        layer.weight_grad_store = store = WeightGradStore()
        layer.weight.grad = layer.bias.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        with store.capture("w"):
            y.backward(dy.to(y.dtype))
        assert layer.weight.grad is None and store.flush("w") == 1
        assert torch.equal(layer.weight.grad, want[0]), autocast
        bound = _sum_bound(dy, rounding=2.0 ** -7 if autocast else 0.0)  # bf16: two roundings
        assert ((layer.bias.grad - want[1]).abs() <= bound).all(), autocast
        layer.weight_grad_store = None


class _Boxed:
    """What a saved-tensors meter packs a tensor into (refimpl.measure's meters, activation offloading)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@pytest.mark.parametrize("around", ["saved_tensors_hooks", "checkpoint"])
def test_a_deferred_weight_gradient_reaches_the_parameter_through_saved_tensor_hooks(around):
    """Under ``saved_tensors_hooks`` (a meter's: TrainerProbe's at zbh1) and under non-reentrant activation
    checkpointing (its own hooks) the seam's saved weight comes back as another tensor object; the deferred
    ``dW`` must still land on the Parameter, equal to the plain layer's. (It landed on the unpacked copy
    before: TrainerProbe's measured zbh1 step lost every linear's weight gradient.)"""
    from torch.utils.checkpoint import checkpoint

    layer = Linear(8, 5)
    x, _, _, dy = _inputs()
    layer(x).backward(dy)
    want = layer.weight.grad.clone()
    layer.weight.grad = layer.bias.grad = None
    layer.weight_grad_store = store = WeightGradStore()
    if around == "saved_tensors_hooks":
        with torch.autograd.graph.saved_tensors_hooks(_Boxed, lambda boxed: boxed.t):
            y = layer(x)
    else:
        y = checkpoint(layer, x, use_reentrant=False)
    with store.capture("w"):
        y.backward(dy)
    assert layer.weight.grad is None and store.flush("w") == 1
    assert layer.weight.grad is not None, "the deferred dW went to a copy of the weight"
    torch.testing.assert_close(layer.weight.grad, want, rtol=1e-6, atol=1e-6)
