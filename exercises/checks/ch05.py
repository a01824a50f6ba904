"""Checks of chapter 05's exercises (``exercises/05_mixed_precision.py``); see exercises/grading.py.

* ``update_scale`` is driven through the same sequence of overflowing and finite steps as a real
  ``torch.amp.GradScaler`` (hysteresis 1, no minimum scale: GradScaler's rule), with growth and backoff
  factors that are not powers of two so that float32 rounding shows, and through a hand-computed trace
  of Megatron's hysteresis and minimum scale.
* ``overflow_on_any_rank`` runs on 2 ranks (``refimpl.launch.run_ranks``, each rank loads the graded
  file by path): an inf, a -inf or a NaN on one rank only, a rank with no gradients, and finite gradients
  everywhere; every rank must give the same answer, with one small collective per call.
* ``checkpoint_block`` is applied to one block of a small GPT: gradients bit-identical to the plain model,
  only the block's input saved for backward (measured with ``saved_tensors_hooks``), the block's forward
  run again during backward, parameter names unchanged.

``MUTANTS`` holds one plausible wrong implementation per task (tests/course/cli/test_exercises.py grades
them).
"""

from __future__ import annotations

import copy
import random

import torch

from exercises.grading import Task, load_module, probe_stub
from refimpl.config import ModelConfig
from refimpl.measure import SavedTensorMeter
from refimpl.models import GPT, lm_loss
from refimpl.precision.loss_scaler import LossScalerConfig, ScalerState


def _flags(seed: int, steps: int = 80) -> list[bool]:
    rng = random.Random(seed)
    flags = [rng.random() < 0.25 for _ in range(steps)]
    flags[10:14] = [True] * 4  # a run of overflows
    return flags


def _gradscaler_trace(flags: list[bool], **kwargs) -> list[tuple[float, int]]:
    """(scale, growth tracker) after each step of a real GradScaler fed inf or finite gradients."""
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    out = []
    for found_inf in flags:
        opt.zero_grad()
        scaler.scale(p.sum() * (float("inf") if found_inf else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        state = scaler.state_dict()
        out.append((state["scale"], state["_growth_tracker"]))
    return out


def _as_state(value: object, where: str) -> ScalerState:
    if not (isinstance(value, tuple) and len(value) == 3):
        raise AssertionError("update_scale must return ScalerState(scale, growth_tracker, "
                             f"hysteresis_tracker), got {value!r} {where}")
    return ScalerState(*value)


def check_update_rule(path: str) -> None:
    update_scale = load_module(path).update_scale
    cases = [
        dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
        dict(init_scale=1000.0, growth_factor=1.5, backoff_factor=0.7, growth_interval=2),
        dict(init_scale=2.0**16, growth_factor=3.0, backoff_factor=0.25, growth_interval=4),
        # growing once more would overflow float32
        dict(init_scale=2.0**127, growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
    ]
    for seed, kwargs in enumerate(cases):
        flags = _flags(seed) if seed < 3 else [False] * 3 + [True] + [False] * 3
        want = _gradscaler_trace(flags, **kwargs)
        config = LossScalerConfig(**kwargs, hysteresis=1, min_scale=0.0, max_consecutive_skips=None)
        state = ScalerState(_f32(kwargs["init_scale"]), 0, 1)
        for step, (found_inf, (scale, growth)) in enumerate(zip(flags, want, strict=True)):
            where = f"at step {step} (found_inf={found_inf}) with {kwargs}"
            state = _as_state(update_scale(state, found_inf, config), where)
            if (state.scale, state.growth_tracker) == (scale, growth):
                continue
            hint = ""
            if state.growth_tracker != growth:
                hint = (" Hint: the growth counter restarts at 0 on an overflow and after each growth; "
                        "the scale grows when it *reaches* growth_interval.")
            elif abs(state.scale - scale) <= 1e-6 * scale:
                hint = " Hint: round each new scale to float32, as GradScaler's float32 tensor does."
            elif not torch.isfinite(torch.tensor(state.scale, dtype=torch.float32)):
                hint = " Hint: a grown scale that is not finite in float32 is discarded (the old one stays)."
            raise AssertionError(
                f"update_scale {where}: got scale={state.scale!r}, growth_tracker={state.growth_tracker}; "
                f"torch.amp.GradScaler has scale={scale!r}, growth_tracker={growth}.{hint}"
            )


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def check_hysteresis(path: str) -> None:
    update_scale = load_module(path).update_scale
    config = LossScalerConfig(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    flags = [True, False, True, True, True, False, False, False, True]
    want = [(8.0, 0, 1), (8.0, 1, 1), (4.0, 0, 0), (2.0, 0, -1), (2.0, 0, -2), (2.0, 1, -2), (2.0, 2, -2),
            (4.0, 0, 2), (4.0, 0, 1)]
    why = ["the first overflow spends one unit of hysteresis; the scale stays",
           "a finite step does not refill the hysteresis (only a growth does)",
           "hysteresis exhausted: back off", "and again on every further overflow",
           "but never below min_scale", "counting finite steps", "counting finite steps",
           "growth_interval finite steps: grow, and refill the hysteresis", "one unit spent again"]
    state = ScalerState(8.0, 0, 2)
    for step, found_inf in enumerate(flags):
        where = f"at step {step} (found_inf={found_inf}) from {tuple(state)}"
        state = _as_state(update_scale(state, found_inf, config), where)
        if tuple(state) != want[step]:
            raise AssertionError(
                f"update_scale {where} with hysteresis=2, min_scale=2, growth_interval=3: got "
                f"{tuple(state)}, expected {want[step]} ({why[step]})"
            )


WORLD = 2
TIMEOUT_S = 90
# (rank 0's gradients, rank 1's gradients) per case, as (shape, value at index 0) or None for no tensor;
# then whether anybody overflowed
_CASES = [
    ("finite everywhere", [(3, 1.0), (2, -2.0)], [(4, 0.5)], False),
    ("inf on rank 1 only", [(3, 1.0), (2, -2.0)], [(4, float("inf"))], True),
    ("NaN on rank 0 only, in its second tensor", [(3, 1.0), (2, float("nan"))], [(4, 0.5)], True),
    ("-inf on rank 1, and rank 0 holds no gradient", [], [(5, float("-inf"))], True),
    ("rank 1 holds no gradient, rank 0 is finite", [(3, 1.0)], [], False),
]


def _overflow_on_rank(ctx, path: str) -> list[tuple[str, bool, int, int]]:
    from refimpl.comm.tracer import CommTracer

    mod = load_module(path)
    out = []
    for name, spec0, spec1, _ in _CASES:
        grads = []
        for numel, value in (spec0, spec1)[ctx.rank]:
            g = torch.full((numel,), 0.25, device=ctx.device)
            g[0] = value
            grads.append(g.to(torch.bfloat16) if numel == 2 else g)  # a 16-bit tensor among them
        with CommTracer() as tracer:
            answer = mod.overflow_on_any_rank(grads, device=ctx.device)
        events = tracer.select()
        out.append((name, bool(answer), len(events), max((e.nbytes for e in events), default=0)))
    return out


def check_overflow_agreement(path: str) -> None:
    from exercises.rank_batch import run_ranks

    fn = load_module(path).overflow_on_any_rank
    probe_stub(lambda: fn([torch.zeros(2)], device=torch.device("cpu")))  # cpu on purpose: no ranks yet
    per_rank = run_ranks(_overflow_on_rank, WORLD, path, timeout_s=TIMEOUT_S)
    for k, (name, _, _, want) in enumerate(_CASES):
        answers = [r[k][1] for r in per_rank]
        if len(set(answers)) > 1:
            raise AssertionError(
                f"{name}: rank 0 says {answers[0]}, rank 1 says {answers[1]}. The ranks disagree: one steps, "
                "the other skips, and their weights and loss scales part ways")
        assert answers[0] == want, f"{name}: every rank says {answers[0]}, but the answer is {want}"
        for rank, r in enumerate(per_rank):
            _, _, count, nbytes = r[k]
            assert count >= 1, (f"{name}: rank {rank} ran no collective through refimpl.comm.ops: how "
                                "does it learn what the other rank saw?")
            assert count == 1 and nbytes <= 8, (
                f"{name}: rank {rank} ran {count} collective(s), the largest of {nbytes} bytes; one number "
                "per call is enough")


CONFIG = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, max_seq_len=24, ffn_hidden_size=48)


def check_checkpoint_block(path: str) -> None:
    checkpoint_block = load_module(path).checkpoint_block
    b, s = 3, 20
    x = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(0))
    plain = GPT(CONFIG)
    model = copy.deepcopy(plain)
    names = list(model.state_dict())
    block = model.layers[1]
    returned = checkpoint_block(block)
    assert returned is block, "checkpoint_block must change the block in place and return it"
    assert list(model.state_dict()) == names, "parameter names changed: checkpoint the block in place"

    calls = []
    handle = block.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    with SavedTensorMeter(model) as meter:
        loss = lm_loss(model(x), x)
    loss.backward()
    handle.remove()
    lm_loss(plain(x), x).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, (
            f"{name} got no gradient: does the gradient flow back through the checkpointed block's input?")
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), (
            f"the gradient of {name} differs from the plain model's (max difference "
            f"{(p.grad - q.grad).abs().max().item():.3g}); checkpointing must not change the arithmetic")
    saved = meter.report.block_bytes(1)
    block_input = 4 * b * s * CONFIG.hidden_size
    assert saved == block_input, (
        f"the checkpointed block saved {saved:,d} bytes for backward; only its input ({block_input:,d} bytes "
        f"= {b} x {s} x {CONFIG.hidden_size} float32) should be kept")
    assert len(calls) == 2, (
        f"the block's MLP ran {len(calls)} time(s) in forward + backward; checkpointing runs it once in the "
        "forward pass and once more in the backward pass")


TASKS = [
    Task(name="update_scale: GradScaler's rule", points=3, check=check_update_rule),
    Task(name="update_scale: hysteresis, min scale", points=2, check=check_hysteresis),
    Task(name="overflow_on_any_rank: all ranks agree", points=3, check=check_overflow_agreement),
    Task(name="checkpoint_block", points=3, check=check_checkpoint_block),
]

_HEADER = "from exercises.reference.ch05 import *  # noqa: F403\nimport torch\n"
MUTANTS = {
    "update_scale: GradScaler's rule": _HEADER + (
        "from refimpl.precision.loss_scaler import ScalerState\n"
        "def update_scale(state, found_inf, config):\n"
        "    if found_inf:  # products kept in float64: GradScaler's scale is float32\n"
        "        h = state.hysteresis_tracker - 1\n"
        "        scale = state.scale\n"
        "        if h <= 0:\n"
        "            scale = max(state.scale * config.backoff_factor, config.min_scale)\n"
        "        return ScalerState(scale, 0, h)\n"
        "    g = state.growth_tracker + 1\n"
        "    if g == config.growth_interval:\n"
        "        return ScalerState(state.scale * config.growth_factor, 0, config.hysteresis)\n"
        "    return ScalerState(state.scale, g, state.hysteresis_tracker)\n"
    ),
    "update_scale: hysteresis, min scale": _HEADER + (
        "from refimpl.precision.loss_scaler import ScalerState, update_scale as _right\n"
        "def update_scale(state, found_inf, config):\n"
        "    new = _right(state, found_inf, config)\n"
        "    if not found_inf:  # refills the hysteresis on every finite step\n"
        "        return ScalerState(new.scale, new.growth_tracker, config.hysteresis)\n"
        "    return new\n"
    ),
    "overflow_on_any_rank: all ranks agree": _HEADER + (
        "def overflow_on_any_rank(grads, *, device, group=None):\n"
        "    # each rank answers for itself: no agreement, so the ranks part ways\n"
        "    from refimpl.comm import ops\n"
        "    flag = torch.zeros((), device=device)\n"
        "    ops.broadcast(flag.clone(), src=0, group=group)  # a collective, but not the answer's\n"
        "    return any(not torch.isfinite(g).all() for g in grads)\n"
    ),
    "checkpoint_block": _HEADER + (
        "from torch.utils.checkpoint import checkpoint\n"
        "def checkpoint_block(block):\n"
        "    cls = type(block)\n"
        "    # detaches the input: no gradient reaches the layers below the block\n"
        "    block.forward = lambda x: checkpoint(cls.forward, block, x.detach(), use_reentrant=False)\n"
        "    return block\n"
    ),
}
