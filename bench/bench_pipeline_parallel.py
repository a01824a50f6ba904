"""Benchmark of chapter 08: our pipeline schedules vs ``torch.distributed.pipelining``, and the bubble.

    python -m bench.bench_pipeline_parallel [--pp 2 4] [--microbatches 8] [--repeats 7] [--warmup 2]
                                            [--bubble-m 4 8 16] [--stage-cost-ms 15] [--bubble-repeats 3]

One set of CPU ranks per pipeline size ``p`` (gloo, world = p, one thread each) does two things.

1. **Step time**: forward + backward of ``m`` micro-batches of a small untied GPT (``CONFIG``) cut by
   ``build_stages`` into ``p`` stages (1F1B) or ``2 p`` (interleaved, stage ``s`` on rank ``s % p``):
   ours (``run_schedule`` over refimpl's lists; Narayanan et al. 2021) against torch's
   ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` over ``PipelineStage`` s wrapping copies of the same
   ``GPTStage`` modules (``scale_grads=False``: a micro-batch's loss is already its share of the
   step's mean). First both losses and all gradients must equal one device on the same micro-batch split,
   bitwise or within ``FACTOR`` x the spread of two one-device runs that add the micro-batches in opposite
   orders (measured here); torch with ``scale_grads=True`` (gradients divided by ``m`` again) is the
   negative control and must fail. Then steps interleaved (ours, torch, ...) with a barrier before each;
   per rank the median, the slowest rank's; reported as ratios ours / torch (CPU: no absolute times).
2. **The bubble**: every schedule (gpipe, 1f1b, interleaved ``v = 2``, zbh1) on a tiny GPT whose stage
   work is a sleep (``StageCost``: ``t_F`` forward, ``t_B`` backward, ``t_W`` queued as zbh1's ``W``
   or slept inside ``B``; ``1/v`` of it per interleaved chunk). The sleep stands for a GPU kernel that does
   not use the CPU, so four ranks on two cores still overlap. From the ``PipelineEvent`` s: busy =
   sum of ``end - ready`` (after the input arrived), makespan = last ``end`` - first ``start`` over the
   ranks, bubble = ``1 - busy / (p x makespan)``, median of the steps; against ``bubble_formula``
   (Huang et al. 2019; Narayanan et al. 2021; Qi et al. 2023) and the chapter's 3 percentage points.
   Beside it the simulator (``simulate``) replaying each action's measured duration with the median
   measured transfer delay ``p2p`` (what is left between it and the measured bubble: the delays' tail),
   the delays' median and largest, and the slowest action over its kind's median.

**Pinned to gloo on the CPU**, also on a GPU box (``run_ranks(..., backend="gloo")``; ``ctx.device``, which
the stages are given, is the CPU): part 2's sleeps stand in for GPU kernels on CPU ranks, and the one-device
reference of part 1 runs on the same CPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from refimpl.config import ModelConfig
from refimpl.models import GPT, lm_loss
from refimpl.models.gpt_stages import build_stages
from refimpl.parallel.pipeline_parallel import build_schedule
from refimpl.parallel.pipeline_parallel.executor import run_schedule
from refimpl.parallel.pipeline_parallel.simulator import Costs, bubble_formula, simulate
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore, defer_weight_gradients

FACTOR = 4.0  # stated, as in tests/ranks/test_pipeline_gpt.py: within 4 x the one-device order spread
MARGIN = 0.03  # the chapter's margin for a measured bubble against its formula
TIMED = {"1f1b": 1, "interleaved": 2}  # schedule -> virtual stages
BUBBLE = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbh1": 1}
B, S = 2, 64  # sequences per micro-batch, tokens per sequence (step-time model)


CONFIG = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, max_seq_len=S,
                     tie_word_embeddings=False)  # the timed GPT (untied: torch's stages hold no tied copy)
TINY = ModelConfig(num_layers=8, hidden_size=16, num_attention_heads=2, max_seq_len=8,
                   tie_word_embeddings=False)  # the bubble's GPT: its compute small beside the sleeps


def _batch(m: int, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (m * b, s + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]  # [m b, s] inputs and labels


class StageCost(torch.autograd.Function):
    """Identity whose forward sleeps ``cost.forward`` s and backward ``cost.backward`` s, plus the weight
    gradient's ``cost.weight`` s queued in ``store`` (zbh1's ``W``) or slept at once (no store)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, cost: Costs, store: WeightGradStore | None) -> torch.Tensor:
        ctx.cost, ctx.store = cost, store
        time.sleep(cost.forward)
        return y.clone()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        time.sleep(ctx.cost.backward)
        if ctx.store is not None:
            ctx.store.push(lambda: time.sleep(ctx.cost.weight))  # runs at the W of this micro-batch
        else:
            time.sleep(ctx.cost.weight)
        return dy, None, None


def _with_cost(stage: torch.nn.Module, cost: Costs, store: WeightGradStore | None) -> None:
    inner = stage.forward
    stage.forward = lambda x: StageCost.apply(inner(x), cost, store)


def _grads(stages: dict) -> dict[str, np.ndarray]:  # numpy: tensors would travel as shared memory
    return {full: dict(st.named_parameters())[local].grad.numpy().copy()
            for st in stages.values() for local, full in st.full_names().items()}


def _zero(stages: dict) -> None:
    for stage in stages.values():
        for p in stage.parameters():
            p.grad = None


def _ours(ctx, name: str, v: int, stages: dict, m: int, *, shape: tuple[int, int, int], store=None,
          events=None) -> float:
    """One step of our executor on this rank's list; ``shape`` = ``(b, s, h)`` of a micro-batch."""
    x, y = _batch(m, shape[0], shape[1])
    actions = build_schedule(name, pp_size=ctx.world_size, num_microbatches=m, virtual_stages=v)[ctx.rank]
    loss = run_schedule(actions, stages=stages, pp_group=None, pp_size=ctx.world_size, inputs=x.chunk(m),
                        labels=y.chunk(m), loss_fn=lambda o, t: lm_loss(o, t, num_tokens=y.numel()),
                        activation_shape=shape, activation_dtype=torch.float32, store=store, events=events)
    return float(loss)


def _torch_schedule(ctx, name: str, stages: dict, m: int, num_tokens: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    pipe = [PipelineStage(stages[s], s, ctx.world_size * TIMED[name], ctx.device) for s in sorted(stages)]
    loss_fn = lambda o, t: lm_loss(o, t, num_tokens=num_tokens)  # noqa: E731
    if name == "1f1b":
        return Schedule1F1B(pipe[0], m, loss_fn=loss_fn, scale_grads=False)
    return ScheduleInterleaved1F1B(pipe, m, loss_fn=loss_fn, scale_grads=False)


def _torch_step(ctx, sched, m: int) -> float:
    x, y = _batch(m, B, S)
    if ctx.rank < ctx.world_size - 1:  # the first stage's rank feeds the tokens, the middle ones relay
        sched.step(*([x] if ctx.rank == 0 else []), return_outputs=False)
        return 0.0
    losses: list[torch.Tensor] = []
    sched.step(target=y, losses=losses, return_outputs=False)
    total = torch.zeros(())
    for loss in losses:  # float32, in micro-batch order: as our last stage adds them
        total += loss.detach()
    return float(total)


def _timings(ctx, m: int, repeats: int, warmup: int) -> dict:
    ours = {n: build_stages(GPT(CONFIG, seed=0), pp_rank=ctx.rank, pp_size=ctx.world_size,
                            virtual_stages=v) for n, v in TIMED.items()}
    theirs = {n: build_stages(GPT(CONFIG, seed=0), pp_rank=ctx.rank, pp_size=ctx.world_size,
                              virtual_stages=v) for n, v in TIMED.items()}
    scheds = {n: _torch_schedule(ctx, n, theirs[n], m, m * B * S) for n in TIMED}
    steps, shape = {}, (B, S, CONFIG.hidden_size)
    for n, v in TIMED.items():
        steps[f"ours {n}"] = (lambda n=n, v=v: _ours(ctx, n, v, ours[n], m, shape=shape), ours[n])
        steps[f"torch {n}"] = (lambda n=n: _torch_step(ctx, scheds[n], m), theirs[n])
    out: dict = {"check": {}}
    for key, (fn, stages) in steps.items():  # the check before any timing
        _zero(stages)
        out["check"][key] = {"loss": fn(), "grads": _grads(stages)}
    for n in TIMED:  # negative control: torch dividing the gradients by m once more
        _zero(theirs[n])
        scheds[n].scale_grads = True
        out["check"][f"torch {n}, scale_grads=True"] = {"loss": _torch_step(ctx, scheds[n], m),
                                                         "grads": _grads(theirs[n])}
        scheds[n].scale_grads = False
    times = {k: [] for k in steps}
    for i in range(warmup + repeats):
        for key, (fn, stages) in steps.items():
            _zero(stages)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[key].append(time.perf_counter() - t0)
    out["median_s"] = {k: statistics.median(t) for k, t in times.items()}
    return out


def _costed_stages(ctx, name: str, v: int, cost_s: float) -> tuple[dict, WeightGradStore | None]:
    stages = build_stages(GPT(TINY, seed=0), pp_rank=ctx.rank, pp_size=ctx.world_size, virtual_stages=v)
    store = WeightGradStore() if name == "zbh1" else None
    cost = Costs(forward=cost_s / v, backward=cost_s / v, weight=cost_s / v)
    for stage in stages.values():
        if store is not None:
            defer_weight_gradients(stage, store)
        _with_cost(stage, cost, store)
    return stages, store


def _bubbles(ctx, ms: list[int], cost_s: float, repeats: int) -> dict:
    """Per (schedule, m): ``repeats`` steps' events of this rank, ``(kind, stage, mb, start, ready, end)``."""
    shape = (1, 8, TINY.hidden_size)
    stages, _ = _costed_stages(ctx, "gpipe", 1, cost_s)
    _ours(ctx, "gpipe", 1, stages, 4, shape=shape)  # one warm-up step for the whole sweep
    out = {}
    for name, v in BUBBLE.items():
        for m in ms:
            stages, store = _costed_stages(ctx, name, v, cost_s)
            runs = []
            for _ in range(repeats):
                events: list = []
                _zero(stages)
                dist.barrier()
                _ours(ctx, name, v, stages, m, shape=shape, store=store, events=events)
                runs.append([(e.kind, e.stage, e.microbatch, e.start, e.ready, e.end) for e in events])
            out[name, m] = runs
    return out


def _worker(ctx, m: int, repeats: int, warmup: int, bubble_m: list[int], cost_s: float,
            bubble_repeats: int) -> dict:
    torch.set_num_threads(1)
    return {"timing": _timings(ctx, m, repeats, warmup), "bubble": _bubbles(ctx, bubble_m, cost_s,
                                                                            bubble_repeats)}


def _one_device(m: int, order: list[int]) -> dict:
    """The same step on one process, the micro-batches in ``order`` (run with one thread, as each rank)."""
    model, (x, y) = GPT(CONFIG, seed=0), _batch(m, B, S)
    total = torch.zeros(())
    for i in order:
        loss = lm_loss(model(x.chunk(m)[i]), y.chunk(m)[i], num_tokens=y.numel())
        loss.backward()
        total += loss.detach()
    return {"loss": float(total), "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()}}


def _error(per_rank: list[dict], key: str, ref: dict) -> tuple[float, bool]:
    """(largest |gradient - one device|, and whether the loss and all gradients are the same bits)."""
    got: dict[str, np.ndarray] = {}
    for r in per_rank:
        got.update(r["timing"]["check"][key]["grads"])
    assert sorted(got) == sorted(ref["grads"]), key
    worst = max(float(np.abs(got[n] - ref["grads"][n]).max()) for n in got)
    loss = per_rank[-1]["timing"]["check"][key]["loss"]
    return max(worst, abs(loss - ref["loss"])), worst == 0.0 and loss == ref["loss"]


class _Replay:
    """Costs for ``simulate`` that give each action its own measured duration (duck-typed ``Costs``)."""

    def __init__(self, durations: dict[tuple[str, int, int], float]) -> None:
        self.durations = durations

    def of(self, action, *, split: bool) -> float:  # noqa: ARG002 - Costs.of's signature
        return self.durations[action.kind, action.stage, action.microbatch]


def _analyse(runs: list, name: str, p: int, m: int, v: int) -> dict[str, object]:
    """Of ``runs`` (per step, per rank ``[(kind, stage, mb, start, ready, end)]``), per step: the bubble
    ``1 - sum(end - ready) / (p x makespan)``; the simulator's bubble with each action's measured
    ``end - ready`` (replayed), ``p2p`` the median delay from a producer's end
    to the ``ready`` of a consumer on another rank that was already waiting (and the largest); and the
    slowest action over its kind's median."""
    schedule = build_schedule(name, pp_size=p, num_microbatches=m, virtual_stages=v)
    out: dict[str, list[float]] = {k: [] for k in ("steps", "replayed", "p2p", "p2p max", "slowest")}
    for run in runs:
        flat = [e for rank in run for e in rank]
        makespan = max(e[5] for e in flat) - min(e[3] for e in flat)
        out["steps"].append(1.0 - sum(e[5] - e[4] for e in flat) / (p * makespan))
        end = {(k, s, i): (e, r) for r, rank in enumerate(run) for k, s, i, _, _, e in rank}
        delays, spans = [], {"F": [], "B": [], "W": []}
        for r, rank in enumerate(run):
            for k, s, i, start, ready, e in rank:
                spans[k].append(e - ready)
                need = ("F", s - 1, i) if k == "F" else ("B", s + 1, i) if k == "B" else None
                if need in end and end[need][1] != r and start <= end[need][0]:
                    delays.append(ready - end[need][0])
        p2p = statistics.median(delays)
        replay = _Replay({(k, s, i): e - ready for rank in run for k, s, i, _, ready, e in rank})
        out["replayed"].append(simulate(schedule, num_microbatches=m, virtual_stages=v, costs=replay,
                                        p2p=p2p).bubble)
        out["p2p"].append(p2p)
        out["p2p max"].append(max(delays))
        out["slowest"].append(max(max(x) / statistics.median(x) for x in spans.values() if x))
    return {k: statistics.median(x) for k, x in out.items()} | {"range": (min(out["steps"]),
                                                                          max(out["steps"]))}


def run(sizes: list[int], m: int, repeats: int, warmup: int, bubble_m: list[int], cost_ms: float,
        bubble_repeats: int) -> str:
    from refimpl.launch import run_ranks

    torch.set_num_threads(1)  # the one-device reference as each rank runs: a kernel's split changes its bits
    ref, other = _one_device(m, list(range(m))), _one_device(m, list(reversed(range(m))))
    spread = max(float(np.abs(ref["grads"][n] - other["grads"][n]).max()) for n in ref["grads"])
    if not spread > 0:
        raise SystemExit("both micro-batch orders give the same bits: no spread to derive a tolerance")
    timing = ["| p | schedule | ours / torch, step time | ours vs one device | torch vs one device | "
              "torch, scale_grads=True (negative control) |", "|---|---|---|---|---|---|"]
    bubble = ["| p | schedule | m | formula | measured (min - max) | measured - formula | simulator, each "
              "action's measured duration | p2p, median (max) | slowest action / its kind's median |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in sizes:
        per_rank = run_ranks(_worker, p, m, repeats, warmup, bubble_m, cost_ms / 1e3, bubble_repeats,
                             timeout_s=900, backend="gloo")
        for name in TIMED:
            cells = []
            for key in (f"ours {name}", f"torch {name}"):
                err, same = _error(per_rank, key, ref)
                if not (same or err <= FACTOR * spread):
                    raise SystemExit(f"p = {p}: {key} differs from one device by {err:.3g} > {FACTOR:g} x "
                                     f"{spread:.3g}; not timing a wrong pipeline")
                cells.append("bitwise" if same else f"{err / spread:.2f} x spread")
            bad, _ = _error(per_rank, f"torch {name}, scale_grads=True", ref)
            if not bad > FACTOR * spread:
                raise SystemExit(f"p = {p}: the negative control passed the check: it cannot fail")
            ours, theirs = (max(r["timing"]["median_s"][f"{k} {name}"] for r in per_rank)
                            for k in ("ours", "torch"))
            ratio = ours / theirs
            label = name if TIMED[name] == 1 else f"{name}, v = {TIMED[name]}"
            timing.append(f"| {p} | {label} | {ratio:.2f} | {cells[0]} | {cells[1]} | "
                          f"{bad / spread:.3g} x spread (fails, as it must) |")
        for name, v in BUBBLE.items():
            for mb in bubble_m:
                runs = [[r["bubble"][name, mb][i] for r in per_rank] for i in range(bubble_repeats)]
                want = bubble_formula(name, pp_size=p, num_microbatches=mb, virtual_stages=v,
                                      costs=Costs(forward=1.0, backward=1.0, weight=1.0))
                found = _analyse(runs, name, p, mb, v)
                got, (low, high) = found["steps"], found["range"]
                flag = "" if abs(got - want) <= MARGIN else " (outside 3 pp)"
                label = name if v == 1 else f"{name}, v = {v}"
                bubble.append(f"| {p} | {label} | {mb} | {want:.1%} | {got:.1%} ({low:.1%} - {high:.1%}) | "
                              f"{(got - want) * 100:+.1f} pp{flag} | {found['replayed']:.1%} | "
                              f"{found['p2p'] * 1e3:.1f} ({found['p2p max'] * 1e3:.0f}) ms | "
                              f"{found['slowest']:.2f} |")
    return "\n".join(timing) + "\n\n" + "\n".join(bubble)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_pipeline_parallel",
                                description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (= ranks)")
    p.add_argument("--microbatches", type=int, default=8, help="m of the timed steps (divisible by each p)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bubble-m", type=int, nargs="+", default=[4, 8, 16], help="m of the bubble sweep")
    p.add_argument("--stage-cost-ms", type=float, default=15.0, help="t_F = t_B = t_W of a stage (sleep)")
    p.add_argument("--bubble-repeats", type=int, default=3)
    args = p.parse_args(argv)
    start = time.time()
    table = run(args.pp, args.microbatches, args.repeats, args.warmup, args.bubble_m, args.stage_cost_ms,
                args.bubble_repeats)
    print(table)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"\n(step time: median of {args.repeats} interleaved steps after {args.warmup} warm-up, slowest "
          f"rank, m = {args.microbatches}, {B} x {S} tokens per micro-batch; bubble: median of "
          f"{args.bubble_repeats} steps, t_F = t_B = t_W = {args.stage_cost_ms:g} ms of sleep per stage "
          f"(1/v per interleaved chunk); gloo on CPU ranks, 1 thread each; torch {torch.__version__}, "
          f"{machine}; {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
