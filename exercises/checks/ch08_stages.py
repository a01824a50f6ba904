"""Checks of chapter 08's tensor tasks: the executor over real stages and the split backward (see ch08.py).

* ``run_pipeline_rank`` on 2 ranks (``refimpl.launch.run_ranks``; each rank loads the graded file by
  path): refimpl's GPT of 2 blocks (untied embedding) cut into 2 stages by ``build_stages``, this rank's
  stage handed over; 1F1B at m = 3 and m = 1 (fewer micro-batches than ranks) and GPipe at m = 2. Every
  gradient of the rank's stage is compared with one device running the same micro-batches through the whole
  model, accumulated in order; the tolerance is ``FACTOR`` x the spread between two one-device runs that
  accumulate the 3 micro-batches in opposite orders (measured on the rank, before the check). The last
  stage's returned loss must be the one-device sum within float32's rounding bound for a sum of ``m``
  terms (``m x 2^-24 x`` the sum of their magnitudes); the first stage's must be zero.
* ``linear_split_backward`` in one process: two layers (5 -> 4 with a bias, 4 -> 3 without; a GELU
  between) over 3 micro-batches of shape ``[2, 3, 5]``, all forwarded before any backward (so a ``W``
  that reads another micro-batch's input is caught); each backward (``B``) under the store's key must give
  the input and bias gradients and leave ``weight.grad`` alone, queueing one ``W`` per layer; the ``W`` s
  flushed in the order 2, 0, 1 must give the full backward's weight gradients. Values are compared with a
  float64 run, within ``FACTOR`` x the distance of autograd's own float32 run to it (measured here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exercises.grading import load_module, probe_stub

WORLD = 2
TIMEOUT_S = 60
FACTOR = 4.0  # stated: this many times the spread measured in the same run
B, S, H = 2, 8, 16  # sequences per micro-batch, tokens, hidden size
CASES = (("1f1b", 3), ("1f1b", 1), ("gpipe", 2))


# ---- the executor ------------------------------------------------------------------------------------------


def _config():
    from refimpl.config import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=2, max_seq_len=S,
                       tie_word_embeddings=False)


def _batch(m: int, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    tokens = torch.randint(0, 256, (m * B, S + 1), generator=torch.Generator().manual_seed(7 + m)).to(device)
    return list(tokens[:, :-1].chunk(m)), list(tokens[:, 1:].chunk(m))  # m x [b, s] inputs and labels


def _one_device(m: int, order, device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    from refimpl.models import GPT, lm_loss

    model = GPT(_config(), seed=0).to(device)
    xs, ys = _batch(m, device)
    losses = [0.0] * m
    for i in order:
        loss = lm_loss(model(xs[i]), ys[i], num_tokens=m * B * S)
        loss.backward()
        losses[i] = loss.item()
    return losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _executor_on_rank(ctx, path: str) -> None:
    from refimpl.models import GPT
    from refimpl.models.gpt_stages import build_stages
    from refimpl.parallel.pipeline_parallel.schedules import build_schedule

    torch.set_num_threads(1)
    fn = load_module(path).run_pipeline_rank
    forward = _one_device(3, range(3), ctx.device)[1]
    backward = _one_device(3, reversed(range(3)), ctx.device)[1]
    spread = max((forward[n] - backward[n]).abs().max().item() for n in forward)
    assert spread > 0, "grader: two summation orders gave the same bits, no yardstick"
    for name, m in CASES:
        where = f"rank {ctx.rank}, {name} at pp = 2, m = {m}"
        losses, ref = _one_device(m, range(m), ctx.device)
        stage = build_stages(GPT(_config(), seed=0).to(ctx.device), pp_rank=ctx.rank, pp_size=WORLD)[ctx.rank]
        xs, ys = _batch(m, ctx.device)
        actions = build_schedule(name, pp_size=WORLD, num_microbatches=m)[ctx.rank]
        loss = fn(list(actions), stage=stage, inputs=xs, labels=ys, num_tokens=m * B * S,
                  activation_shape=(B, S, H), group=None)
        assert isinstance(loss, torch.Tensor) and loss.numel() == 1, (
            f"{where}: return the summed loss as a scalar tensor, got {type(loss).__name__}")
        if stage.is_last:
            bound = m * 2.0**-24 * sum(abs(v) for v in losses)
            assert abs(loss.item() - sum(losses)) <= bound, (
                f"{where}: the summed loss is {loss.item():.6f}, one device's {sum(losses):.6f} (each "
                "micro-batch's token losses divided by the tokens of the whole step)")
        else:
            assert loss.item() == 0.0, f"{where}: only the last stage's rank has a loss; got {loss.item()}"
        for local, full in stage.full_names().items():
            p = dict(stage.named_parameters())[local]
            assert p.grad is not None, f"{where}: {full} has no gradient: did the backward reach this stage?"
            err = (p.grad - ref[full]).abs().max().item()
            if err <= FACTOR * spread:
                continue
            hint = ""
            if torch.allclose(p.grad, m * ref[full], rtol=1e-4, atol=1e-7) and m > 1:
                hint = f": {m} x one device's (divide by the tokens of the whole step, not a micro-batch's)"
            elif name == "1f1b" and m > 1:
                hint = " (is every micro-batch's backward run, through its own saved forward?)"
            raise AssertionError(f"{where}: the gradient of {full} is off by {err:.2e}, tolerance "
                                 f"{FACTOR:g} x {spread:.1e}{hint}")


def check_executor(path: str) -> None:
    from exercises.rank_batch import run_ranks

    probe_stub(lambda: load_module(path).run_pipeline_rank([], stage=None, inputs=[], labels=[],
                                                           num_tokens=1, activation_shape=(1,)))
    run_ranks(_executor_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


# ---- the split backward ------------------------------------------------------------------------------------


def _tensors(dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return {"w1": [rand(4, 5)], "b1": [rand(4)], "w2": [rand(3, 4)],
            "x": [rand(2, 3, 5) for _ in range(3)], "dy": [rand(2, 3, 3) for _ in range(3)]}


def _full_backward(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Autograd's whole backward of the two layers over the 3 micro-batches, in ``dtype``."""
    t = _tensors(dtype)
    w1, b1, w2 = (t[k][0].requires_grad_() for k in ("w1", "b1", "w2"))
    xs = [x.requires_grad_() for x in t["x"]]
    for x, dy in zip(xs, t["dy"], strict=True):
        (F.linear(F.gelu(F.linear(x, w1, b1)), w2) * dy).sum().backward()
    out = {"w1": w1.grad, "b1": b1.grad, "w2": w2.grad}
    return out | {f"x{i}": x.grad for i, x in enumerate(xs)}


def check_split_backward(path: str) -> None:
    from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore

    fn = load_module(path).linear_split_backward
    probe_stub(fn, torch.zeros(1, 2), torch.zeros(3, 2), None, WeightGradStore())
    exact = _full_backward(torch.float64)
    autograd = _full_backward(torch.float32)
    spread = max((autograd[k].double() - exact[k]).abs().max().item() for k in exact)
    assert spread > 0, "grader: float32 equals float64 here, no yardstick"
    tol = FACTOR * spread

    def close(got: torch.Tensor | None, key: str, what: str) -> None:
        assert got is not None, f"{what}: no gradient"
        assert got.shape == exact[key].shape, (
            f"{what}: shape {tuple(got.shape)}, want {tuple(exact[key].shape)}")
        err = (got.double() - exact[key]).abs().max().item()
        assert err <= tol, f"{what}: off by {err:.2e} from float64, tolerance {FACTOR:g} x {spread:.1e}"

    t = _tensors(torch.float32)
    w1, b1, w2 = (t[k][0].requires_grad_() for k in ("w1", "b1", "w2"))
    xs = [x.requires_grad_() for x in t["x"]]
    store = WeightGradStore()
    outs = []
    for x in xs:  # every forward first: each W must use its own micro-batch's saved tensors
        y = fn(F.gelu(fn(x, w1, b1, store)), w2, None, store)
        assert isinstance(y, torch.Tensor) and y.shape == (2, 3, 3), f"forward gave {getattr(y, 'shape', y)}"
        outs.append(y)
    want_y = F.linear(F.gelu(F.linear(xs[0].detach().double(), w1.detach().double(), b1.detach().double())),
                      w2.detach().double())
    assert (outs[0].detach().double() - want_y).abs().max().item() <= tol, "forward: not F.linear's value"
    b1_sum = None
    for i, (y, dy) in enumerate(zip(outs, t["dy"], strict=True)):
        with store.capture(i):
            (y * dy).sum().backward()
        assert w1.grad is None and w2.grad is None, (
            f"B of micro-batch {i} wrote weight.grad: the weight gradient belongs to W, deferred")
        assert len(store) == 2 * (i + 1), (
            f"after B of micro-batch {i}: {len(store)} W s queued in the store, want one per layer call, "
            f"{2 * (i + 1)}")
        close(xs[i].grad, f"x{i}", f"B of micro-batch {i}: the input gradient")
        b1_sum = b1.grad.detach().clone()
    assert b1_sum is not None
    close(b1_sum, "b1", "B: the bias gradient summed over the micro-batches")
    for i in (2, 0, 1):  # later, and in another order than the backwards
        assert store.flush(i) == 2, f"W of micro-batch {i}: the store held no callable under its key"
    close(w1.grad, "w1", "after every W: the first layer's weight gradient")
    close(w2.grad, "w2", "after every W: the second layer's (no bias) weight gradient")
