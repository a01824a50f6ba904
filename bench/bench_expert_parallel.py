"""Benchmark of chapter 09: expert parallelism, the all-to-all vs the all-gather token dispatcher.

    python -m bench.bench_expert_parallel [--ep 2 4] [--repeats 9] [--warmup 2] [--tokens 512] [--dim 128]
                                          [--hidden 256] [--experts 8] [--top-k 2] [--skew 0.1]

Forward + backward of one mixture-of-experts layer (``refimpl.parallel.expert_parallel.MoE``: a
bias-free softmax top-k router, ``E`` SwiGLU experts in 3-D weights run by ``torch._grouped_mm``, dropless,
the load-balancing loss in the loss, float32) with its experts spread over ``ep`` CPU ranks (gloo,
world = ep, one thread each), rank ``r`` holding experts ``[r E/ep, (r+1) E/ep)`` and routing its own
``--tokens`` tokens, two ways (Lepikhin et al. 2020, GShard; Megatron-LM's two token dispatchers):

* **all-to-all** (``dispatcher="alltoall"``): exchange the per-expert counts, send each token to the ranks
  of its ``k`` experts with an uneven all-to-all, run the local experts, send the outputs back;
* **all-gather** (``dispatcher="allgather"``, Megatron-LM's default): all-gather every rank's tokens and
  routing, every rank runs its experts on the tokens routed to them, the partial outputs are
  reduce-scattered back to their owners.

Two routings: **uniform** (the router as initialised) and **skewed**: the DeepSeek-V3 expert bias (it
steers the choice, not the combine weights) raised by ``--skew`` on rank 0's experts, so that rank 0
receives most of the assignments: the all-to-all's splits are then very uneven (the all-gather moves the
same bytes whatever the routing). The column "busiest rank" gives the share of all assignments that the
most-loaded rank's experts received (``1/ep`` when perfectly balanced).

**The PyTorch equivalent**: PyTorch core has no mixture-of-experts layer (torchtitan and Megatron-LM build
theirs on ``torch._grouped_mm``); the references are the same layer on one device, all ``ep x tokens`` tokens
on one process, with the grouped ``torch._grouped_mm`` experts (``MoE(..., ep_group=None)``) and with a
per-expert loop (``MoE.from_modules`` over ``ExpertMLP`` s holding the same weights).

Before anything is timed, each method's output, input gradient, router gradient (summed over ranks) and
every expert's gradient (from its owner) must equal the one-device grouped layer's within ``FACTOR`` x a
spread measured in the same run: the largest distance from that run of (a) the same run with the ranks'
token chunks in reverse order (the same sums in another order) and (b) the float64 run (whose routing is
checked to be the same). As in an expert-parallel run, each rank's router sees only its own chunk, so the
one device routes chunk by chunk (the per-rank auxiliary losses) and runs all chunks through the experts at
once (``concat_routings``, ``MoE.forward_routed``). The per-expert loop must pass the same check.
Negative controls that must fail it: an all-to-all that assumes uniform splits instead of exchanging the
counts (tokens reach the wrong experts), and the all-to-all's expert gradients divided by ``ep`` (an
expert averaged over the expert-parallel group: pytorch/pytorch#160285).

Reported: the median forward + backward time over ``--repeats`` (after ``--warmup``), methods interleaved
with a barrier before each, the slowest rank, **over** the one-device grouped layer (rank 0, timed in the
same loop while the other ranks wait in the barrier) and all-to-all **over** all-gather; bytes each rank
sent per forward and per backward, traced by ``refimpl.comm.CommTracer`` (the uneven all-to-alls'
bytes are the rows that leave the rank, exact; the all-gathers, reduce-scatters and the even count
exchange are the tracer's ring model of the payloads actually handed over, as torch does not say what
gloo sends) against ``alltoall_bytes`` (from the counts the run measured) and ``allgather_bytes``
(stated here; the planner has no MoE byte formula yet). CPU: compare ratios only; with more ranks than
free cores the ratios measure CPU time and the scheduler, not links.

**Pinned to gloo on the CPU**, also on a GPU box (``run_ranks(..., backend="gloo")``; ``ctx.device`` is the
CPU, where the layers, tokens and references are made): the one-device references and the proof compare
float32 and float64 runs on the same CPU, and the GPU's grouped GEMM is bench/gpu/check.py's.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from refimpl.parallel.expert_parallel import (
    ExpertMLP,
    MoE,
    all_to_all_tokens,
    combine,
    concat_routings,
    expert_major_order,
    inverse_permutation,
    permute,
    rank_splits,
    sort_by_expert,
)

KiB = 1024
FACTOR = 4.0  # stated, as in tests/ranks/test_expert_parallel.py: error <= 4 x the spread measured in the run
METHODS = {"all-to-all": "alltoall", "all-gather": "allgather"}  # method -> MoE dispatcher
GROUPED, LOOP = "one device, grouped experts", "one device, per-expert loop"
ROUTINGS = ("uniform", "skewed")
TENSORS = ("y", "dx", "router", "w1", "w3", "w2")  # output, input grad, router grad, expert grads


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """The layer and the tokens: ``tokens`` per rank, width ``dim``, expert hidden ``hidden``, ``experts``
    in all, ``top_k`` per token, ``skew`` the expert-bias raise on rank 0's experts (skewed routing)."""

    tokens: int
    dim: int
    hidden: int
    experts: int
    top_k: int
    skew: float


# ---- the layers, the data, one pass ---------------------------------------------------------------------


def build_moe(s: Sizes, *, ep: int, routing: str, ep_group: dist.ProcessGroup | None = None,
              dispatcher: str = "alltoall", dtype: torch.dtype = torch.float32) -> MoE:
    """The grouped layer of the module docstring, the same experts for every ``ep_group`` (seed 0); under
    ``routing="skewed"`` the expert bias of the first ``E/ep`` experts (rank 0's) is ``s.skew``."""
    moe = MoE(dim=s.dim, hidden=s.hidden, num_experts=s.experts, top_k=s.top_k, expert_bias=True,
              ep_group=ep_group, dispatcher=dispatcher, seed=0)
    if routing == "skewed":
        with torch.no_grad():
            moe.router.expert_bias[: s.experts // ep] = s.skew
    return moe.to(dtype)


def looped_copy(moe: MoE) -> MoE:
    """``moe`` (one device, grouped) as ``MoE.from_modules`` over ``ExpertMLP`` s: the same router
    weight and expert bias, each expert's ``nn.Linear`` weights the transposed slices of the 3-D ones."""
    e, h, f = moe.num_experts, moe.dim, moe.experts.hidden
    gate = nn.Linear(h, e, bias=False)
    experts = [ExpertMLP(h, f) for _ in range(e)]
    with torch.no_grad():
        gate.weight.copy_(moe.router.gate.weight)
        for i, m in enumerate(experts):
            for name in ("w1", "w3", "w2"):
                getattr(m, name).weight.copy_(getattr(moe.experts, name)[i].t())
    loop = MoE.from_modules(gate, experts, top_k=moe.router.config.top_k, expert_bias=True)
    loop.router.expert_bias.copy_(moe.router.expert_bias)
    return loop


def data(s: Sizes, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's tokens ``[ep, T, h]`` and the weights of the loss ``sum(y * g)``."""
    g = torch.Generator().manual_seed(ep)
    return (torch.randn(ep, s.tokens, s.dim, generator=g), torch.randn(ep, s.tokens, s.dim, generator=g))


def _expert_grads(moe: MoE) -> dict[str, torch.Tensor]:
    """``w1, w3, w2`` gradients ``[local experts, ...]`` in ``x @ W`` orientation (grouped or looped)."""
    if isinstance(moe.experts, nn.ModuleDict):
        return {n: torch.stack([getattr(m, n).weight.grad.t() for m in moe.experts.values()])
                for n in ("w1", "w3", "w2")}
    return {n: getattr(moe.experts, n).grad.clone() for n in ("w1", "w3", "w2")}


def _tensors(moe: MoE, y: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """After backward: the output, the input gradient, the router's and the experts' gradients."""
    return {"y": y.detach(), "dx": x.grad, "router": moe.router.gate.weight.grad.clone(),
            **_expert_grads(moe)}


def ep_pass(moe: MoE, x: torch.Tensor, g: torch.Tensor, tracer=None) -> dict[str, torch.Tensor]:
    """One rank's forward + backward of ``sum(y * g) + aux_loss``; ``tracer``: step 0 forward, 1 backward."""
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = moe(x)
    loss = (y * g).sum() + moe.aux_loss
    if tracer is not None:
        tracer.step()
    loss.backward()
    return {**_tensors(moe, y, x), "kept": moe.kept_per_expert}


def uniform_splits_pass(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Negative control: the all-to-all dispatch without the count exchange, every rank assuming each
    expert gets ``k T / E`` rows (consistent sizes, so gloo does not hang): rows reach the wrong experts."""
    moe.zero_grad(set_to_none=True)
    group, e = moe.ep_group, moe.num_experts
    x = x.clone().requires_grad_()
    routing = moe.router(x)
    plan = sort_by_expert(routing.kept_ids, e)
    assumed = torch.full((e,), plan.order.numel() // e)
    splits, recv = rank_splits(assumed, moe.ep_size), assumed.view(moe.ep_size, -1)
    got = all_to_all_tokens(permute(x, plan), splits, splits, group)
    order = expert_major_order(recv)
    out = moe.experts(got[order], recv.sum(0).tolist())
    back = all_to_all_tokens(out[inverse_permutation(order)], splits, splits, group)
    y = combine(back, routing.kept_weights, plan)
    ((y * g).sum() + routing.aux_loss).backward()
    return _tensors(moe, y, x)


def one_device_pass(moe: MoE, xs: torch.Tensor, gs: torch.Tensor,
                    reverse: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The whole ``[ep, T, h]`` on one process: each rank's chunk routed on its own (per-rank aux losses),
    all chunks through the experts at once; ``reverse``: the chunks in reverse rank order. Returns the
    tensors in rank order and the expert choices."""
    moe.zero_grad(set_to_none=True)
    ep, t, h = xs.shape
    ranks = list(range(ep))[::-1] if reverse else list(range(ep))
    x = xs.to(moe.router.gate.weight.dtype).clone().requires_grad_()
    chunks = [x[q] for q in ranks]
    routings = [moe.router(c) for c in chunks]
    y = moe.forward_routed(torch.cat(chunks), concat_routings(routings)).view(ep, t, h)
    y = y[torch.tensor(ranks).argsort()]                       # back in rank order
    loss = (y * gs.to(y.dtype)).sum() + sum(r.aux_loss for r in routings)
    loss.backward()
    return _tensors(moe, y, x), torch.cat([r.expert_ids for r in routings])


# ---- the formulas ----------------------------------------------------------------------------------------


def alltoall_bytes(rows: torch.Tensor, rank: int, *, dim: int, num_experts: int,
                   element_size: int = 4) -> dict[str, float]:
    """Bytes rank ``r`` sends with the all-to-all dispatcher, from the measured counts ``rows [N, N]``
    (``rows[p, q]``: kept assignments of rank ``p``'s tokens routed to rank ``q``'s experts). Forward: the
    count exchange, ``(N-1)/N x E`` int64, plus the token rows for other ranks' experts
    (``sum_q rows[r, q] - rows[r, r]``) and the expert outputs returned to the other ranks
    (``sum_p rows[p, r] - rows[r, r]``), ``h x element_size`` bytes each. Backward: the same rows the
    other way (their gradients), no count exchange. Uniform routing expects ``2 k T (N-1)/N`` rows each
    way."""
    n = rows.shape[0]
    own = int(rows[rank, rank])
    tokens = (int(rows[rank].sum()) - own + int(rows[:, rank].sum()) - own) * dim * element_size
    return {"forward": (n - 1) / n * num_experts * 8 + tokens, "backward": float(tokens)}


def allgather_bytes(*, tokens: int, dim: int, top_k: int, ep: int, element_size: int = 4) -> dict[str, float]:
    """Bytes every rank sends with the all-gather dispatcher (ring model, ``T`` tokens per rank): forward
    the all-gathers of the token count (int64), the tokens (``T h``), the expert ids (``T k`` int64) and the
    combine weights (``T k`` fp32), and the reduce-scatter of the fp32 partial outputs (``N T h``): each
    ``(N-1)/N`` of its full tensor; backward the all-gather of the output gradient (``T h``, fp32) and the
    reduce-scatters of the token and weight gradients:

        forward  = (N-1) (8 + T (h e + 8 k + 4 k + 4 h)),    backward = (N-1) T (4 h + h e + 4 k).

    Whatever the routing: every rank receives all ``(N-1) T`` other tokens, where the all-to-all moves only
    the ``~(N-1)/N k T`` assignments that leave the rank, ``k/N`` of it."""
    n, t, h, k, e = ep, tokens, dim, top_k, element_size
    return {"forward": float((n - 1) * (8 + t * (h * e + 8 * k + 4 * k + 4 * h))),
            "backward": float((n - 1) * t * (4 * h + h * e + 4 * k))}


# ---- what every rank runs --------------------------------------------------------------------------------


def worker(ctx, s: Sizes, repeats: int, warmup: int) -> dict:
    """One rank: per routing, the check passes (traced) and the negative control, then ``warmup + repeats``
    interleaved timed passes (none with ``repeats=0``: the proof alone, as tests/ranks/test_expert_parallel.py
    runs it)."""
    from refimpl.comm import CommTracer

    torch.set_num_threads(1)
    group, r, n = dist.group.WORLD, ctx.rank, ctx.world_size
    xs, gs = data(s, n)
    out: dict = {}
    for routing in ROUTINGS:
        layers = {m: build_moe(s, ep=n, routing=routing, ep_group=group, dispatcher=d)
                  for m, d in METHODS.items()}
        one = build_moe(s, ep=n, routing=routing) if r == 0 else None
        ones = {GROUPED: one, LOOP: looped_copy(one)} if one is not None else {}
        res: dict = {"results": {}, "sent": {}}
        for name, moe in layers.items():                       # the check and the bytes before any timing
            with CommTracer() as tracer:
                res["results"][name] = ep_pass(moe, xs[r], gs[r], tracer)
            res["sent"][name] = [tracer.bytes_sent(step=step) for step in (0, 1)]
        res["results"]["uniform splits"] = uniform_splits_pass(
            build_moe(s, ep=n, routing=routing, ep_group=group), xs[r], gs[r])
        times: dict[str, list[float]] = {m: [] for m in [*METHODS, GROUPED, LOOP]}
        for i in range(warmup + repeats):
            for name in times:
                dist.barrier()
                t0 = time.perf_counter()
                if name in layers:
                    ep_pass(layers[name], xs[r], gs[r])
                elif r == 0:                                   # all ranks' tokens on one process
                    one_device_pass(ones[name], xs, gs)
                elapsed = time.perf_counter() - t0
                if i >= warmup and (name in layers or r == 0):
                    times[name].append(elapsed)
        res["median_s"] = {m: statistics.median(t) for m, t in times.items() if t}
        out[routing] = res
    return out


# ---- the check, in the parent ------------------------------------------------------------------------------


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The expert-parallel run as one device holds it: outputs and input gradients in rank order, the
    router gradient summed over ranks, the experts' gradients from their owners in expert order."""
    return {"y": torch.stack([p["y"] for p in per_rank]), "dx": torch.stack([p["dx"] for p in per_rank]),
            "router": sum(p["router"] for p in per_rank),
            **{w: torch.cat([p[w] for p in per_rank]) for w in ("w1", "w3", "w2")}}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def error_ratio(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                spread: dict[str, float]) -> float:
    """The largest ``|got - reference| / (FACTOR x spread)`` over ``TENSORS`` (an exact match counts 0,
    a difference where the spread is 0 counts infinite). ``<= 1`` passes."""
    worst = 0.0
    for name in TENSORS:
        err = _diff(got[name], reference[name])
        if err:
            worst = max(worst, err / (FACTOR * spread[name]) if spread[name] > 0 else float("inf"))
    return worst


def references(s: Sizes, ep: int, routing: str) -> tuple[dict, dict[str, float], dict]:
    """The one-device grouped run (float32, chunks in rank order), the spread of each tensor (module
    docstring) and the per-expert loop's run. Run with one thread, as the ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        xs, gs = data(s, ep)
        natural, ids = one_device_pass(build_moe(s, ep=ep, routing=routing), xs, gs)
        reversed_, _ = one_device_pass(build_moe(s, ep=ep, routing=routing), xs, gs, reverse=True)
        exact, ids64 = one_device_pass(build_moe(s, ep=ep, routing=routing, dtype=torch.float64), xs, gs)
        if not torch.equal(ids, ids64):
            raise SystemExit(f"ep = {ep}, {routing}: float64 routes otherwise than float32, so its distance "
                             "is no spread; change the sizes")
        spread = {t: max(_diff(reversed_[t], natural[t]), _diff(exact[t], natural[t])) for t in TENSORS}
        loop, _ = one_device_pass(looped_copy(build_moe(s, ep=ep, routing=routing)), xs, gs)
    finally:
        torch.set_num_threads(threads)
    return natural, spread, loop


def check(per_rank: list[dict], natural: dict, spread: dict[str, float], ep: int) -> dict[str, float]:
    """Error ratios of both dispatchers and the two negative controls against one device."""
    results = {m: _assemble([p["results"][m] for p in per_rank]) for m in [*METHODS, "uniform splits"]}
    averaged = {t: v / ep if t.startswith("w") else v for t, v in results["all-to-all"].items()}
    return {**{m: error_ratio(results[m], natural, spread) for m in results},
            "experts / ep": error_ratio(averaged, natural, spread)}


@dataclass(frozen=True, kw_only=True)
class Proof:
    """What one ``(ep, routing)`` proved: ``errors`` (method or control -> error ratio, ``<= 1`` passes),
    ``rows [N, N]`` (kept assignments from rank ``p`` to rank ``q``'s experts), and per method the bytes
    each rank sent ``[forward, backward]`` (``sent``), the formula's (``plans``) and whether they agree."""

    errors: dict[str, float]
    rows: torch.Tensor
    sent: dict[str, list[list[float]]]
    plans: dict[str, list[dict[str, float]]]
    equal: dict[str, bool]


def prove(per_rank: list[dict], s: Sizes, ep: int, routing: str) -> Proof:
    """The parent's side of the proof for one routing of one ``worker`` run: the references, the
    error ratios (the per-expert loop's too) and the bytes against ``alltoall_bytes`` /
    ``allgather_bytes``."""
    natural, spread, loop = references(s, ep, routing)
    errors = {**check(per_rank, natural, spread, ep), LOOP: error_ratio(loop, natural, spread)}
    kept = torch.stack([p["results"]["all-to-all"]["kept"] for p in per_rank])   # [src, E]
    rows = kept.view(ep, ep, -1).sum(2)                                            # [src, dst]
    sent = {m: [p["sent"][m] for p in per_rank] for m in METHODS}
    plans = {"all-to-all": [alltoall_bytes(rows, q, dim=s.dim, num_experts=s.experts) for q in range(ep)],
             "all-gather": [allgather_bytes(tokens=s.tokens, dim=s.dim, top_k=s.top_k, ep=ep)] * ep}
    equal = {m: all(math.isclose(sent[m][q][i], plans[m][q][w], rel_tol=1e-12)
                    for q in range(ep) for i, w in enumerate(("forward", "backward"))) for m in METHODS}
    return Proof(errors=errors, rows=rows, sent=sent, plans=plans, equal=equal)


# ---- the table -----------------------------------------------------------------------------------------


def _kib(values: list[float]) -> str:
    if all(v == values[0] for v in values):
        return f"{values[0] / KiB:,.1f} KiB"
    return " / ".join(f"{v / KiB:,.1f}" for v in values) + " KiB"


def _error(ratio: float) -> str:
    return "bitwise" if ratio == 0 else f"{ratio:.2f}"


CONTROLS = {"uniform splits": "all-to-all without the count exchange",
            "experts / ep": "all-to-all, expert gradients / ep"}


def run(sizes: list[int], s: Sizes, repeats: int, warmup: int) -> str:
    from refimpl.launch import run_ranks

    lines = ["| ep | routing (busiest rank) | method | forward + backward / one device (grouped) | "
             "all-to-all / all-gather | error / (4 x spread) | sent per rank (rank 0 / 1 / ...), forward | "
             "backward | formula (forward / backward) |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for ep in sizes:
        by_routing = run_ranks(worker, ep, s, repeats, warmup, timeout_s=900, backend="gloo")
        for routing in ROUTINGS:
            per_rank = [p[routing] for p in by_routing]
            proof = prove(per_rank, s, ep, routing)
            for m in [*METHODS, LOOP]:
                if proof.errors[m] > 1.0:
                    raise SystemExit(f"ep = {ep}, {routing}: {m} differs from one device: error "
                                     f"{proof.errors[m]:.3g} x the allowed {FACTOR:g} x spread; not timing a "
                                     "wrong implementation")
            for control in CONTROLS:
                if not proof.errors[control] > 1.0:
                    raise SystemExit(f"ep = {ep}, {routing}: the negative control {control!r} passed the "
                                     f"check (ratio {proof.errors[control]:.3g}): the check cannot fail")
            busiest = float(proof.rows.sum(0).max()) / float(proof.rows.sum())
            label = f"{routing} ({busiest:.0%})"
            one = per_rank[0]["median_s"][GROUPED]
            slowest = {m: max(p["median_s"][m] for p in per_rank) for m in METHODS}
            lines.append(f"| {ep} | {label} | {GROUPED} | 1.00 | - | reference | - | - | - |")
            lines.append(f"| {ep} | {label} | {LOOP} | {per_rank[0]['median_s'][LOOP] / one:.2f} | - | "
                         f"{_error(proof.errors[LOOP])} | - | - | - |")
            for m in METHODS:
                sent = proof.sent[m]
                fwd, bwd = [pl["forward"] for pl in proof.plans[m]], [pl["backward"] for pl in proof.plans[m]]
                values = (f"{fwd[0] / KiB:,.1f} / {bwd[0] / KiB:,.1f} KiB" if len(set(fwd + bwd)) <= 2
                          else "the per-rank values")
                how = "from the measured counts" if m == "all-to-all" else "whatever the routing"
                formula = f"{values}, {how}: {'equal' if proof.equal[m] else 'DIFFERENT'}"
                lines.append(f"| {ep} | {label} | {m} | {slowest[m] / one:.2f} | "
                             f"{slowest[m] / slowest['all-gather']:.2f} | {_error(proof.errors[m])} | "
                             f"{_kib([v[0] for v in sent])} | {_kib([v[1] for v in sent])} | {formula} |")
            for control, what in CONTROLS.items():
                lines.append(f"| {ep} | {label} | negative control: {what} | - | - | "
                             f"{proof.errors[control]:.3g} (fails, as it must) | - | - | - |")
        uniform = 2 * s.top_k * s.tokens * (ep - 1) / ep * s.dim * 4
        gathered = 2 * (ep - 1) * s.tokens * s.dim * 4
        notes.append(f"ep = {ep}: uniform routing expects 2 k T (N-1)/N h 4 = {uniform / KiB:,.1f} KiB of "
                     f"all-to-all token rows each way per rank; the all-gather's token traffic, "
                     f"2 (N-1) T h 4 = {gathered / KiB:,.1f} KiB forward (ratio k/N = {s.top_k / ep:.2f})")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_expert_parallel",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="expert-parallel sizes (= ranks)")
    p.add_argument("--repeats", type=int, default=9, help="timed forward + backward passes per method")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--dim", type=int, default=128, help="model width h (a multiple of 4: _grouped_mm)")
    p.add_argument("--hidden", type=int, default=256, help="expert hidden width (a multiple of 4)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--skew", type=float, default=0.1, help="expert-bias raise on rank 0's experts (skewed)")
    args = p.parse_args(argv)
    if any(args.experts % ep for ep in args.ep):
        p.error(f"--experts {args.experts} must divide over every --ep {args.ep}")
    if (args.tokens * args.top_k) % args.experts:
        p.error("--tokens x --top-k must be a multiple of --experts (the uniform-splits negative control)")
    if args.dim % 4 or args.hidden % 4:
        p.error("--dim and --hidden must be multiples of 4 (torch._grouped_mm's 16-byte strides in fp32)")
    s = Sizes(tokens=args.tokens, dim=args.dim, hidden=args.hidden, experts=args.experts, top_k=args.top_k,
              skew=args.skew)
    start = time.time()
    table = run(args.ep, s, args.repeats, args.warmup)
    print(table)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"\n(median of {args.repeats} interleaved passes after {args.warmup} warm-up, slowest rank; "
          f"{s.tokens} tokens per rank, h {s.dim}, expert hidden {s.hidden}, {s.experts} SwiGLU experts, "
          f"top-{s.top_k} softmax, dropless, float32, skew {s.skew:g}; gloo on CPU ranks, 1 thread each; "
          f"torch {torch.__version__}, {machine}; {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
