"""Checks of chapter 03's exercises (data parallelism); see exercises/grading.py for the contract.

The two communicating tasks run on 2 ranks (:func:`refimpl.launch.run_ranks`); each rank loads the graded
file again by path. Results are compared with values computed here, and a tracer counts the collectives.
``MUTANTS`` holds one plausible wrong implementation per task: the test suite grades each and expects
exactly that task to fail.
"""

from __future__ import annotations

import math
import random

import torch
from torch import nn

from exercises.grading import Task, load_module, probe_stub

WORLD = 2
TIMEOUT_S = 90


def _naive_on_rank(ctx, path: str) -> None:
    from refimpl.comm.tracer import CommTracer

    mod = load_module(path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[2].bias.requires_grad_(False)  # frozen: must stay untouched
    frozen_before = model[2].bias.detach().clone()
    grads = {}
    for i, p in enumerate(model.parameters()):
        if p.requires_grad and i != 1:  # parameter 1 (the first bias) has no gradient on any rank
            p.grad = torch.full_like(p, float(ctx.rank + 1)) * (i + 1)
            grads[i] = (1 + 2) / 2 * (i + 1)  # mean of (rank + 1) over ranks 0, 1
    with CommTracer() as tracer:
        mod.sync_gradients_naive(model)
    for i, p in enumerate(model.parameters()):
        if not p.requires_grad:
            assert p.grad is None and torch.equal(p.detach(), frozen_before), "a frozen parameter was touched"
            continue
        assert p.grad is not None, f"parameter {i} had no gradient and got none: it must receive zeros' mean"
        want = grads.get(i, 0.0)
        assert torch.allclose(p.grad, torch.full_like(p, want)), \
            f"parameter {i}: grad {p.grad.flatten()[:3]} but the mean over ranks is {want}"
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    n = tracer.summary().get("all_reduce")
    assert n is not None, "no all_reduce seen: use refimpl.comm.ops.all_reduce so the tracer sees it"
    assert n.count == trainable, f"{n.count} all-reduces for {trainable} trainable tensors: want one each"


def _bucket_on_rank(ctx, path: str) -> None:
    from refimpl.comm.tracer import CommTracer

    mod = load_module(path)
    shapes = [(3, 5), (7,), (2, 2, 2), (1,)]
    tensors = [torch.arange(math.prod(s), dtype=torch.float32).reshape(s) * (ctx.rank + 1) for s in shapes]
    kept = list(tensors)
    with CommTracer() as tracer:
        mod.sync_bucket(tensors)
    for s, t, same in zip(shapes, tensors, kept, strict=True):
        assert t is same, "sync_bucket must update the tensors in place"
        want = torch.arange(math.prod(s), dtype=torch.float32).reshape(s) * 1.5  # mean of 1x and 2x
        assert torch.allclose(t, want), f"shape {s}: got {t.flatten()[:4]}, want {want.flatten()[:4]}"
    n = tracer.summary().get("all_reduce")
    assert n is not None, "no all_reduce seen: use refimpl.comm.ops.all_reduce so the tracer sees it"
    total = 4 * sum(math.prod(s) for s in shapes)
    assert (n.count, n.nbytes) == (1, total), f"{n.count} all-reduces of {n.nbytes} bytes: want 1 of {total}"


def _expected_buckets(numels: list[int], cap: int) -> list[list[int]]:
    flat = [i for i in reversed(range(len(numels))) for _ in range(numels[i])]
    return [list(dict.fromkeys(flat[s : s + cap])) for s in range(0, len(flat), cap)]




def check_naive(path: str) -> None:
    from refimpl.launch import run_ranks

    probe_stub(load_module(path).sync_gradients_naive, nn.Linear(2, 2))
    run_ranks(_naive_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


def check_assign_buckets(path: str) -> None:
    mod = load_module(path)
    got = mod.assign_buckets([3, 5, 2], 4)
    assert got == [[2, 1], [1, 0], [0]], f"assign_buckets([3, 5, 2], 4) = {got}, want [[2, 1], [1, 0], [0]]"
    rng = random.Random(3)
    cases = [([10], 3), ([4, 4], 4), ([0, 6, 0, 1], 2), ([1] * 5, 10)]
    cases += [([rng.randint(0, 9) for _ in range(rng.randint(1, 6))], rng.randint(1, 8)) for _ in range(30)]
    for numels, cap in cases:
        want = _expected_buckets(numels, cap)
        got = mod.assign_buckets(numels, cap)
        assert got == want, f"assign_buckets({numels}, {cap}) = {got}, want {want}"
        assert len(got) == math.ceil(sum(numels) / cap)
    try:
        mod.assign_buckets([3], 0)
    except ValueError:
        pass
    else:
        raise AssertionError("assign_buckets([3], 0) must raise ValueError")


def check_sync_bucket(path: str) -> None:
    from refimpl.launch import run_ranks

    probe_stub(load_module(path).sync_bucket, [torch.zeros(2)])
    run_ranks(_bucket_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


TASKS = [
    Task(name="sync_gradients_naive", points=3, check=check_naive),
    Task(name="assign_buckets", points=4, check=check_assign_buckets),
    Task(name="sync_bucket", points=3, check=check_sync_bucket),
]

_HEADER = (
    "from exercises.reference.ch03 import *  # noqa: F403\n"
    "import torch\nimport torch.distributed as dist\nfrom refimpl.comm import ops\n"
)
MUTANTS = {
    "sync_gradients_naive": _HEADER + (
        "def sync_gradients_naive(module, process_group=None):\n"
        "    for p in module.parameters():\n"
        "        if p.requires_grad:\n"
        "            if p.grad is None:\n"
        "                p.grad = torch.zeros_like(p)\n"
        "            ops.all_reduce(p.grad, group=process_group)  # a sum: forgets to divide by the world\n"
    ),
    "assign_buckets": _HEADER + (
        "def assign_buckets(numels, cap_numel):\n"
        "    if cap_numel < 1:\n"
        "        raise ValueError(cap_numel)\n"
        "    flat = [i for i in range(len(numels)) for _ in range(numels[i])]  # forward order, not reverse\n"
        "    return [list(dict.fromkeys(flat[s:s + cap_numel])) for s in range(0, len(flat), cap_numel)]\n"
    ),
    "sync_bucket": _HEADER + (
        "def sync_bucket(tensors, process_group=None):\n"
        "    for t in tensors:  # right values, but one all-reduce per tensor\n"
        "        t.div_(dist.get_world_size(process_group))\n"
        "        ops.all_reduce(t, group=process_group)\n"
    ),
}
