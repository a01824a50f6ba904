"""Checks of chapter 06's exercises (``exercises/06_tensor_parallel.py``); see exercises/grading.py.

Every task runs on a world of 4 ranks as two tensor-parallel pairs with their own data
(``exercises.checks.ch06_harness``; each rank loads the graded file by path), the pair handed over as
an explicit group object, and a ``refimpl.comm.CommTracer`` counts the collectives in forward and in
backward separately.

* ``f`` and ``g`` on integer-valued tensors that differ per rank: forward and backward bit for bit against
  their definition (identity / sum over the pair), one all-reduce of the tensor's size in the right
  direction and none in the other, the input never modified; then on a group of the rank alone (the
  identity both ways: an implementation that ignores ``group`` and reduces over the world fails).
* ``ColumnParallelLinear`` and ``RowParallelLinear`` built from an ``nn.Linear`` with integer-valued
  weights (so every sum is exact and the comparison is bitwise): the shard of each tensor, the output, the
  input and weight gradients against the full layer's, one all-reduce (backward for the column layer,
  forward for the row layer), no bias, a size that does not divide (``ValueError``). Ranks 2 and 3 are
  ranks 0 and 1 of their pair: a layer that takes the world's rank or size holds the wrong block.
* ``vocab_parallel_cross_entropy`` against ``F.cross_entropy`` on the gathered logits, loss and gradient,
  within ``FACTOR`` x the spread measured in the same run (``F.cross_entropy`` in float32 against float64
  on the same inputs), on logits of ordinary size and of size +-200 (where ``exp`` overflows float32); the
  forward exchanges at most three float32 tensors of the target's size, the backward nothing.
* sequence parallelism's three conjugates and the fused-qkv shard: ``exercises.checks.ch06_sequence``.

``MUTANTS`` holds plausible wrong implementations, several for some tasks (tests/course/cli/test_exercises.py
grades each and expects exactly its task to fail).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from exercises.checks.ch06_harness import TIMEOUT_S, WORLD, T, groups, pair_seed
from exercises.checks.ch06_harness import expect as _expect
from exercises.checks.ch06_harness import ints as _ints
from exercises.checks.ch06_sequence import check_gather, check_qkv, check_reduce_scatter, check_scatter
from exercises.grading import Task, load_module, probe_stub

FACTOR = 4.0  # stated: the loss may be this many times further from float64 than F.cross_entropy in float32


# ---- tasks 1 and 2: f and g ------------------------------------------------------------------------------


def _conjugate_on_rank(ctx, path: str, which: str) -> None:
    from refimpl.comm import CommTracer

    torch.set_num_threads(1)
    fn = getattr(load_module(path), which)
    g = groups()
    pair, alone, r, shape = g.pair, g.alone, g.rank, (3, 5)
    xs = [_ints(shape, pair_seed(1 + k, g), ctx.device) for k in range(T)]   # each rank's input
    dys = [_ints(shape, pair_seed(10 + k, g), ctx.device) for k in range(T)]  # each rank's output gradient
    is_f = which == "copy_to_tensor_parallel_region"
    name = "f" if is_f else "g"
    for group, where in ((pair, "on the group of 2 ranks"), (alone, "on a group of your rank alone")):
        ranks = range(T) if group is pair else [r]
        x = xs[r].clone().requires_grad_()
        with CommTracer() as tracer:
            y = fn(x, group)
            tracer.step()
            (y * dys[r]).sum().backward()  # not y.backward(dy): that imports sympy (1 s a rank)
        want_y = xs[r] if is_f else sum(xs[k] for k in ranks)
        want_dx = sum(dys[k] for k in ranks) if is_f else dys[r]
        assert isinstance(y, torch.Tensor) and y.shape == x.shape, f"{name} {where}: output shape changed"
        assert torch.equal(x.detach(), xs[r]), f"{name} {where} modified its input in place"
        if is_f and torch.equal(y.detach(), sum(xs)):
            raise AssertionError(f"f {where}: forward returned the sum over ranks; f's input is already "
                                 "whole on every rank, so an all-reduce there makes it t times too large")
        assert torch.equal(y.detach(), want_y), (
            f"{name} {where}: forward gave {y.detach().flatten()[:4].tolist()}..., want "
            f"{want_y.flatten()[:4].tolist()}... ({'x itself' if is_f else 'the sum over ranks of x'})")
        assert x.grad is not None, f"{name} {where}: no gradient reached the input"
        if not is_f and torch.equal(x.grad, sum(dys)):
            raise AssertionError(f"g {where}: backward summed the gradient over ranks; the gradient of a sum "
                                 "with respect to each term is the output gradient itself")
        assert torch.equal(x.grad, want_dx), (
            f"{name} {where}: backward gave {x.grad.flatten()[:4].tolist()}..., want "
            f"{want_dx.flatten()[:4].tolist()}... ({'the sum over ranks of dy' if is_f else 'dy itself'})")
        if group is pair:
            one = [("all_reduce", x.numel() * x.element_size())]
            _expect(tracer, 0, [] if is_f else one, f"{name} forward")
            _expect(tracer, 1, one if is_f else [], f"{name} backward")


def check_f(path: str) -> None:
    probe_stub(load_module(path).copy_to_tensor_parallel_region, torch.zeros(2), None)
    _run_conjugate(path, "copy_to_tensor_parallel_region")


def check_g(path: str) -> None:
    probe_stub(load_module(path).reduce_from_tensor_parallel_region, torch.zeros(2), None)
    _run_conjugate(path, "reduce_from_tensor_parallel_region")


def _run_conjugate(path: str, which: str) -> None:
    from exercises.rank_batch import run_ranks

    run_ranks(_conjugate_on_rank, WORLD, path, which, timeout_s=TIMEOUT_S)


# ---- tasks 3 and 4: the parallel linears ------------------------------------------------------------------


def _full(in_f: int, out_f: int, bias: bool, lead: tuple[int, ...], device: torch.device, seed: int) -> dict:
    """An integer-valued nn.Linear, its input and output gradient, and its exact output and gradients."""
    linear = nn.Linear(in_f, out_f, bias=bias, device=device)
    with torch.no_grad():
        linear.weight.copy_(_ints((out_f, in_f), seed + 20 + in_f, device))
        if bias:
            linear.bias.copy_(_ints((out_f,), seed + 30 + out_f, device))
    x = _ints((*lead, in_f), seed + 40, device).requires_grad_()
    dy = _ints((*lead, out_f), seed + 50, device)
    ref = copy.deepcopy(linear)
    y = ref(x)
    (y * dy).sum().backward()
    return {"linear": linear, "x": x.detach(), "dy": dy, "y": y.detach(), "dx": x.grad,
            "dw": ref.weight.grad, "db": None if ref.bias is None else ref.bias.grad}


def _check_shards(layer: nn.Module, want: dict[str, torch.Tensor | None], cls: str, split: str) -> None:
    for name, value in want.items():
        got = getattr(layer, name, None)
        if value is None:
            assert got is None, f"{cls}.{name} must be None when the full layer has no {name}"
            continue
        assert isinstance(got, nn.Parameter), f"{cls}.{name} must be an nn.Parameter, not {type(got)}"
        assert tuple(got.shape) == tuple(value.shape), (
            f"{cls}.{name} has shape {tuple(got.shape)}, want {tuple(value.shape)}: {split}")
        assert torch.equal(got.detach(), value), f"{cls}.{name} is not this rank's block of the full layer's"
    held = sum(t.numel() for t in [*layer.parameters(), *layer.buffers()])
    shard = sum(v.numel() for v in want.values() if v is not None)
    assert held == shard, (f"{cls} holds {held} numbers in parameters and buffers, its shard is {shard}: "
                           "keep only this rank's block (t times less memory is the point)")


def _linear_on_rank(ctx, path: str, cls: str) -> None:
    from refimpl.comm import CommTracer

    torch.set_num_threads(1)
    make = getattr(load_module(path), cls)
    g = groups()
    pair, r, column = g.pair, g.rank, cls == "ColumnParallelLinear"
    split = ("a column-parallel layer splits the output features (rows of the [out, in] weight)" if column
             else "a row-parallel layer splits the input features (columns of the [out, in] weight)")
    for in_f, out_f, bias in ((6, 8, True), (8, 6, True), (4, 6, False)):
        full = _full(in_f, out_f, bias, (3, 5), ctx.device, pair_seed(0, g))
        n = (out_f if column else in_f) // T
        mine = slice(r * n, (r + 1) * n)
        w, b = full["linear"].weight.detach(), None if not bias else full["linear"].bias.detach()
        layer = make(copy.deepcopy(full["linear"]), group=pair)
        if column:
            _check_shards(layer, {"weight": w[mine], "bias": None if b is None else b[mine]}, cls, split)
            x, dy = full["x"].clone().requires_grad_(), full["dy"][..., mine]
            want_y, want_dx = full["y"][..., mine], full["dx"]
        else:
            _check_shards(layer, {"weight": w[:, mine], "bias": b}, cls, split)
            x, dy = full["x"][..., mine].clone().requires_grad_(), full["dy"]
            want_y, want_dx = full["y"], full["dx"][..., mine]
        where = f"{cls}(nn.Linear({in_f}, {out_f}, bias={bias}))"
        with CommTracer() as tracer:
            y = layer(x)
            tracer.step()
            (y * dy).sum().backward()
        assert isinstance(y, torch.Tensor) and y.shape == want_y.shape, (
            f"{where}: output of shape {tuple(getattr(y, 'shape', ()))}, want {tuple(want_y.shape)}")
        if not column and b is not None and torch.equal(y.detach(), want_y + (T - 1) * b):
            raise AssertionError(f"{where}: the output holds the bias {T} times: each rank added it "
                                 "before the sum; add it once, after the reduction")
        assert torch.equal(y.detach(), want_y), (
            f"{where}: output differs from the full layer's (largest difference "
            f"{(y.detach() - want_y).abs().max().item():g})")
        assert x.grad is not None, f"{where}: no gradient reached the input"
        if column and not torch.equal(x.grad, want_dx):
            partial = dy @ w[mine]
            hint = (" it is this rank's part only: the parts of every rank must be summed (f, in backward)"
                    if torch.equal(x.grad, partial) else "")
            raise AssertionError(f"{where}: the input gradient differs from the full layer's;{hint}")
        assert torch.equal(x.grad, want_dx), f"{where}: the input gradient is not the full layer's block"
        assert layer.weight.grad is not None, f"{where}: the weight got no gradient"
        want_dw = full["dw"][mine] if column else full["dw"][:, mine]
        assert torch.equal(layer.weight.grad, want_dw), f"{where}: the weight gradient is wrong"
        if b is not None:
            want_db = full["db"][mine] if column else full["db"]
            assert layer.bias.grad is not None, f"{where}: the bias got no gradient on rank {r} of the pair"
            assert torch.equal(layer.bias.grad, want_db), f"{where}: the bias gradient is not the full's"
        one = [("all_reduce", (x if column else y).numel() * 4)]
        _expect(tracer, 0, [] if column else one, f"{where} forward")
        _expect(tracer, 1, one if column else [], f"{where} backward")
    bad = nn.Linear(6, 7) if column else nn.Linear(7, 6)
    try:
        make(bad, group=pair)
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - the message says what was raised instead
        raise AssertionError(f"{cls}(nn.Linear({bad.in_features}, {bad.out_features})) at t = 2 raised "
                             f"{type(exc).__name__}; a size that does not divide must raise ValueError"
                             ) from None
    raise AssertionError(f"{cls}(nn.Linear({bad.in_features}, {bad.out_features})) at t = 2 must raise "
                         "ValueError: that size does not divide into 2 equal blocks")


def _check_linear(path: str, cls: str) -> None:
    from exercises.rank_batch import run_ranks

    make = getattr(load_module(path), cls)
    probe_stub(lambda: make(nn.Linear(2, 2), group=None))
    run_ranks(_linear_on_rank, WORLD, path, cls, timeout_s=TIMEOUT_S)


def check_column(path: str) -> None:
    _check_linear(path, "ColumnParallelLinear")


def check_row(path: str) -> None:
    _check_linear(path, "RowParallelLinear")


# ---- task 5: the vocabulary-parallel loss -----------------------------------------------------------------


def _loss_cases(device: torch.device, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, full logits [..., V], target [...]): the same on both ranks of a pair."""
    g = torch.Generator().manual_seed(seed)
    ordinary = 3 * torch.randn(3, 5, 24, generator=g)
    target = torch.randint(0, 24, (3, 5), generator=g)
    large = torch.randn(6, 10, generator=g)
    large[0] += 200.0          # exp overflows float32 unless the max is subtracted first
    large[1] -= 200.0          # exp underflows to 0: log(0)
    large[2, 7] += 200.0       # one huge logit, on rank 1's block
    large[3, 1] -= 200.0
    large_target = torch.tensor([3, 8, 2, 1, 9, 4])  # the huge logit is not the target of row 2
    return [("logits of ordinary size, [3, 5, 24]", ordinary.to(device), target.to(device)),
            ("logits of size +-200, [6, 10]", large.to(device), large_target.to(device))]


def _cross_entropy(z: torch.Tensor, target: torch.Tensor, weight: torch.Tensor):
    """F.cross_entropy per token and the gradient of sum(weight * loss) with respect to ``z``."""
    z = z.clone().requires_grad_()
    loss = F.cross_entropy(z.flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    (loss * weight).sum().backward()
    return loss.detach(), z.grad


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _loss_on_rank(ctx, path: str) -> None:
    from refimpl.comm import CommTracer

    torch.set_num_threads(1)
    fn = load_module(path).vocab_parallel_cross_entropy
    g = groups()
    pair, r = g.pair, g.rank
    for what, logits, target in _loss_cases(ctx.device, pair_seed(6, g)):
        vocab = logits.shape[-1]
        mine = slice(r * vocab // T, (r + 1) * vocab // T)
        weight = torch.rand(target.shape, generator=torch.Generator().manual_seed(7)).to(ctx.device) + 0.5
        ref32, grad32 = _cross_entropy(logits, target, weight)
        ref64, grad64 = _cross_entropy(logits.double(), target, weight.double())
        spread_loss, spread_grad = _err(ref32, ref64), _err(grad32[..., mine], grad64[..., mine])
        if not (spread_loss > 0 and spread_grad > 0):  # the grader's own rule would be vacuous
            raise RuntimeError(f"grader: F.cross_entropy in float32 equals float64 on {what}; no spread to "
                               "derive a tolerance from")
        shard = logits[..., mine].contiguous()
        z = shard.clone().requires_grad_()
        with CommTracer() as tracer:
            loss = fn(z, target, group=pair)
            tracer.step()
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                (loss * weight).sum().backward()
        where = f"{what}, rank {r} of the pair"
        assert isinstance(loss, torch.Tensor) and loss.shape == target.shape, (
            f"{where}: the loss has shape {tuple(getattr(loss, 'shape', ()))}, want the target's "
            f"{tuple(target.shape)} (one loss per token)")
        assert loss.dtype == torch.float32, f"{where}: the loss is {loss.dtype}, want float32"
        assert torch.equal(z.detach(), shard), f"{where}: the logits were modified in place"
        if not torch.isfinite(loss).all():
            raise AssertionError(f"{where}: the loss is not finite ({loss.detach().flatten()[:3].tolist()}"
                                 "...): exp of a large logit overflows; subtract the largest logit over all "
                                 "ranks")
        err = _err(loss.detach(), ref64)
        assert err <= FACTOR * spread_loss, (
            f"{where}: the loss is {err:.3g} from F.cross_entropy's (float64), more than {FACTOR:g} x "
            f"{spread_loss:.3g}, F.cross_entropy's own float32 error measured here")
        assert z.grad is not None, f"{where}: no gradient reached the logits"
        err = _err(z.grad, grad64[..., mine])
        assert err <= FACTOR * spread_grad, (
            f"{where}: the gradient is {err:.3g} from F.cross_entropy's (float64), more than {FACTOR:g} x "
            f"{spread_grad:.3g}, F.cross_entropy's own float32 error measured here")
        forward = tracer.select(step=0)
        assert forward, (f"{where}: no collective seen in forward; make them with refimpl.comm.ops so that "
                         "the grader's tracer sees them")
        cap = 3 * target.numel() * 4
        sent = sum(e.nbytes for e in forward)
        assert sent <= cap, (
            f"{where}: forward exchanged {sent} bytes in {[(e.op, e.nbytes) for e in forward]} (op, bytes); "
            f"at most three float32 tensors of the target's size ({cap} bytes): never the logits")
        _expect(tracer, 1, [], f"{where}, backward")


def check_loss(path: str) -> None:
    from exercises.rank_batch import run_ranks

    fn = load_module(path).vocab_parallel_cross_entropy
    probe_stub(lambda: fn(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), group=None))
    run_ranks(_loss_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


TASKS = [
    Task(name="f: copy_to_tensor_parallel_region", points=2, check=check_f),
    Task(name="g: reduce_from_tensor_parallel_region", points=2, check=check_g),
    Task(name="ColumnParallelLinear", points=3, check=check_column),
    Task(name="RowParallelLinear", points=3, check=check_row),
    Task(name="vocab_parallel_cross_entropy", points=4, check=check_loss),
    Task(name="scatter_to_sequence_parallel_region", points=2, check=check_scatter),
    Task(name="gather_from_sequence_parallel_region", points=2, check=check_gather),
    Task(name="reduce_scatter_to_sequence_parallel_region", points=2, check=check_reduce_scatter),
    Task(name="shard_fused_qkv", points=3, check=check_qkv),
]

# one plausible wrong implementation or more per task, and an independent right one (not refimpl's)
from exercises.checks.ch06_mutants import CORRECT, MUTANTS  # noqa: E402

__all__ = ["CORRECT", "MUTANTS", "TASKS"]
