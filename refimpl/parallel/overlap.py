"""Each overlap of communication with computation the course builds, timed against its serialized control
(chapters 03, 04, 06, 07, 08 and 09): run the workers here with ``run_ranks(worker, 2, link="1gbit")``
(``refimpl.launch.shaped_link``), where the link and not the two cores sets the pace.

A control is the same code with ``wait()`` before the compute the transfer could hide behind:

* ``data_parallel_overlap``: ``refimpl.parallel.data_parallel.DataParallelBucket`` launching each
  bucket's all-reduce from the gradient hook and waiting at the end, against a comm hook that waits in the
  gradient hook (``serialized_hook``); 4 bias-free ``Linear(1024, 1024)``, one 4 MiB bucket each;
* ``zero3_overlap``: ``refimpl.parallel.zero.FullyShardedDataParallel`` with ``prefetch=True``
  (the next unit's all-gather started as soon as the current one is gathered) against ``prefetch=False``;
  6 such layers, one unit each;
* ``ring_overlap``: ``refimpl.parallel.context_parallel.ring_attention.ring_attention`` against
  ``overlap=False`` (each exchange waited for as soon as it is posted); causal, 8 heads of 64, 2 x 1024
  tokens per rank, forward and backward;
* ``collective_matmul_overlap``: a sequence-parallel MLP (column -> GeLU -> row, tp 2) through
  ``refimpl.parallel.tensor_parallel.collective_matmul`` against ``serialized=True`` (each ring transfer
  waited for before the chunk's matmul); 512 tokens per rank, hidden 512, 1024 MLP columns per rank,
  forward and backward (chapter 06);
* ``moe_dispatch_overlap``: an MoE layer (``refimpl.parallel.expert_parallel.MoE``, 4 experts 128
  wide, top 2, ep 2, 1024 tokens of 512 per rank) whose shared expert (an MLP 512 -> 1024 -> 512) runs
  while the dispatch's all-to-all carries the tokens (``MoE(x, beside=...)``, DeepSeek-V3's overlap), against
  ``overlap_dispatch = False`` (the wait, then the shared expert); forward only (chapter 09).
* ``pipeline_overlap``: a pipeline step (``refimpl.parallel.pipeline_parallel.run_schedule``, 3
  ``Linear(1024, 1024)`` per stage, interleaved 1F1B at p 2 with 2 stages per rank, 4 micro-batches of 256
  rows) with ``overlap=True`` (a group waited for when an action needs what it receives) against the
  default (every group waited for before the next action); forward and backward (chapter 08).

Each worker alternates the two kinds of step (a barrier before each, the first of each a warm-up) and
returns per rank the median seconds of each, ``{"median": {"overlapped": s, "serialized": s}, "equal":
bool}``, ``equal`` saying whether the two ended with bitwise the same gradients (and ring output): the
control changes when, not what. CPU tensors over gloo (``run_ranks(..., backend="gloo")`` on a GPU box).
The data-parallel and ZeRO-3 workers also time the same step without communication (the plain layers) in
the same rounds, ``median["compute"]``: the compute the planner's time model takes
(``refimpl.planner.step_time.layer_stack_step``, checked against these measurements in
tests/ranks/cli/test_overlap.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from refimpl.parallel.context_parallel.ring_attention import ring_attention
from refimpl.parallel.data_parallel import DataParallelBucket
from refimpl.parallel.data_parallel.data_parallel_communications import PendingReduce, allreduce_hook
from refimpl.parallel.expert_parallel import MoE
from refimpl.parallel.tensor_parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from refimpl.parallel.zero.fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["collective_matmul_overlap", "data_parallel_overlap", "moe_dispatch_overlap", "overlap_ratio",
           "pipeline_overlap", "ring_overlap", "serialized_hook", "time_overlap", "zero3_overlap"]

WIDTH, ROWS, REPEATS = 1024, 1024, 5


def serialized_hook(buffer: torch.Tensor, group: Any) -> PendingReduce:
    """The control's comm hook: the same all-reduce, waited for in the gradient hook (backward stops
    until it is done)."""
    allreduce_hook(buffer, group).wait()
    return PendingReduce()


def _layers(n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n)])


def _interleaved(steps: dict[str, Any], compute: Any = None, repeats: int = REPEATS) -> dict:
    """Call each ``steps[name]()`` (one training step returning the tensors it ends with) in turn, a barrier
    before each, ``repeats`` + 1 times (the first a warm-up): the medians and the bitwise check of the
    two. ``compute``: the same step without communication, timed in the same rounds (``median["compute"]``:
    what the planner's time model, ``refimpl.planner.step_time``, takes as the step's compute)."""
    timed = steps if compute is None else {**steps, "compute": compute}
    times: dict[str, list[float]] = {name: [] for name in timed}
    ends: dict[str, list[torch.Tensor]] = {}
    for i in range(repeats + 1):
        for name, step in timed.items():
            dist.barrier()
            start = time.perf_counter()
            ends[name] = step()
            if i:
                times[name].append(time.perf_counter() - start)
    first, second = (ends[name] for name in steps)
    return {"median": {name: statistics.median(t) for name, t in times.items()},
            "equal": all(torch.equal(a, b) for a, b in zip(first, second, strict=True))}


def _grad(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, which the step's backward filled (the bitwise check compares it)."""
    assert t.grad is not None
    return t.grad


def _train_step(model: nn.Module, x: torch.Tensor):
    def step() -> list[torch.Tensor]:
        for p in model.parameters():
            p.grad = None
        model(x).square().mean().backward()
        finish = getattr(model, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()
        return [_grad(p) for p in model.parameters()]
    return step


def data_parallel_overlap(ctx: Any, layers: int = 4) -> dict:
    """DP's bucketed all-reduce against ``serialized_hook`` (module docstring)."""
    torch.set_num_threads(1)
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(ctx.rank))
    cap = WIDTH * WIDTH * 4 / 2**20  # one bucket per layer
    overlapped = DataParallelBucket(_layers(layers), bucket_cap_mb=cap)
    serialized = DataParallelBucket(_layers(layers), bucket_cap_mb=cap, comm_hook=serialized_hook)
    steps = {"overlapped": _train_step(overlapped, x), "serialized": _train_step(serialized, x)}
    return {**_interleaved(steps, compute=_train_step(_layers(layers), x)), "buckets": overlapped.num_buckets}


def zero3_overlap(ctx: Any, layers: int = 6) -> dict:
    """ZeRO-3 with ``prefetch=True`` against ``prefetch=False`` (module docstring)."""
    torch.set_num_threads(1)
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(ctx.rank))
    steps = {name: _train_step(FullyShardedDataParallel(_layers(layers), unit_types=(nn.Linear,),
                                                        prefetch=prefetch), x)
             for name, prefetch in (("overlapped", True), ("serialized", False))}
    return _interleaved(steps, compute=_train_step(_layers(layers), x))


def ring_overlap(ctx: Any) -> dict:
    """Ring attention against ``overlap=False`` (module docstring)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(ctx.rank)
    q, k, v, grad = (torch.randn(2, 8, 1024, 64, generator=gen) for _ in range(4))  # [b, a, s/cp, d]

    def step(overlap: bool):
        def run() -> list[torch.Tensor]:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = ring_attention(qq, kk, vv, cp_group=None, causal=True, overlap=overlap)
            (out * grad).sum().backward()
            return [out.detach(), _grad(qq), _grad(kk), _grad(vv)]
        return run

    return _interleaved({"overlapped": step(True), "serialized": step(False)})


def collective_matmul_overlap(ctx: Any, *, tokens: int = 512, hidden: int = 512, ffn: int = 1024) -> dict:
    """The collective-matmul MLP against ``serialized=True`` (module docstring); ``ffn``: the MLP columns
    per rank."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(ctx.rank)
    x, grad = (torch.randn(1, tokens, hidden, generator=gen) for _ in range(2))  # [b, s/t, h]
    w1 = torch.randn(ffn, hidden, generator=gen) / hidden**0.5                   # [ffn/t, h]: column
    w2 = torch.randn(hidden, ffn, generator=gen) / ffn**0.5                      # [h, ffn/t]: row

    def step(serialized: bool):
        def run() -> list[torch.Tensor]:
            xx, a, b = (t.clone().requires_grad_() for t in (x, w1, w2))
            h = all_gather_matmul(xx, a, group=None, serialized=serialized)       # [1, s, ffn/t]
            out = matmul_reduce_scatter(torch.nn.functional.gelu(h), b, group=None,
                                        serialized=serialized)                    # [1, s/t, h]
            (out * grad).sum().backward()
            return [out.detach(), _grad(xx), _grad(a), _grad(b)]
        return run

    return _interleaved({"overlapped": step(False), "serialized": step(True)})


def moe_dispatch_overlap(ctx: Any, *, tokens: int = 1024, hidden: int = 512, shared_ffn: int = 1024,
                         expert_ffn: int = 128) -> dict:
    """An MoE layer's forward with a shared expert computed while the dispatch travels against
    ``overlap_dispatch = False`` (module docstring); ``shared_ffn``, ``expert_ffn``: the shared expert's and
    each routed expert's hidden width (narrow experts: the transfers and the shared expert dominate)."""
    torch.set_num_threads(1)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(ctx.rank))  # [T, h]
    torch.manual_seed(0)
    shared = nn.Sequential(nn.Linear(hidden, shared_ffn), nn.GELU(), nn.Linear(shared_ffn, hidden))

    def step(overlap: bool):
        moe = MoE(dim=hidden, hidden=expert_ffn, num_experts=4, top_k=2, ep_group=dist.group.WORLD, seed=0)
        moe.overlap_dispatch = overlap

        def run() -> list[torch.Tensor]:
            with torch.no_grad():
                return [moe(x, beside=lambda: shared(x))]
        return run

    return _interleaved({"overlapped": step(True), "serialized": step(False)})


class _Stage(nn.Sequential):
    """A pipeline stage of ``Linear(WIDTH, WIDTH)`` layers with what the executor reads
    (``refimpl.parallel.pipeline_parallel.stage``)."""

    def __init__(self, layers: int, *, stage: int, num_stages: int) -> None:
        torch.manual_seed(stage)
        super().__init__(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
        self.is_first, self.is_last, self.num_stages = stage == 0, stage == num_stages - 1, num_stages


def pipeline_overlap(ctx: Any, *, schedule: str = "interleaved", virtual_stages: int = 2,
                     microbatches: int = 4, rows: int = 256, layers: int = 3) -> dict:
    """One step of ``schedule`` (``refimpl.parallel.pipeline_parallel.run_schedule``, ``virtual_stages``
    stages of ``layers`` per rank, ``microbatches`` of ``rows`` x ``WIDTH``) with ``overlap=True`` against
    its default (module docstring)."""
    from refimpl.parallel.pipeline_parallel import build_schedule, run_schedule, stage_rank

    torch.set_num_threads(1)
    p, v = ctx.world_size, virtual_stages
    stages: dict[int, nn.Module] = {s: _Stage(layers, stage=s, num_stages=p * v) for s in range(p * v)
                                    if stage_rank(s, pp_size=p) == ctx.rank}
    gen = torch.Generator().manual_seed(0)
    x, y = (list(torch.randn(microbatches, 1, rows, WIDTH, generator=gen)) for _ in range(2))  # [1, rows, h]
    actions = build_schedule(schedule, pp_size=p, num_microbatches=microbatches, virtual_stages=v)[ctx.rank]

    def step(overlap: bool):
        def run() -> list[torch.Tensor]:
            for stage in stages.values():
                stage.zero_grad(set_to_none=True)
            loss = run_schedule(actions, stages=stages, pp_group=None, pp_size=p, inputs=x, labels=y,
                                loss_fn=lambda o, t: (o - t).square().mean(),
                                activation_shape=(1, rows, WIDTH), activation_dtype=torch.float32,
                                overlap=overlap)
            return [loss, *(_grad(q) for stage in stages.values() for q in stage.parameters())]
        return run

    return _interleaved({"overlapped": step(True), "serialized": step(False)}, repeats=2 * REPEATS)


def overlap_ratio(per_rank: list[dict]) -> float:
    """Overlapped / serialized: the slowest rank's median of each."""
    overlapped = max(r["median"]["overlapped"] for r in per_rank)
    return overlapped / max(r["median"]["serialized"] for r in per_rank)


def time_overlap(worker: Any, *, link: str = "1gbit", bar: float = 0.9, attempts: int = 3,
                 timeout_s: float = 240, accept: Callable[[dict], str | None] | None = None) -> dict | str:
    """``worker`` (one of this module's) on 2 ranks behind ``link``, at raised priority: ``{"overlapped": s,
    "serialized": s, "ratio": r, "tries": [...]}`` (and ``"compute": s`` where the worker times its step
    without communication) after checking that the two ended bitwise equal and ``r <= bar``; or, where the
    machine cannot shape a link, the reason (a string). ``accept(timed)``: a further check of a measurement
    that met the bar (None: accepted; else why not), e.g. the planner's prediction of it. A measurement
    that fails either is taken again, up to ``attempts`` in all: on a machine busy with other work (a test
    suite's other lane) gloo's communication thread may get no core for a whole measurement, and the
    overlap with it (measured: 0.996 once at load average 3.5); every try is kept in ``tries`` (its ratio,
    or its ratio and why it was not accepted), and when none passes an ``AssertionError`` lists them. What
    the tests and chapters 03, 04, 07, 08 and 09 call."""
    from refimpl.launch import run_ranks
    from refimpl.launch.shaped_link import shaped_link_unavailable

    why = shaped_link_unavailable()
    if why is not None:
        return why
    tries: list[float | tuple[float, str]] = []
    for _ in range(attempts):
        per_rank = run_ranks(worker, 2, link=link, timeout_s=timeout_s, backend="gloo", priority=10)
        assert all(r["equal"] for r in per_rank), "the serialized control changed the results"
        ratio = overlap_ratio(per_rank)
        medians = {k: max(r["median"][k] for r in per_rank) for k in per_rank[0]["median"]}
        refused = f"above {bar}" if ratio > bar else None if accept is None else accept(medians)
        tries.append(ratio if refused is None else (ratio, refused))
        if refused is None:
            return {**medians, "ratio": ratio, "tries": tries}
    raise AssertionError(f"no measurement passed in {attempts} (overlapped / serialized, and why not): "
                         f"{tries}")
