"""Checks of chapter 03's exercises (data parallelism); see exercises/grading.py for the contract.

The two communicating tasks run on 2 ranks (``refimpl.launch.run_ranks``); each rank loads the graded
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
    from exercises.rank_batch import run_ranks

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
    from exercises.rank_batch import run_ranks

    probe_stub(load_module(path).sync_bucket, [torch.zeros(2)])
    run_ranks(_bucket_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


# ------------------------------------------------------------------------- tasks 4 and 5: DataParallelBucket
LAYERS = 6
LAYER_BYTES = 4 * (8 * 8 + 8)  # one Linear(8, 8): the bucket cap, so bucket k holds layer LAYERS - 1 - k


class _Stamp(torch.autograd.Function):
    """Identity whose backward records when backward reached it (between layers 1 and 2)."""

    @staticmethod
    def forward(ctx, x, times):
        ctx.times = times
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        from refimpl.comm.tracer import now

        ctx.times.append(now())
        return grad, None


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def forward(self, x):
        return _Stamp.apply(x, self.times)


def _layers(probe: bool) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 8) for _ in range(LAYERS)]
    if probe:
        layers.insert(2, _Probe())
    return nn.Sequential(*layers)


def _inputs(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def _loss(model, x):
    return model(x).tanh().square().mean()


def _mean_of_local_sums(ctx, n: int, rank_inputs) -> list[torch.Tensor]:
    """The mean over ranks of each rank's gradient summed over its ``n`` first inputs, computed here."""
    sums = []
    for r in range(ctx.world_size):
        model = _layers(probe=False)
        for x in rank_inputs(r)[:n]:
            _loss(model, x).backward()
        sums.append([p.grad for p in model.parameters()])
    return [sum(gs) / ctx.world_size for gs in zip(*sums, strict=True)]


def _grads_equal(model, want, what: str) -> None:
    for i, (p, w) in enumerate(zip(model.parameters(), want, strict=True)):
        assert p.grad is not None, f"{what}: parameter {i} has no gradient"
        assert torch.equal(p.grad, w), f"{what}: parameter {i} is not the mean over ranks (max diff " \
            f"{(p.grad - w).abs().max().item():.3g})"


def _buckets_on_rank(ctx, path: str) -> None:
    from refimpl.comm.tracer import CommTracer, now

    mod = load_module(path)
    model = _layers(probe=True)
    probe = model[2]
    dp = mod.DataParallelBucket(model, bucket_cap_mb=LAYER_BYTES / 2**20)
    want = _mean_of_local_sums(ctx, 1, lambda r: _inputs(r, 1))
    (x,) = _inputs(ctx.rank, 1)
    for step in range(2):  # the same object twice: the bookkeeping must start afresh
        for p in model.parameters():
            p.grad = None
        probe.times.clear()
        with CommTracer() as tracer:
            _loss(dp, x).backward()
            backward_end = now()
            dp.finish_gradient_synchronization()
        events = sorted(tracer.select(op="all_reduce"), key=lambda e: e.start)
        assert len(events) == LAYERS, f"step {step}: {len(events)} all-reduces, want {LAYERS}, one per bucket"
        assert all(e.async_op for e in events), "launch the bucket all-reduces with async_op=True"
        (reached,) = probe.times
        early = events[: LAYERS - 3]  # the buckets of the top 3 layers, final long before backward reaches 1
        assert all(e.start < reached for e in early), \
            "the buckets were not launched during backward as their gradients became final"
        assert all(e.end is not None and e.end >= backward_end for e in events), \
            "a bucket was waited for during backward: wait in finish_gradient_synchronization"
        _grads_equal(model, want, f"step {step}")


def _no_sync_on_rank(ctx, path: str) -> None:
    from refimpl.comm.tracer import CommTracer

    mod = load_module(path)
    model = _layers(probe=False)
    dp = mod.DataParallelBucket(model, bucket_cap_mb=LAYER_BYTES / 2**20)
    x0, x1 = _inputs(ctx.rank, 2)
    with CommTracer() as tracer:
        with dp.no_sync():
            out = dp(x0)
        out.tanh().square().mean().backward()
        n = len(tracer.select(op="all_reduce"))
        assert n == 0, f"a backward whose forward ran inside no_sync() made {n} all-reduces: the forward " \
            "decides, not the place of backward()"
        out = dp(x1)
        with dp.no_sync():
            out.tanh().square().mean().backward()
        dp.finish_gradient_synchronization()
        n = len(tracer.select(op="all_reduce"))
        assert n == LAYERS, f"a synchronised forward, its backward inside no_sync(): {n} all-reduces, want " \
            f"{LAYERS} (its forward ran with sync on)"
    _grads_equal(model, _mean_of_local_sums(ctx, 2, lambda r: _inputs(r, 2)), "after accumulating 2")
    for p in model.parameters():
        p.grad = None
    with CommTracer() as tracer:
        with dp.no_sync():
            _loss(dp, x0).backward()
        dp.finish_gradient_synchronization()
    n = len(tracer.select(op="all_reduce"))
    assert n == 0, f"no_sync() forward and backward, then finish: {n} all-reduces, want 0"
    local = _layers(probe=False)
    _loss(local, x0).backward()
    for i, (p, w) in enumerate(zip(model.parameters(), local.parameters(), strict=True)):
        assert torch.equal(p.grad, w.grad), f"inside no_sync() parameter {i}'s gradient must stay local"


def check_buckets(path: str) -> None:
    from exercises.rank_batch import run_ranks

    probe_stub(load_module(path).DataParallelBucket, nn.Linear(2, 2))
    run_ranks(_buckets_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


def check_no_sync(path: str) -> None:
    from exercises.rank_batch import run_ranks

    probe_stub(lambda m: load_module(path).DataParallelBucket(m).no_sync(), nn.Linear(2, 2))
    run_ranks(_no_sync_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


TASKS = [
    Task(name="sync_gradients_naive", points=3, check=check_naive),
    Task(name="assign_buckets", points=4, check=check_assign_buckets),
    Task(name="sync_bucket", points=3, check=check_sync_bucket),
    Task(name="bucket hooks", points=5, check=check_buckets),
    Task(name="no_sync", points=4, check=check_no_sync),
]

_HEADER = (
    "from exercises.reference.ch03 import *  # noqa: F403\n"
    "import torch\nimport torch.distributed as dist\nfrom refimpl.comm import ops\n"
)
MUTANTS = {
    "sync_gradients_naive": _HEADER + (
        "def sync_gradients_naive(module, group=None):\n"
        "    for p in module.parameters():\n"
        "        if p.requires_grad:\n"
        "            if p.grad is None:\n"
        "                p.grad = torch.zeros_like(p)\n"
        "            ops.all_reduce(p.grad, group=group)  # a sum: forgets to divide by the world\n"
    ),
    "assign_buckets": _HEADER + (
        "def assign_buckets(numels, cap_numel):\n"
        "    if cap_numel < 1:\n"
        "        raise ValueError(cap_numel)\n"
        "    flat = [i for i in range(len(numels)) for _ in range(numels[i])]  # forward order, not reverse\n"
        "    return [list(dict.fromkeys(flat[s:s + cap_numel])) for s in range(0, len(flat), cap_numel)]\n"
    ),
    "bucket hooks": _HEADER + (
        "from refimpl.parallel.data_parallel import DataParallelBucket as _Ours, PendingReduce\n"
        "def _blocking(buffer, group):\n"
        "    work = ops.all_reduce(buffer, group=group, async_op=True)\n"
        "    work.wait()  # right values, but it waits inside the gradient hook: backward stalls\n"
        "    return PendingReduce(work)\n"
        "class DataParallelBucket(_Ours):\n"
        "    def __init__(self, module, bucket_cap_mb=25, group=None):\n"
        "        super().__init__(module, bucket_cap_mb, group, comm_hook=_blocking)\n"
    ),
    "no_sync": _HEADER + (
        "from refimpl.parallel.data_parallel import DataParallelBucket as _Ours\n"
        "class DataParallelBucket(_Ours):\n"
        "    def forward(self, *args, **kwargs):\n"
        "        self._arm(torch.is_grad_enabled())  # always armed: the flag is left to backward\n"
        "        return self.module(*args, **kwargs)\n"
        "    def _grad_ready(self, index, param):\n"
        "        if self.require_backward_grad_sync:  # reads the no-sync flag at backward time\n"
        "            super()._grad_ready(index, param)\n"
    ),
    "sync_bucket": _HEADER + (
        "def sync_bucket(tensors, group=None):\n"
        "    for t in tensors:  # right values, but one all-reduce per tensor\n"
        "        t.div_(dist.get_world_size(group))\n"
        "        ops.all_reduce(t, group=group)\n"
    ),
}
