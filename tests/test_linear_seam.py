"""refimpl/nn/linear.py, the one linear seam: with nothing given it is ``F.linear`` (bitwise, autograd's own
backward); with a deferred weight gradient the backward returns ``dX`` and ``db`` bitwise as the plain layer
and queues ``dW`` until the store's ``W``; with a sequence gather (here a fake group of two: the gather
concatenates the rank's chunk with a fixed other chunk, the reduce-scatter keeps the rank's chunk of the
sum) the forward is the linear of the gathered input and only the local input is saved; the pluggable
matmul is the forward's product. Every model linear and the defer swap go through it."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from refimpl.config import ModelConfig
from refimpl.model import GPT
from refimpl.nn.linear import Linear, SequenceGather, linear_with_grad
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore, defer_weight_gradients


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
