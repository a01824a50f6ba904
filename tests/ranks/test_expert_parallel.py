"""Mixture of experts and expert parallelism (chapter 09): the router's maths, capacity, grouped experts,
the dispatch bookkeeping, and expert parallelism at ep 2 and ep 4 against one device.

Single process: top-k and renormalisation (by default above top-1 only: at top-1 the raw score, which
keeps the router's gradient; renormalised it is 1, the negative control), the load-balancing loss against
a hand computation on dyadic numbers (bit for bit), the z-loss, the expert bias (changes the choice, not
the combine weights; the sign of its update), capacity (``C``, which assignments drop, the dropped
fraction, a fully dropped token gives 0), ``GroupedExperts`` against its per-expert loop (an expert
with zero tokens included), the dispatch permutations (exact round trips) and the one-line errors.

Multi-rank (gloo, one ``run_ranks`` per world size, every check in it): four layers (``from_modules`` with
SwiGLU modules, dropless and with capacity and z-loss; the grouped layer with sigmoid scores, the expert
bias and GELU, and with capacity) run forward and backward with the all-to-all and the all-gather
dispatcher. Experts 6 and 7 never receive a token (a router bias of -30, or an expert bias of -10), so at
ep 4 rank 3 receives nothing (zero splits); the other splits are uneven as routing makes them. Also
bench/bench_expert_parallel.py's proof at ep 2 (its ``worker`` without timing, its ``prove``), which
checks the all-gather dispatcher's bytes as well.

The one-device reference processes all ranks' tokens concatenated, with **capacity and the auxiliary losses
per source rank's chunk** (each rank's router sees only its tokens): it routes each chunk on its own,
concatenates the routings (``concat_routings``) and runs ``MoE.forward_routed`` once, so every expert
sees all its tokens in one matmul, in (rank, token) order as on its owner rank.

Tolerances (docs/ARCHITECTURE.md, "Correctness and numerics"): ``FACTOR x spread``, ``FACTOR = 4``, per
tensor (outputs, input gradients, router gradients, each expert's gradients). ``spread`` is measured in the
same run: the largest distance from the natural-order one-device run of (a) the same run with the chunks in
reverse rank order, (b) with each chunk's tokens reversed (the same sums in other orders), and (c) the
float64 run (whose routing is checked to be the same). The router gradient is a sum over ranks of per-rank
sums, so it differs in the last bits (measured: at most 0.17 x the tolerance, i.e. 0.7 spread, at ep 4).
Outputs and expert gradients of the ``from_modules`` layers come out bit for bit equal (the same rows in the
same order in every matmul; the k = 2 combine adds two terms); with AVX-512 kernels ``_grouped_mm``'s result
for one expert depends on the other experts in the same call (measured: the 2-expert call of an ep 4 rank
and the 8-expert call of one device differ in the last bit), so the grouped layers do not, and the test
demands bits nowhere. The two dispatchers agree within the same tolerance (bit for bit here). Negative
controls: a dispatch that assumes uniform splits instead of exchanging the counts (outputs off by 3-6, more
than 100 x the tolerance), and expert gradients divided by ``ep`` (1e6 x the tolerance). Bytes: the token
all-to-alls send other ranks exactly ``(rows to others + rows back to others) x h x 4`` bytes each way, from
the kept counts; the tracer sees the count exchange (``E`` int64) and the rows handed to each all-to-all.
The single-process grouped-experts checks use the same rule with the float64 loop as the reference; under
bf16 autocast the grouped experts are held to autocast's own per-expert loop (bf16 matmuls) within ``FACTOR
x`` that loop's distance from float64, and every ``_grouped_mm`` they run, forward and backward, must get
bf16 operands and int32 offsets (autocast does not cast ``_grouped_mm``; before the experts cast for it,
every expert GEMM of a bf16 run computed in fp32, which on CUDA is the per-expert fallback with a host sync).

**Host syncs** per MoE layer and forward, counted by ``HostSyncCounter`` (the calls that wait for the
device on a GPU: ``.tolist()``, ``.item()`` / ``int`` / ``bool``, ``.cpu()``, ``bincount``, boolean masks,
``repeat_interleave`` without ``output_size``, and ``torch.tensor(list)`` copies), ``SYNC_BUDGET``. Before
this budget (same counter, same layers): 11 at ep 1 (the router's two ``bincount`` s and its dropped
fraction's ``float``, ``sort_by_expert``'s id check, kept count, mask and ``bincount``, the counts'
``tolist``, the offsets' ``torch.tensor``, ``kept_per_expert``'s mask and ``bincount``), 16 with the
all-to-all dispatcher at ep 2 (also the split sizes' two ``tolist`` s, the local counts' third, the
permutation's ``int`` and two ``repeat_interleave`` s), 13 with the all-gather one; backward 0. Now: one
``tolist`` of the counts per forward (the all-to-all's split sizes must be host ints; input splits, output
splits and local counts come in that one read), two with the all-gather dispatcher (its equal-token
check), none in backward. A negative control plants each kind of sync and counts it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from refimpl.comm import CommTracer
from refimpl.distributed.host_syncs import HostSyncCounter
from refimpl.launch import run_ranks
from refimpl.parallel.expert_parallel import (
    ExpertMLP,
    GroupedExperts,
    LoopedExperts,
    MoE,
    RouterConfig,
    TopKRouter,
    all_to_all_tokens,
    capacity_keep,
    combine,
    concat_routings,
    dispatch_all_to_all,
    expert_capacity,
    expert_major_order,
    grouped_mm_runs_fused,
    inverse_permutation,
    load_balancing_loss,
    permute,
    rank_splits,
    router_z_loss,
    sort_by_expert,
    undispatch_all_to_all,
    unpermute,
)
from tests.support.timeouts import SPAWN_TIMEOUT_S

H, FFN, E, K = 8, 16, 8, 2   # width, expert hidden, experts, top-k (h and f multiples of 4: _grouped_mm)
B, S = 2, 6                  # each rank's tokens: [B, S, H], T = 12
T = B * S
DEAD = (6, 7)                # experts that never receive a token
FACTOR = 4
CASES = ("modules_dropless", "modules_capacity", "grouped_sigmoid", "grouped_capacity")
DISPATCH = ("alltoall", "allgather")
SYNC_BUDGET = {"alltoall": 1, "allgather": 2}  # host syncs per layer and forward at ep > 1 (docstring)


# ---- the layers and data, the same on every rank and in the parent -----------------------------------------


def _randn(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _build(case: str, group, dispatcher: str = "alltoall") -> MoE:
    if case.startswith("modules"):
        router = nn.Linear(H, E)
        experts = [ExpertMLP(H, FFN) for _ in range(E)]
        with torch.no_grad():
            router.weight.copy_(_randn((E, H), 1, H**-0.5))
            router.bias.copy_(_randn((E,), 2, 0.1))
            router.bias[list(DEAD)] = -30.0
            for e, m in enumerate(experts):
                for i, p in enumerate(m.parameters()):
                    p.copy_(_randn(p.shape, 100 + 10 * e + i, p.shape[1] ** -0.5))
        extra = dict(capacity_factor=1.0, z_loss_coeff=1e-3) if case == "modules_capacity" else {}
        return MoE.from_modules(router, experts, top_k=K, ep_group=group, dispatcher=dispatcher, **extra)
    sigmoid = case == "grouped_sigmoid"
    moe = MoE(dim=H, hidden=FFN, num_experts=E, top_k=K, activation="gelu" if sigmoid else "swiglu",
              score_func="sigmoid" if sigmoid else "softmax", capacity_factor=None if sigmoid else 1.25,
              expert_bias=True, ep_group=group, dispatcher=dispatcher, seed=3)
    with torch.no_grad():
        moe.router.expert_bias.copy_(_randn((E,), 4, 0.05))
        moe.router.expert_bias[list(DEAD)] = -10.0
    return moe


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's tokens ``[world, B, S, H]`` and the loss weights of their outputs."""
    return _randn((world, B, S, H), 10 + world), _randn((world, B, S, H), 20 + world)


def _expert_grads(moe: MoE) -> dict[int, dict[str, torch.Tensor]]:
    """The gradient of each local expert's matrices, by global expert index (``x @ W`` orientation)."""
    out = {}
    for j in range(moe.num_local_experts):
        e = moe.first_expert + j
        if isinstance(moe.experts, GroupedExperts):
            out[e] = {n: getattr(moe.experts, n).grad[j].clone() for n in ("w1", "w3", "w2")
                      if getattr(moe.experts, n) is not None}
        else:
            m = moe.experts[str(e)]
            out[e] = {n: getattr(m, n).weight.grad.t().clone() for n in ("w1", "w3", "w2")}
    return out


def _run(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Forward (tracer step 0) and backward (step 1) of ``sum(y * g) + aux_loss``."""
    x = x.clone().requires_grad_()
    with CommTracer() as tracer:
        y = moe(x)
        loss = (y * g).sum() + moe.aux_loss
        tracer.step()
        loss.backward()
    return dict(
        y=y.detach(), dx=x.grad, router={n: p.grad.clone() for n, p in moe.router.named_parameters()},
        experts=_expert_grads(moe), aux=moe.aux_loss.detach(), tokens=moe.tokens_per_expert,
        kept=moe.kept_per_expert, dropped=moe.dropped_fraction,
        traffic=(moe.traffic.forward_bytes, moe.traffic.backward_bytes),
        a2a=[[e.nbytes for e in tracer.select(op="all_to_all", step=s)] for s in (0, 1)],
        a2a_wire=[[e.wire_bytes for e in tracer.select(op="all_to_all", step=s)] for s in (0, 1)],
    )


def _reference(case: str, x: torch.Tensor, g: torch.Tensor, order: str = "natural",
               dtype: torch.dtype = torch.float32) -> dict:
    """One device, all ranks' tokens concatenated; routing, capacity and aux losses per rank's chunk.
    ``order``: ``natural``, ``ranks_reversed`` (chunks in reverse rank order), ``tokens_reversed`` (each
    chunk's tokens reversed): the same sums in other orders. ``dtype=torch.float64``: the exact maths
    (``GroupedExperts`` then runs its loop)."""
    moe = _build(case, None).to(dtype)
    world = x.shape[0]
    x, g = x.detach().to(dtype).clone().requires_grad_(), g.to(dtype)
    chunks = list(x.reshape(world, T, H))
    ranks = list(range(world))[::-1] if order == "ranks_reversed" else list(range(world))
    if order == "tokens_reversed":
        chunks = [c.flip(0) for c in chunks]
    routings = [moe.router(chunks[q]) for q in ranks]
    routing = concat_routings(routings)
    y = moe.forward_routed(torch.cat([chunks[q] for q in ranks]), routing)
    parts = dict(zip(ranks, y.split(T), strict=True))
    y = torch.stack([parts[q].flip(0) if order == "tokens_reversed" else parts[q] for q in range(world)])
    y = y.view(x.shape)
    aux = sum(r.aux_loss for r in routings)
    ((y * g).sum() + aux).backward()
    return dict(y=y.detach(), dx=x.grad, router={n: p.grad.clone() for n, p in moe.router.named_parameters()},
                experts=_expert_grads(moe), aux=[r.aux_loss.detach() for r in routings],
                decisions=(routing.expert_ids, routing.keep))


# ---- what every rank runs ----------------------------------------------------------------------------------


def _uniform_splits(case: str, group, x: torch.Tensor) -> torch.Tensor:
    """Negative control: the counts are not exchanged; every rank assumes each expert gets ``A / E`` rows
    (consistent sizes, so gloo does not hang), and rows reach the wrong experts."""
    moe = _build(case, group)
    n = dist.get_world_size(group)
    tokens = x.reshape(-1, H)
    routing = moe.router(tokens)
    plan = sort_by_expert(routing.kept_ids, E)
    assumed = torch.full((E,), plan.order.numel() // E)
    splits = rank_splits(assumed, n)
    recv = assumed.view(n, -1)
    got = all_to_all_tokens(permute(tokens, plan), splits, splits, group)
    order = expert_major_order(recv)
    y = moe.experts(got[order], recv.sum(0).tolist())
    back = all_to_all_tokens(y[inverse_permutation(order)], splits, splits, group)
    return combine(back, routing.kept_weights, plan).detach().view(x.shape)


def _round_trip(group, x: torch.Tensor, seed: int) -> dict:
    """Identity experts: dispatch then undispatch returns every kept assignment's token, and the gradient."""
    moe = _build("modules_capacity", group)
    tokens = x.reshape(-1, H).clone().requires_grad_()
    routing = moe.router(tokens.detach())
    d = dispatch_all_to_all(tokens, routing, num_experts=E, group=group)
    back = undispatch_all_to_all(d.tokens, d, group)
    gy = _randn(back.shape, seed)
    back.backward(gy)
    local = tokens.detach().clone().requires_grad_()
    expected = permute(local, d.plan)
    expected.backward(gy)
    return dict(tokens_equal=torch.equal(back.detach(), expected.detach()),
                grad_equal=torch.equal(tokens.grad, local.grad), received=d.tokens.detach(), counts=d.counts,
                kept_ids=routing.kept_ids, dropped=routing.dropped_fraction)


def _beside_the_dispatch(group, x: torch.Tensor, g: torch.Tensor) -> dict:
    """A shared expert (one linear layer) added to the MoE's output three ways: after the layer (the
    reference), computed while the dispatch travels (``beside``, ``dispatch_beside``) and after the
    dispatch's wait (``overlap_dispatch = False``, the control): outputs and every gradient, and the
    bytes the dispatch sent."""
    out = {}
    for way in ("after", "beside", "control"):
        moe = _build("grouped_capacity", group, "alltoall")
        moe.overlap_dispatch = way != "control"
        shared = nn.Linear(H, H)
        with torch.no_grad():
            shared.weight.copy_(_randn((H, H), 40, H**-0.5))
            shared.bias.copy_(_randn((H,), 41, 0.1))
        xx = x.clone().requires_grad_()
        y = moe(xx) + shared(xx) if way == "after" else moe(xx, beside=lambda s=shared, t=xx: s(t))
        ((y * g).sum() + moe.aux_loss).backward()
        out[way] = {"y": y.detach(), "dx": xx.grad, "shared": [p.grad for p in shared.parameters()],
                    "experts": _expert_grads(moe), "router": [p.grad for p in moe.router.parameters()],
                    "traffic": (moe.traffic.forward_bytes, moe.traffic.backward_bytes)}
    return out


def _host_syncs(case: str, group, x: torch.Tensor, dispatcher: str) -> tuple[list[str], list[str]]:
    """The host syncs (``"what @ file:line"``) of one forward and of its backward."""
    moe = _build(case, group, dispatcher)
    x = x.clone().requires_grad_()
    with HostSyncCounter() as forward:
        y = moe(x)
    with HostSyncCounter() as backward:
        ((y * y).sum() + moe.aux_loss).backward()
    return sorted(forward.by_place().elements()), sorted(backward.by_place().elements())


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _ranks(ctx, world: int) -> dict:
    group = dist.group.WORLD
    rank = dist.get_rank()
    x, g = _data(world)
    out = {(case, disp): _run(_build(case, group, disp), x[rank], g[rank])
           for case in CASES for disp in DISPATCH}
    out["syncs"] = {(case, disp): _host_syncs(case, group, x[rank], disp)
                    for case in CASES for disp in DISPATCH}
    out["uniform"] = _uniform_splits("modules_dropless", group, x[rank])
    out["round_trip"] = _round_trip(group, x[rank], 30 + rank)
    out["beside"] = _beside_the_dispatch(group, x[rank], g[rank])
    moe = _build("grouped_sigmoid", group)
    moe(x[rank])
    out["bias"] = (moe.router.expert_bias.clone(), moe.update_expert_bias(0.5, group=group).clone())
    odd = 6 if world == 4 else 3
    out["errors"] = [
        _error(lambda: MoE(dim=H, hidden=FFN, num_experts=odd, top_k=1, ep_group=group)),
        _error(lambda: MoE.from_modules(nn.Linear(H, odd), [nn.Identity()] * odd, top_k=1, ep_group=group)),
    ]
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ranks(request):
    world = request.param
    return world, run_ranks(_ranks, world, world, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def one_thread():
    """The references run as the ranks do: one thread (init_distributed sets it on a CPU rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- comparing -------------------------------------------------------------------------------------------


def _flat(result: dict) -> dict[str, torch.Tensor]:
    """The compared tensors of a run by name: outputs, input gradients, router and expert gradients."""
    out = {"y": result["y"], "dx": result["dx"]}
    out.update({f"router.{n}": t for n, t in result["router"].items()})
    out.update({f"expert{e}.{n}": t for e, grads in result["experts"].items() for n, t in grads.items()})
    return out


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The expert-parallel run as one device would hold it: outputs and input gradients stacked in rank
    order, the router gradient summed over ranks, each expert's gradient from its owner."""
    whole = {"y": torch.stack([r["y"] for r in per_rank]), "dx": torch.stack([r["dx"] for r in per_rank]),
             "router": {n: sum(r["router"][n] for r in per_rank) for n in per_rank[0]["router"]},
             "experts": {e: grads for r in per_rank for e, grads in r["experts"].items()}}
    return _flat(whole)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


@pytest.fixture(scope="module")
def references(ranks, one_thread):
    """Per case: the natural-order one-device run, the spread of each tensor (the largest distance of the
    other token orders and of float64 from it) and the per-chunk aux losses."""
    world, _ = ranks
    x, g = _data(world)
    out = {}
    for case in CASES:
        run = _reference(case, x, g)
        exact = _reference(case, x, g, dtype=torch.float64)
        for a, b in zip(run["decisions"], exact["decisions"], strict=True):  # the same routing, or the
            assert torch.equal(a, b), f"{case}: float64 routes otherwise"  # float64 spread means nothing
        natural = _flat(run)
        others = [_flat(_reference(case, x, g, order)) for order in ("ranks_reversed", "tokens_reversed")]
        others.append({n: t.float() for n, t in _flat(exact).items()})
        spread = {n: max(_diff(o[n], t) for o in others) for n, t in natural.items()}
        out[case] = natural, spread, run["aux"]
    return out


def _worst(got: dict[str, torch.Tensor], natural: dict, spread: dict) -> tuple[float, str]:
    """The largest |ours - one device| / (FACTOR x spread) over the tensors (0/0 counts as 0)."""
    assert got.keys() == natural.keys(), (sorted(got), sorted(natural))
    worst, where = 0.0, ""
    for n, t in got.items():
        err = _diff(t, natural[n])
        ratio = 0.0 if err == 0 else err / (FACTOR * spread[n]) if spread[n] > 0 else math.inf
        if ratio > worst:
            worst, where = ratio, n
    return worst, where


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_expert_parallel_equals_one_device_outputs_and_every_gradient(ranks, references):
    world, per_rank = ranks
    for case in CASES:
        natural, spread, aux = references[case]
        for disp in DISPATCH:
            got = _assemble([r[(case, disp)] for r in per_rank])
            worst, where = _worst(got, natural, spread)
            assert worst <= 1.0, f"ep={world} {case} {disp}: {where} at {worst:.2f} x (FACTOR x spread)"
            for rank, r in enumerate(per_rank):  # each rank's aux loss is its own chunk's
                assert torch.equal(r[(case, disp)]["aux"], aux[rank]), (case, disp, rank)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_the_two_dispatchers_agree(ranks, references):
    world, per_rank = ranks
    for case in CASES:
        _, spread, _ = references[case]
        a2a = _assemble([r[(case, "alltoall")] for r in per_rank])
        gathered = _assemble([r[(case, "allgather")] for r in per_rank])
        worst, where = _worst(gathered, a2a, spread)
        assert worst <= 1.0, f"ep={world} {case}: allgather vs alltoall at {where}: {worst:.2f} x tol"


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_negative_controls_fail_the_same_check(ranks, references):
    """Counts not exchanged (uniform splits assumed), and expert gradients divided by ep."""
    world, per_rank = ranks
    natural, spread, _ = references["modules_dropless"]
    uniform = torch.stack([r["uniform"] for r in per_rank])
    assert _diff(uniform, natural["y"]) > 100 * FACTOR * spread["y"], "uniform splits passed"
    for case in CASES:
        natural, spread, _ = references[case]
        got = _assemble([r[(case, "alltoall")] for r in per_rank])
        averaged = {n: t / world if n.startswith("expert") else t for n, t in got.items()}
        worst, where = _worst(averaged, natural, spread)
        assert worst > 1.0, f"{case}: expert gradients divided by ep={world} passed the check"


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_round_trip_with_identity_experts_is_exact(ranks):
    """dispatch + undispatch returns each kept assignment's token and its gradient bit for bit, and each
    owner receives exactly the tokens routed to its experts, in (source rank, token) order."""
    world, per_rank = ranks
    x, _ = _data(world)
    x = x.reshape(world, T, H)
    local = E // world
    assert any(r["round_trip"]["dropped"] > 0 for r in per_rank)  # capacity dropped some assignments
    for owner, r in enumerate(per_rank):
        trip = r["round_trip"]
        assert trip["tokens_equal"] and trip["grad_equal"], owner
        expected, counts = [], []
        for e in range(owner * local, (owner + 1) * local):
            rows = [x[q][torch.nonzero(per_rank[q]["round_trip"]["kept_ids"] == e)[:, 0]]
                    for q in range(world)]
            expected += rows
            counts.append(sum(len(t) for t in rows))
        assert torch.equal(trip["received"], torch.cat(expected)), owner
        assert trip["counts"] == counts, (owner, trip["counts"], counts)


def test_shared_experts_beside_the_dispatch_change_nothing(ranks):
    """DeepSeek-V3's overlap (``MoE(x, beside=...)``: the shared experts computed while the dispatch's
    all-to-all travels) and its serialized control give the layer-then-add reference's output and every
    gradient bit for bit (the same operations, in another order of time), and the dispatch sends the
    same bytes both ways."""
    _, per_rank = ranks
    for rank, r in enumerate(per_rank):
        ways = r["beside"]
        for way in ("beside", "control"):
            for key in ("y", "dx", "shared", "experts", "router", "traffic"):
                assert _same(ways[way][key], ways["after"][key]), (rank, way, key)
        assert ways["beside"]["traffic"][0] > 0  # tokens left the rank


def _same(a, b) -> bool:
    """Bitwise equal, through lists and dicts of tensors (and plain values)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_zero_token_experts_zero_and_uneven_splits(ranks, references):
    world, per_rank = ranks
    local = E // world
    for case in CASES:
        runs = [r[(case, "alltoall")] for r in per_rank]
        for e in DEAD:
            assert all(int(run["tokens"][e]) == 0 for run in runs), (case, e)
            owner = runs[e // local]["experts"][e]
            assert all(torch.equal(g, torch.zeros_like(g)) for g in owner.values()), (case, e)
        sends = [run["kept"].view(world, local).sum(1).tolist() for run in runs]  # rows rank r sends rank q
        assert any(len(set(s)) > 1 for s in sends), (case, sends)  # uneven
        if world == 4:  # rank 3 owns experts 6 and 7: every split to it is zero
            assert all(s[3] == 0 for s in sends), sends
            assert runs[3]["a2a"][0][2] == 0  # its combine all-to-all hands over no rows


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_all_to_all_bytes_equal_the_formula_from_the_counts(ranks):
    """Bytes sent to other ranks per forward and per backward = (my rows for other ranks' experts + rows
    other ranks sent my experts, returned) x h x 4, from the kept counts; the tracer sees the count
    exchange (E int64) and the two token all-to-alls with exactly the rows handed over."""
    world, per_rank = ranks
    local = E // world
    row = H * 4  # float32
    for case in CASES:
        runs = [r[(case, "alltoall")] for r in per_rank]
        kept = torch.stack([run["kept"] for run in runs]).view(world, world, local).sum(2)  # [src, dst]
        for r, run in enumerate(runs):
            sent, received, own = int(kept[r].sum()), int(kept[:, r].sum()), int(kept[r, r])
            to_others = (sent - own + received - own) * row
            assert run["traffic"] == (to_others, to_others), (case, r, run["traffic"], to_others)
            assert run["a2a"][0] == [E * 8, sent * row, received * row], (case, r, run["a2a"])
            assert run["a2a"][1] == [sent * row, received * row], (case, r, run["a2a"])
            # the tracer books the token all-to-alls' wire bytes from their split sizes: what leaves the rank
            assert sum(run["a2a_wire"][0][1:]) == to_others == sum(run["a2a_wire"][1]), (case, r, run)
        gathered = [r[(case, "allgather")] for r in per_rank]
        assert all(run["a2a"] == [[], []] and run["traffic"] == (0, 0) for run in gathered)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_expert_bias_update_uses_the_load_of_every_rank(ranks):
    """``update_expert_bias(u, group=ep)`` sums the ranks' loads first: every rank makes the same update."""
    world, per_rank = ranks
    load = sum(r[("grouped_sigmoid", "alltoall")]["tokens"] for r in per_rank).float()
    for r in per_rank:
        before, after = r["bias"]
        assert torch.equal(after, before + 0.5 * torch.sign(load.mean() - load)), (before, after, load)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_capacity_is_per_rank_and_sizes_that_do_not_divide_are_errors(ranks):
    world, per_rank = ranks
    for case, cf in (("modules_capacity", 1.0), ("grouped_capacity", 1.25)):
        c = expert_capacity(T, K, E, cf)
        runs = [r[(case, "alltoall")] for r in per_rank]
        assert all(int(run["kept"].max()) <= c for run in runs), case
        assert any(run["dropped"] > 0 for run in runs), case
        for run in runs:
            assert run["dropped"] == (T * K - int(run["kept"].sum())) / (T * K)
    for message in per_rank[0]["errors"]:
        assert "do not divide over the expert-parallel size" in message and "\n" not in message, message


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_a_dispatch_reads_the_host_once_and_backward_never(ranks):
    """Per layer and forward: one ``tolist`` (the split sizes and local counts in one read) with the
    all-to-all dispatcher, two with the all-gather one (module docstring); backward none."""
    world, per_rank = ranks
    for rank, r in enumerate(per_rank):
        for case in CASES:
            for disp in DISPATCH:
                forward, backward = r["syncs"][(case, disp)]
                where = (world, rank, case, disp, forward, backward)
                assert len(forward) == SYNC_BUDGET[disp] and not backward, where
                assert all(e.startswith("tolist @ ") for e in forward), where


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_the_benchmark_proof_passes_both_dispatchers_and_fails_its_controls():
    """bench/bench_expert_parallel.py's proof at ep 2 on tiny sizes, without timing (its ``worker`` with no
    repeats, its ``prove``): both dispatchers and the per-expert loop within its tolerance of one device,
    uniform and skewed routing, both negative controls outside, and the bytes each rank sent forward and
    backward equal to its formulas (the all-gather dispatcher's bytes are checked nowhere else)."""
    from bench.bench_expert_parallel import CONTROLS, LOOP, METHODS, ROUTINGS, Sizes, prove, worker

    s = Sizes(tokens=16, dim=8, hidden=16, experts=4, top_k=2, skew=0.1)
    by_routing = run_ranks(worker, 2, s, 0, 0, timeout_s=SPAWN_TIMEOUT_S)
    for routing in ROUTINGS:
        proof = prove([p[routing] for p in by_routing], s, 2, routing)
        assert all(proof.errors[m] <= 1.0 for m in [*METHODS, LOOP]), (routing, proof.errors)
        assert all(proof.errors[c] > 1.0 for c in CONTROLS), (routing, proof.errors)
        assert all(proof.equal.values()), (routing, proof.sent, proof.plans)
        assert all(b > 0 for sent in proof.sent.values() for rank in sent for b in rank), proof.sent
    uniform, skewed = (prove([p[r] for p in by_routing], s, 2, r).rows for r in ROUTINGS)
    assert skewed[:, 0].sum() > uniform[:, 0].sum(), (uniform, skewed)  # the skew loads rank 0's experts


# ---- single process --------------------------------------------------------------------------------------


def _identity_router(config: RouterConfig) -> TopKRouter:
    """A router whose logits are its input (``W = I``, no bias)."""
    gate = nn.Linear(config.num_experts, config.num_experts, bias=False)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(config.num_experts))
    return TopKRouter(gate, config)


def test_router_top_k_and_renormalisation():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, -1.0, 0.5, 4.0], [1.0, 2.0, -2.0, 1.5]])
    expected_ids = [[0, 2], [3, 2], [1, 3]]
    for score_func, scores in (("softmax", logits.softmax(-1)), ("sigmoid", logits.sigmoid())):
        for normalize in (True, False):
            cfg = RouterConfig(num_experts=4, top_k=2, score_func=score_func, normalize_topk=normalize,
                               aux_loss_coeff=0.0)
            r = _identity_router(cfg)(logits)
            assert r.expert_ids.tolist() == expected_ids, (score_func, r.expert_ids)
            picked = scores.gather(1, r.expert_ids)
            weights = picked / picked.sum(-1, keepdim=True) if normalize else picked
            assert torch.equal(r.weights, weights) and torch.equal(r.scores, scores), (score_func, normalize)
            assert r.tokens_per_expert.tolist() == [1, 1, 2, 2] and r.dropped_fraction == 0.0
            assert r.keep.all() and float(r.aux_loss) == 0.0


def test_the_default_renormalises_above_top_1_and_keeps_switchs_raw_score_at_top_1():
    """``normalize_topk=None`` is ``top_k > 1`` (GShard, Mixtral, DeepSeek-V3 renormalise; Switch's top-1
    multiplies by the raw probability). At ``k = 1`` the raw weight carries the router's gradient from any
    loss of the output; renormalised it is ``s / s = 1``, whose gradient is zero up to rounding (the
    negative control)."""
    assert [RouterConfig(num_experts=4, top_k=k).normalize_topk for k in (1, 2, 4)] == [False, True, True]
    assert RouterConfig(num_experts=4, top_k=1, normalize_topk=True).normalize_topk is True
    assert RouterConfig(num_experts=4, top_k=2, normalize_topk=False).normalize_topk is False
    logits = _randn((6, 4), 12)
    grads = {}
    for normalize in (None, True):
        x = logits.clone().requires_grad_()
        r = _identity_router(RouterConfig(num_experts=4, top_k=1, normalize_topk=normalize,
                                          aux_loss_coeff=0.0))(x)
        picked = x.detach().softmax(-1).gather(1, r.expert_ids)
        assert torch.equal(r.weights.detach(), picked if normalize is None else torch.ones_like(picked))
        (r.weights * torch.arange(1.0, 7.0).unsqueeze(1)).sum().backward()  # a loss of the weights
        grads[normalize] = x.grad.norm().item()
    assert grads[None] > 0.1 and grads[True] < 1e-5 * grads[None], grads


def test_load_balancing_loss_against_a_hand_computation():
    """Dyadic scores, so every step is exact: ``alpha E sum_i f_i P_i`` bit for bit."""
    scores = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.5, 0.125, 0.125],
                           [0.125, 0.125, 0.5, 0.25], [0.5, 0.125, 0.25, 0.125]], requires_grad=True)
    ids = torch.topk(scores.detach(), 2).indices
    assert sorted(map(sorted, ids.tolist())) == [[0, 1], [0, 1], [0, 2], [2, 3]]
    f = [3 / 8, 2 / 8, 2 / 8, 1 / 8]                       # of the T k = 8 assignments
    p = [1.375 / 4, 1.0 / 4, 1.0 / 4, 0.625 / 4]           # column means of the scores
    alpha = 0.5
    hand = alpha * 4 * sum(fi * pi for fi, pi in zip(f, p, strict=True))
    assert hand == 0.546875
    loss = load_balancing_loss(scores, ids, alpha, "softmax")
    assert float(loss.detach()) == hand
    loss.backward()  # the gradient flows through P only: d/ds_ti = alpha E f_i / T
    assert torch.equal(scores.grad, torch.tensor(f).expand(4, 4) * alpha * 4 / 4)
    # sigmoid scores are normalised per token first: scores twice as large give the same loss
    assert float(load_balancing_loss(2 * scores.detach(), ids, alpha, "sigmoid")) == hand
    # the router's own loss is this function of its scores and choices
    cfg = RouterConfig(num_experts=4, top_k=2, aux_loss_coeff=alpha)
    r = _identity_router(cfg)(_randn((6, 4), 5))
    assert torch.equal(r.balance_loss, load_balancing_loss(r.scores, r.expert_ids, alpha, "softmax"))


def test_router_z_loss():
    """One expert: ``logsumexp`` is the logit itself, so ``beta mean z^2`` and its gradient are exact."""
    logits = torch.tensor([[2.0], [-3.0], [1.0], [0.0]], requires_grad=True)
    z = router_z_loss(logits, 0.5)
    assert float(z.detach()) == 0.5 * (4 + 9 + 1 + 0) / 4
    z.backward()
    assert logits.grad.flatten().tolist() == [0.5, -0.75, 0.25, 0.0]  # beta 2 z / T
    cfg = RouterConfig(num_experts=4, top_k=1, z_loss_coeff=0.5, aux_loss_coeff=0.0)
    x = _randn((5, 4), 6)
    r = _identity_router(cfg)(x)
    assert torch.equal(r.z_loss, router_z_loss(x, 0.5)) and torch.equal(r.aux_loss, r.z_loss)


def test_expert_bias_changes_the_choice_not_the_combine_weights():
    cfg = RouterConfig(num_experts=4, top_k=2, score_func="sigmoid", expert_bias=True)
    router = _identity_router(cfg)
    x = _randn((8, 4), 7)
    before = router(x)
    assert not (before.expert_ids == 3).any(dim=1).all()    # expert 3 is not everyone's choice yet
    with torch.no_grad():
        router.expert_bias[3] = 2.0                          # scores are in (0, 1): 3 is always chosen
    pushed = router(x)
    assert (pushed.expert_ids == 3).any(dim=1).all()
    picked = pushed.scores.gather(1, pushed.expert_ids)
    assert torch.equal(pushed.weights, picked / picked.sum(-1, keepdim=True))  # the bias is not in them
    assert torch.equal(pushed.scores, before.scores)
    with torch.no_grad():
        router.expert_bias[3] = 5.0                          # the same choice, the same weights
    again = router(x)
    assert torch.equal(again.expert_ids, pushed.expert_ids) and torch.equal(again.weights, pushed.weights)
    # DeepSeek-V3's update: b_i += u sign(mean(load) - load_i)
    with torch.no_grad():
        router.expert_bias.zero_()
    bias = router.update_expert_bias(torch.tensor([10, 2, 4, 0]), 0.5)  # mean 4
    assert bias.tolist() == [-0.5, 0.5, 0.0, 0.5]
    with pytest.raises(RuntimeError, match="no expert bias"):
        _identity_router(RouterConfig(num_experts=4, top_k=1)).update_expert_bias(torch.ones(4), 0.1)


def test_capacity_drops_the_lowest_scores():
    assert expert_capacity(10, 2, 4, 1.0) == 5
    assert expert_capacity(12, 2, 8, 1.25) == 4              # ceil(3.75)
    assert expert_capacity(3, 1, 4, 1.0) == 1 and expert_capacity(3, 1, 4, None) is None
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3], [2, 0]])
    scores = torch.zeros(5, 4)
    scores[:, 0] = torch.tensor([0.3, 0.5, 0.5, 0.1, 0.2])
    scores[:, 1:] = 0.25
    keep = capacity_keep(ids, scores, 1)
    # expert 0 keeps token 1 (0.5, ties with token 2: the earlier wins); expert 1 keeps token 0, 2 keeps
    # token 1, 3 keeps token 3
    assert keep.tolist() == [[False, True], [True, True], [False, False], [False, True], [False, False]]
    keep3 = capacity_keep(ids, scores, 3)                    # expert 0: scores 0.3 0.5 0.5 0.1 0.2
    assert [bool(keep3[t][ids[t] == 0]) for t in range(5)] == [True, True, True, False, False]
    # through the layer: T = 4, k = 1, E = 4, cf = 1: C = 1; all choose expert 0, the best one stays
    gate = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(4))
    experts = [ExpertMLP(4, 8) for _ in range(4)]
    moe = MoE.from_modules(gate, experts, top_k=1, capacity_factor=1.0)
    x = torch.tensor([[1.0, 0, 0, 0], [3.0, 0, 0, 0], [2.0, 0, 0, 0], [0.5, 0, 0, 0]])
    y = moe(x)
    assert moe.dropped_fraction == 3 / 4 and moe.kept_per_expert.tolist() == [1, 0, 0, 0]
    assert moe.tokens_per_expert.tolist() == [4, 0, 0, 0]
    assert torch.equal(y[[0, 2, 3]], torch.zeros(3, 4))     # dropped: zero (the residual carries them)
    weight = torch.softmax(x[1], -1)[0]                     # k = 1: the raw score (Switch), not 1
    assert torch.equal(y[1], weight * experts[0](x[1:2])[0])  # kept


def _loop_spread(fn, x: torch.Tensor, counts: list[int], gy: torch.Tensor) -> tuple[dict, dict]:
    """``fn`` (an experts module's forward) in float32 and float64: its outputs and gradients, and their
    distance (the rounding of float32)."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        module, call = fn(dtype)
        xi = x.to(dtype).clone().requires_grad_()
        y = call(xi, counts)
        y.backward(gy.to(dtype))
        out[dtype] = {"y": y.detach(), "dx": xi.grad, **{n: p.grad for n, p in module.named_parameters()}}
    spread = {n: _diff(t.float(), out[torch.float32][n]) for n, t in out[torch.float64].items()}
    return out[torch.float32], spread


@pytest.mark.numerics
def test_grouped_experts_equal_the_per_expert_loop():
    """One ``_grouped_mm`` per projection against the per-expert loop on the same weights (an expert with
    zero tokens included), within FACTOR x the loop's own distance from float64; and against
    ``LoopedExperts`` over ``ExpertMLP`` s with the same weights."""
    counts = [3, 0, 5, 4]
    x, gy = _randn((12, H), 8), _randn((12, H), 9)
    for activation in ("swiglu", "gelu"):
        def grouped(dtype, method, activation=activation):
            m = GroupedExperts(dim=H, hidden=FFN, num_experts=4, activation=activation,
                               generator=torch.Generator().manual_seed(0)).to(dtype)
            return m, getattr(m, method)

        assert grouped(torch.float32, "forward")[0].uses_grouped_mm(x)
        loop, spread = _loop_spread(lambda d: grouped(d, "forward_loop"), x, counts, gy)
        fast, _ = _loop_spread(lambda d: grouped(d, "forward"), x, counts, gy)
        for n, t in fast.items():
            assert _diff(t, loop[n]) <= FACTOR * spread[n], (activation, n, _diff(t, loop[n]), spread[n])
        for n in ("w1", "w3", "w2"):
            if n in fast:
                assert torch.equal(fast[n][1], torch.zeros_like(fast[n][1])), n  # zero tokens, zero grad
        mods = [ExpertMLP(H, FFN, activation) for _ in range(4)]
        with torch.no_grad():
            m = grouped(torch.float32, "forward")[0]
            for e, mod in enumerate(mods):
                for n, p in mod.named_parameters():
                    p.copy_(getattr(m, n.split(".")[0])[e].t())
        stacked = GroupedExperts.from_modules(mods)
        assert all(torch.equal(getattr(stacked, n), getattr(m, n)) for n in ("w1", "w2"))
        y_mods = LoopedExperts(mods)(x, counts)
        assert _diff(y_mods, loop["y"]) <= FACTOR * spread["y"], activation
    # a stride-0 incoming gradient (sum's) goes through: GroupedExperts makes it contiguous
    m, _ = grouped(torch.float32, "forward")
    m(x, counts).sum().backward()
    assert m.w1.grad is not None


@pytest.mark.numerics
def test_grouped_mm_offsets_are_cumulative_ends_and_an_empty_group_works():
    """``torch._grouped_mm(x, w, offs)``: rows ``[offs[i-1], offs[i])`` times ``w[i]``; a group of zero rows
    (``offs[1] == offs[0]``) gets a zero gradient."""
    x, w = _randn((9, H), 11).requires_grad_(), _randn((3, H, FFN), 12).requires_grad_()
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)
    y = torch._grouped_mm(x, w, offs=offs)
    y.backward(_randn(y.shape, 13))
    for i, (s, e) in enumerate(((0, 4), (4, 4), (4, 9))):
        block = x.detach()[s:e] @ w.detach()[i]
        exact = x.detach()[s:e].double() @ w.detach()[i].double()
        assert _diff(y.detach()[s:e], block) <= FACTOR * _diff(block.double(), exact), i
    assert torch.equal(w.grad[1], torch.zeros(H, FFN))


class _GroupedMMOperands(TorchDispatchMode):
    """Records the operand and offset dtypes of every ``aten._grouped_mm``, forward and backward (a
    monkeypatched ``torch._grouped_mm`` would miss the backward's calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten._grouped_mm:
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            self.calls.append((args[0].dtype, args[1].dtype, offs.dtype))
        return func(*args, **kwargs)


def _experts_run(module: nn.Module, call, x: torch.Tensor, counts: list[int], gy: torch.Tensor,
                 autocast: bool) -> dict[str, torch.Tensor]:
    """``call(x, counts)`` (under bf16 autocast when asked) and its backward: output and gradients."""
    xi = x.to(next(module.parameters()).dtype).clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = call(xi, counts)
    y.backward(gy.to(y.dtype))
    return {"y": y.detach(), "dx": xi.grad, **{n: p.grad for n, p in module.named_parameters()}}


@pytest.mark.numerics
def test_grouped_experts_compute_in_bf16_under_autocast():
    """Autocast does not cast ``torch._grouped_mm``: ``GroupedExperts`` casts the rows and the weights
    to autocast's dtype itself (torchtitan's ``_run_experts_grouped_mm``). Under bf16 autocast every
    ``_grouped_mm`` call, forward and backward, gets bf16 operands and int32 offsets, the output is bf16,
    and outputs and gradients equal autocast's per-expert loop (its ``@`` is cast) within FACTOR x that
    loop's distance from the float64 loop; a zero-token expert gets a zero gradient, a stride-0 gradient
    goes through. Negative control: outside autocast the same call records fp32 operands (what every bf16
    run computed in before). Measured (default and avx2 kernels): the outputs and weight gradients
    bit for bit the loop's, SwiGLU's input gradient 0.4 x the loop's distance from float64."""
    counts = [3, 0, 5, 4]
    x, gy = _randn((12, H), 8), _randn((12, H), 9)
    for activation in ("swiglu", "gelu"):
        def build(dtype, activation=activation):
            return GroupedExperts(dim=H, hidden=FFN, num_experts=4, activation=activation,
                                  generator=torch.Generator().manual_seed(0)).to(dtype)

        m64 = build(torch.float64)
        exact = _experts_run(m64, m64.forward_loop, x, counts, gy, autocast=False)
        loop_m, fast_m = build(torch.float32), build(torch.float32)
        loop = _experts_run(loop_m, loop_m.forward_loop, x, counts, gy, autocast=True)
        with _GroupedMMOperands() as seen:
            fast = _experts_run(fast_m, fast_m, x, counts, gy, autocast=True)
        calls = 3 if activation == "swiglu" else 2
        assert len(seen.calls) == 3 * calls, seen.calls  # each forward GEMM and its two backward GEMMs
        assert set(seen.calls) == {(torch.bfloat16, torch.bfloat16, torch.int32)}, seen.calls
        assert fast["y"].dtype == loop["y"].dtype == torch.bfloat16
        for n, t in fast.items():
            assert t.dtype == loop[n].dtype, n
            spread = _diff(loop[n].double(), exact[n])
            assert _diff(t, loop[n]) <= FACTOR * spread, (activation, n, _diff(t, loop[n]), spread)
        for n in ("w1", "w3", "w2"):
            if n in fast:
                assert torch.equal(fast[n][1], torch.zeros_like(fast[n][1])), n  # zero tokens, zero grad
        with _GroupedMMOperands() as plain:  # negative control: no autocast, the fp32 weights' dtype
            _experts_run(fast_m, fast_m, x, counts, gy, autocast=False)
        assert set(plain.calls) == {(torch.float32, torch.float32, torch.int32)}, plain.calls
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a stride-0 incoming gradient (sum's) goes through
        fast_m(x, counts).sum().backward()


def test_grouped_mm_runs_only_where_cuda_would_not_fall_back(monkeypatch):
    """On CPU ``_grouped_mm`` runs in every dtype it takes; on CUDA only bf16 on sm90 / sm100 (its fused
    kernel): elsewhere its fallback reads ``offs`` on the host per call, and the layer runs its loop."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert all(grouped_mm_runs_fused(cpu, d) for d in (torch.float32, torch.bfloat16, torch.float16))
    monkeypatch.setattr(torch.version, "hip", None)
    for major, fused in ((8, False), (9, True), (10, True), (12, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, m=major: (m, 0))
        assert grouped_mm_runs_fused(cuda, torch.bfloat16) == fused, major
        assert not grouped_mm_runs_fused(cuda, torch.float32), major


def test_the_host_sync_counter_sees_each_kind_of_sync():
    """Negative control of the budget: each kind of sync the counter knows, planted once, is counted once;
    the sync-free forms (``output_size``, a ``scatter_add_`` count) are not."""
    t, ids = torch.arange(6), torch.tensor([0, 2, 2, 1])
    with HostSyncCounter() as c:
        t.tolist(), t.cpu(), int(t.sum()), bool(t[1]), float(t[2])
        torch.bincount(ids), t[t > 2], torch.nonzero(t), torch.repeat_interleave(ids, ids)
        torch.tensor([1, 2])
    kinds = [e.what for e in c.events]
    assert kinds == ["tolist", "cpu", "item", "item", "item", "bincount", "bool index", "nonzero",
                     "repeat_interleave", "host tensor"], kinds
    with HostSyncCounter() as quiet:
        torch.repeat_interleave(ids, ids, output_size=5)
        torch.zeros(3, dtype=torch.int64).scatter_add_(0, ids, torch.ones_like(ids))
    assert quiet.count == 0, quiet.events


def test_one_process_layer_reads_the_host_once_per_forward():
    """ep 1 (no group), both dispatchers, every case: one ``tolist`` of the counts in forward, none in
    backward (module docstring; 11 before)."""
    x, _ = _data(1)
    for case in CASES:
        for disp in DISPATCH:
            forward, backward = _host_syncs(case, None, x[0], disp)
            where = (case, disp, forward, backward)
            assert len(forward) == 1 and forward[0].startswith("tolist @ ") and not backward, where


def test_dispatch_permutations_round_trip_exactly():
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(0, 6, (20, 2), generator=g)
    ids[[3, 7, 11], 1] = -1                                   # dropped assignments
    ids[5] = -1
    x = _randn((20, H), 15)
    plan = sort_by_expert(ids, 6)
    assert plan.counts.tolist() == torch.bincount(ids[ids >= 0], minlength=6).tolist()
    sorted_ids = ids.flatten()[plan.order]
    assert torch.equal(sorted_ids, sorted_ids.sort().values)  # sorted by expert ...
    for e in range(6):                                        # ... and by token within an expert (stable)
        tokens = plan.token_index[sorted_ids == e]
        assert torch.equal(tokens, tokens.sort().values)
    back = unpermute(permute(x, plan), plan)                  # [T, k, h]
    keep = (ids >= 0).unsqueeze(-1)
    assert torch.equal(back, torch.where(keep, x.unsqueeze(1).expand(20, 2, H), torch.zeros(())))
    w = torch.where(ids >= 0, torch.full(ids.shape, 0.5), torch.zeros(()))
    assert torch.equal(combine(permute(x, plan), w, plan), 0.5 * (ids >= 0).sum(1, keepdim=True) * x)
    recv = torch.tensor([[2, 0, 3], [1, 4, 0], [0, 0, 2]])   # rows from rank q for local expert j
    idx = expert_major_order(recv)
    rank_major = [(q, j) for q in range(3) for j in range(3) for _ in range(int(recv[q, j]))]
    assert [rank_major[i] for i in idx.tolist()] == sorted(rank_major, key=lambda qj: (qj[1], qj[0]))
    y = _randn((int(recv.sum()), H), 16)
    assert torch.equal(y[idx][inverse_permutation(idx)], y)
    assert rank_splits(torch.tensor([1, 2, 0, 4, 3, 0]), 3) == [3, 4, 3]


def test_one_process_layer_shapes_and_dispatchers():
    moe = MoE(dim=H, hidden=FFN, num_experts=4, top_k=2, seed=1)
    x = _randn((B, S, H), 17)
    y = moe(x)
    assert y.shape == x.shape and torch.equal(moe(x.reshape(T, H)), y.reshape(T, H))
    assert moe.tokens_per_expert.sum() == T * K and moe.aux_loss.requires_grad
    moe.dispatcher = "allgather"
    assert torch.equal(moe(x), y)
    assert [n for n, _ in moe.named_parameters()] == ["router.gate.weight", "experts.w1", "experts.w3",
                                                      "experts.w2"]


def test_bad_input_is_a_one_line_error():
    lin = nn.Linear(H, 4)
    experts = [nn.Identity()] * 4
    errors = {
        "top_k must be in": lambda: MoE.from_modules(lin, experts, top_k=5),
        "unknown score_func": lambda: MoE.from_modules(lin, experts, top_k=1, score_func="relu"),
        "capacity_factor must be > 0": lambda: MoE.from_modules(lin, experts, top_k=1, capacity_factor=0.0),
        "unknown dispatcher": lambda: MoE.from_modules(lin, experts, top_k=1, dispatcher="ring"),
        "unknown activation": lambda: MoE(dim=H, hidden=FFN, num_experts=4, top_k=1, activation="relu"),
        "maps h -> 4 but there are 3": lambda: MoE.from_modules(lin, experts[:3], top_k=1),
        "MoE expects": lambda: MoE.from_modules(lin, experts, top_k=1)(torch.zeros(3, H + 1)),
    }
    for match, fn in errors.items():
        with pytest.raises(ValueError, match=match) as info:
            fn()
        assert "\n" not in str(info.value), str(info.value)
