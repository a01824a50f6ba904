"""Chapter 02: the ring collectives against torch.distributed, the tracer's byte counts, the cost model.

Multi-rank checks are batched: one spawn per world size (2, 3, 4) runs every rank function of this module
(tests/support/folded.py), and a rank that fails raises with its traceback. Integer-valued data make every
comparison with ``torch.distributed`` exact (no ``numerics`` marker needed); the float case, marked
``numerics``, is bounded by the rounding error of a sum in any order, ``gamma_(n-1) sum |x_i|`` with
``gamma_k = k u / (1 - k u)``, scaled by the magnitudes measured in the same run.

The tracer's byte counts of our rings are *measured* (the tensors handed to ``isend``) and compared with
the formulas ``2(n-1)/n S`` and ``(n-1)/n S``; the bytes it books for a ``torch.distributed`` collective
are the ring *model*, flagged ``measured=False`` (docs/ARCHITECTURE.md, chapter 02).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.comm.ring import (
    _ring_reduce_scatter_,
    chunk_sizes,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from refimpl.comm.tracer import CommTracer, wire_bytes
from refimpl.measure import Timings, measure_collective, measure_p2p
from refimpl.planner import AlphaBeta, fit_alpha_beta, ring_bytes_sent
from tests.support.folded import run_folded

LENGTHS = (1, 5, 64, 1001)
FOLD_TIMEOUT = 360 + 30  # a test that starts a world's spawn: its functions' bounds added (4 ranks: 360 s)


# ------------------------------------------------------------------------------------------ no ranks
@pytest.mark.parametrize("numel", [0, 1, 3, 5, 64, 1001])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_chunk_sizes_are_tensor_split(numel, n):
    assert chunk_sizes(numel, n) == [c.numel() for c in torch.tensor_split(torch.empty(numel), n)]


def test_ring_bytes_sent_formula():
    for n in (2, 3, 4, 8):
        s = 64 * n  # divisible: the textbook formula, on every rank
        for r in range(n):
            assert ring_bytes_sent(s, n, r, 4) == 2 * (n - 1) / n * s * 4
            assert ring_bytes_sent(s, n, r, 4, op="reduce_scatter") == (n - 1) / n * s * 4
            assert ring_bytes_sent(s, n, r, 4, op="all_gather") == (n - 1) / n * s * 4
    # uneven: 1001 on 4 ranks has chunks [251, 250, 250, 250]; rank r sends all but c_r, then all but c_r+1
    assert [ring_bytes_sent(1001, 4, r, 1) for r in range(4)] == [750 + 751, 751 + 751, 751 + 751, 751 + 750]
    assert ring_bytes_sent(5, 1, 0, 4) == 0
    with pytest.raises(ValueError):
        ring_bytes_sent(5, 2, 0, 4, op="broadcast")


def test_world_of_one_needs_no_process_group():
    assert not dist.is_initialized()
    x = torch.arange(5.0)
    with CommTracer() as tracer:
        assert ring_all_reduce(x) is x and torch.equal(x, torch.arange(5.0))
        assert torch.equal(ring_reduce_scatter(x), x)
        assert torch.equal(ring_all_gather(x, 5), x)
        assert naive_all_reduce(x) is x
    assert tracer.events == []
    with pytest.raises(ValueError, match="expected 5"):
        ring_all_gather(torch.arange(4.0), 5)


def test_fit_recovers_a_known_alpha_beta_exactly():
    alpha, beta = 7.5e-6, 12.5e9
    sizes = [4, 64, 1024, 2**14, 2**18, 2**22]
    fit = fit_alpha_beta(sizes, [alpha + s / beta for s in sizes])
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_bytes_per_s == pytest.approx(beta, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.half_bandwidth_bytes == pytest.approx(alpha * beta)
    assert fit.ring_all_reduce(1000, 4) == pytest.approx(6 * alpha + 1.5 * 1000 / beta)
    # relative least squares: a 10% error on the smallest message moves alpha, not beta much
    noisy = fit_alpha_beta(sizes, [(alpha + s / beta) * (1.1 if s == 4 else 1.0) for s in sizes])
    assert noisy.alpha_s > alpha and noisy.r2 < 1.0
    with pytest.raises(ValueError):
        fit_alpha_beta([8, 8], [1.0, 2.0])
    with pytest.raises(ValueError):
        fit_alpha_beta([8, 16], [1.0, 0.0])


def test_plots_render(tmp_path):
    from refimpl.comm.pictures import plot_timeline, plot_who_holds_what
    from refimpl.comm.tracer import CommEvent
    from refimpl.viz import plot_alpha_beta

    a, b = torch.tensor([10.0, 11.0]), torch.tensor([20.0, 21.0])
    fig = plot_who_holds_what({"all-reduce": ([a, b], [a + b, a + b]), "send": ([a, None], [a, a])},
                              path=tmp_path / "who.png")
    assert len(fig.axes) == 4 and (tmp_path / "who.png").stat().st_size > 0
    ev = CommEvent(op="isend", nbytes=8, wire_bytes=8.0, group_size=2, peer=1, start=1.0, end=1.002, step=0,
                   async_op=True)
    assert plot_timeline([[ev], []], path=tmp_path / "tl.png").axes
    t = Timings(op="p2p", world_size=2, sizes_bytes=(4, 4096), seconds=(1e-5, 2e-5), repeats=1)
    fit = fit_alpha_beta(t.sizes_bytes, t.seconds)
    fig = plot_alpha_beta([t], fits=[fit], models={"model": lambda s: 1e-5 + s / 1e9},
                          path=tmp_path / "ab.png")
    assert isinstance(fit, AlphaBeta) and fig.axes


# ------------------------------------------------------------------------------------------ on ranks
def _skip_all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Negative control: the ring's reduce-scatter without its all-gather phase."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    _ring_reduce_scatter_(list(torch.tensor_split(tensor.view(-1), n)), r, n, group)
    return tensor


def _ints(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randint(-1000, 1000, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _check_against_torch(rank: int, n: int, group=None) -> None:
    """Every ring op equals torch.distributed, bit for bit, on integer data of every length."""
    for dtype in (torch.float32, torch.int64):
        for s in LENGTHS:
            x = _ints((s,), 31 * rank + s, dtype)
            want = x.clone()
            dist.all_reduce(want, group=group)
            got = x.clone()
            assert ring_all_reduce(got, group=group) is got
            assert torch.equal(got, want), (dtype, s)
            assert torch.equal(naive_all_reduce(x.clone(), group=group), want), (dtype, s)
            shard = ring_reduce_scatter(x, group=group)
            assert torch.equal(shard, torch.tensor_split(want, n)[rank]), (dtype, s)
            assert torch.equal(ring_all_gather(shard, s, group=group), want), (dtype, s)
            if s % n == 0:
                theirs = torch.empty(s // n, dtype=dtype)
                ops.reduce_scatter_tensor(theirs, x, group=group)
                assert torch.equal(shard, theirs)
    # 2-D and non-contiguous tensors are reduced in place
    m = _ints((3, 7), rank).t()  # (7, 3), not contiguous
    want = m.contiguous()
    dist.all_reduce(want, group=group)
    assert ring_all_reduce(m, group=group) is m and torch.equal(m, want)


def _check_tracer(rank: int, n: int) -> dict:
    """The tracer sees 2(n-1) isends per rank and exactly the ring's bytes; async ends stamped on wait."""
    s_even, s_odd = 256 * n, 1001
    with CommTracer() as tracer:
        ring_all_reduce(torch.ones(s_even))
        tracer.step()
        ring_all_reduce(torch.ones(s_odd))
        tracer.step()
        naive_all_reduce(torch.ones(s_even))
    steps = tracer.per_step()
    assert len(steps) == 3
    for step, s in ((0, s_even), (1, s_odd)):
        assert steps[step]["isend"].count == 2 * (n - 1) and steps[step]["irecv"].count == 2 * (n - 1)
        assert set(steps[step]) == {"isend", "irecv"}
        assert tracer.bytes_sent(step=step) == ring_bytes_sent(s, n, rank, 4)
        assert steps[step]["isend"].nbytes == ring_bytes_sent(s, n, rank, 4)
    assert tracer.bytes_sent(step=0) == 2 * (n - 1) / n * s_even * 4  # the formula, exactly
    sends = tracer.select(op="isend")
    ring_events = tracer.select(step=0) + tracer.select(step=1)
    assert all(e.async_op and e.end is not None and e.end >= e.start for e in ring_events)
    assert {e.op for e in tracer.select(step=2)} == {"send", "recv"}
    assert all(e.peer == (rank + 1) % n for e in sends)
    assert all(e.peer == (rank - 1) % n for e in tracer.select(op="irecv"))
    naive = tracer.bytes_sent(step=2)
    even_bytes = tracer.bytes_sent(step=0)
    assert naive == ((n - 1) if rank == 0 else 1) * s_even * 4  # rank 0 sends (n-1) S: grows with n

    # an async event has no end until its handle is waited
    with CommTracer() as tracer:
        buf = torch.zeros(3)
        if rank == 0:
            work = ops.isend(torch.ones(3), dst=1)
        elif rank == 1:
            work = ops.irecv(buf, src=0)
        if rank in (0, 1):
            assert tracer.events[-1].end is None
            work.wait()
            assert tracer.events[-1].end is not None
    if rank == 1:
        assert torch.equal(buf, torch.ones(3))
    return {"ring_bytes": even_bytes}


def _check_negative_control(rank: int, n: int) -> None:
    x = _ints((64,), rank)
    want = x.clone()
    dist.all_reduce(want)
    _skip_all_gather(x)
    mine = torch.tensor_split(x, n)[rank]
    assert torch.equal(mine, torch.tensor_split(want, n)[rank])  # its own chunk is right ...
    assert not torch.equal(x, want)  # ... and the rest is not: the equality check can fail


def _check_subgroup(rank: int, members: list[int]) -> bool:
    """The ring inside a sub-group: group ranks differ from global ranks, p2p peers are global ranks."""
    group = dist.new_group(members)  # every rank must call new_group, members or not
    if rank not in members:
        return False
    k = len(members)
    _check_against_torch(dist.get_rank(group), k, group=group)
    with CommTracer() as tracer:
        ring_all_reduce(torch.ones(30), group=group)
    right = members[(members.index(rank) + 1) % k]
    assert {e.peer for e in tracer.select(op="isend")} == {right}
    assert tracer.bytes_sent() == 2 * (k - 1) / k * 30 * 4
    return True


def _ranks_worker(ctx) -> dict:
    torch.manual_seed(0)
    rank, n = ctx.rank, ctx.world_size
    _check_against_torch(rank, n)
    out = _check_tracer(rank, n)
    _check_negative_control(rank, n)
    if n == 4:  # rings of 3 and of 2 ranks, inside the same run (each spawn costs seconds)
        out["subgroups"] = (_check_subgroup(rank, [1, 2, 3]), _check_subgroup(rank, [0, 2]))
    # the measurement plumbing (no timing is asserted: docs/ARCHITECTURE.md, timings live in benchmarks)
    t = measure_collective(ring_all_reduce, (4, 4096), repeats=1, warmup=1)
    p = measure_p2p((4, 4096), repeats=1, warmup=0)
    out["timings"] = (t, p)
    return out


@pytest.mark.timeout(FOLD_TIMEOUT)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_on_ranks(world_size, on_ranks):
    """World sizes 2 and 4, plus sub-groups of 3 and 2 ranks in the 4-rank run (1 rank: no ranks needed)."""
    results = on_ranks(world_size)["ring"]
    if world_size == 4:
        membership = [(False, True), (True, False), (True, True), (True, False)]  # [1, 2, 3] and [0, 2]
        assert [r["subgroups"] for r in results] == membership
    timings = [r["timings"] for r in results]
    assert all(t == timings[0] for t in timings), "every rank reports the same measurement"
    ring_t, p2p_t = timings[0]
    assert ring_t.world_size == world_size and p2p_t.world_size == 2
    assert all(s > 0 for s in ring_t.seconds + p2p_t.seconds)
    total = sum(r["ring_bytes"] for r in results)  # all ranks together: 2(n-1) S
    assert math.isclose(total, 2 * (world_size - 1) * 256 * world_size * 4)


# ------------------------------------------------------------------ measured bytes against the formula
BYTE_LENGTHS = (1, 2, 3, 5, 6, 64, 1001, 4099)  # n divides some; others uneven, some shorter than n
PHASES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # formula: PHASES[op] (n - 1)/n S


def _call_ring(op: str, x: torch.Tensor, rank: int, n: int) -> None:
    if op == "all_reduce":
        ring_all_reduce(x.clone())
    elif op == "reduce_scatter":
        ring_reduce_scatter(x)
    else:
        ring_all_gather(torch.tensor_split(x, n)[rank], x.numel())


def _measure_ring_bytes(ctx) -> dict:
    """Per (op, numel, dtype): the bytes this rank handed to isend, measured by the tracer from tensors."""
    out = {}
    for dtype in (torch.float32, torch.int64, torch.bfloat16):  # element sizes 4, 8, 2
        for numel in BYTE_LENGTHS:
            for op in PHASES:
                with CommTracer() as tracer:
                    _call_ring(op, torch.ones(numel, dtype=dtype), ctx.rank, ctx.world_size)
                assert set(tracer.summary()) == {"isend", "irecv"}
                assert all(e.measured for e in tracer.events)
                assert tracer.modelled_bytes_sent() == 0
                assert tracer.bytes_sent() == tracer.measured_bytes_sent()  # nothing modelled is mixed in
                out[op, numel, dtype] = tracer.measured_bytes_sent()
    with CommTracer() as tracer:  # the negative control: the all-reduce through rank 0
        naive_all_reduce(torch.ones(64))
    out["naive", 64, torch.float32] = tracer.measured_bytes_sent()
    return out


def _ring_formula_holds(sent: list[int], f: int, n: int, nbytes: int, element_size: int) -> bool:
    """The measured bytes per rank against ``f (n-1)/n S``, in integers (times n): exact in total, and
    within one element per phase on each rank (exact on each rank when n divides the length)."""
    target = f * (n - 1) * nbytes           # n times the formula
    per_rank_ok = all(abs(n * b - target) < n * f * element_size for b in sent)
    if nbytes // element_size % n == 0:
        per_rank_ok = per_rank_ok and all(n * b == target for b in sent)
    return sum(sent) == target and per_rank_ok


@pytest.mark.timeout(FOLD_TIMEOUT)
@pytest.mark.parametrize("world_size", [3, 4])
def test_tracer_measured_ring_bytes_equal_formula(world_size, on_ranks):
    """Measured (the tensors our rings hand to isend) against the formula, for even and uneven lengths."""
    n = world_size
    per_rank = on_ranks(n)["bytes"]
    for key in per_rank[0]:
        op, numel, dtype = key
        if op == "naive":
            continue
        elt = torch.empty(0, dtype=dtype).element_size()
        sent = [r[key] for r in per_rank]
        assert sent == [ring_bytes_sent(numel, n, r, elt, op=op) for r in range(n)], key  # uneven: exact
        assert _ring_formula_holds(sent, PHASES[op], n, numel * elt, elt), (key, sent)
    naive = [r["naive", 64, torch.float32] for r in per_rank]
    assert naive == [(n - 1) * 256] + [256] * (n - 1)
    assert not _ring_formula_holds(naive, 2, n, 256, 4), "the check must fail for the naive all-reduce"


def _trace_dist_collectives(ctx) -> dict:
    n = ctx.world_size
    x = torch.ones(12 * n)
    with CommTracer() as tracer:
        ops.all_reduce(x.clone())
        ops.reduce_scatter_tensor(torch.empty(12), x)
        ops.all_gather_into_tensor(torch.empty(12 * n), torch.ones(12))
        ops.broadcast(x.clone(), src=0)
        if ctx.rank == 0:
            ops.send(x, dst=1)
        elif ctx.rank == 1:
            ops.recv(x, src=0)
    return {"events": [(e.op, e.nbytes, e.wire_bytes, e.measured) for e in tracer.events],
            "measured": tracer.measured_bytes_sent(), "modelled": tracer.modelled_bytes_sent(),
            "total": tracer.bytes_sent(), "summary": tracer.summary()}


@pytest.mark.timeout(FOLD_TIMEOUT)
def test_tracer_flags_collective_wire_bytes_as_a_model(on_ranks):
    """dist.* collectives: payload measured, wire bytes the ring model and flagged so; p2p measured."""
    n = 3
    results = on_ranks(n)["trace"]
    s = 12 * n * 4
    for rank, r in enumerate(results):
        collectives = r["events"][:4]
        assert [(op, nbytes) for op, nbytes, _, _ in collectives] == [
            ("all_reduce", s), ("reduce_scatter", s), ("all_gather", s), ("broadcast", s)]  # payloads
        assert all(not measured for *_, measured in collectives)
        assert [w for _, _, w, _ in collectives] == [wire_bytes(op, s, n) for op, *_ in collectives]
        assert r["modelled"] == sum(w for _, _, w, _ in collectives)
        p2p = r["events"][4:]
        assert all(measured for *_, measured in p2p)
        assert r["measured"] == (s if rank == 0 else 0)          # rank 0 sent x, rank 1 received it
        assert r["total"] == r["measured"] + r["modelled"]
        assert not r["summary"]["all_reduce"].measured
        if rank == 1:
            assert r["summary"]["recv"].measured and r["summary"]["recv"].wire_bytes == 0


def _float_bound_worker(ctx) -> dict:
    """Ring and dist.all_reduce on random floats, each against the exact (float64) sum."""
    n = ctx.world_size
    x = torch.randn(1001, generator=torch.Generator().manual_seed(ctx.rank))
    ours, theirs, exact, magnitude = x.clone(), x.clone(), x.double(), x.double().abs()
    ring_all_reduce(ours)
    for t in (theirs, exact, magnitude):
        dist.all_reduce(t)
    u = torch.finfo(torch.float32).eps / 2
    bound = (n - 1) * u / (1 - (n - 1) * u) * magnitude  # gamma_(n-1) sum |x_i| (Higham, ch. 4)
    return {"ring": ((ours.double() - exact).abs() / bound).max().item(),
            "dist": ((theirs.double() - exact).abs() / bound).max().item(),
            "differ": int((ours != theirs).sum())}


@pytest.mark.numerics
@pytest.mark.timeout(FOLD_TIMEOUT)
@pytest.mark.parametrize("world_size", [3, 4])
def test_ring_float_sum_within_rounding_bound(world_size, on_ranks):
    """On floats the ring and dist.all_reduce add in other orders; both stay within the rounding bound of a
    sum of n terms in any order, scaled by the magnitudes of this run's data."""
    for r in on_ranks(world_size)["float"]:
        assert r["ring"] <= 1.0 and r["dist"] <= 1.0, r


# ------------------------------------------------------------------------------ one spawn per world size
# name -> (rank function, the world sizes that run it, its bound in s as a spawn of its own)
RANK_FUNCTIONS = {"ring": (_ranks_worker, (2, 4), 200), "bytes": (_measure_ring_bytes, (3, 4), 100),
                  "trace": (_trace_dist_collectives, (3,), 60), "float": (_float_bound_worker, (3, 4), 60)}


@pytest.fixture(scope="module")
def on_ranks():
    """``on_ranks(n)``: ``{name: per-rank results}`` of every rank function that runs on ``n`` ranks, from
    one spawn (tests/support/folded.py) started the first time a test asks for ``n``, bounded by the
    functions' bounds added; each collective within half the largest, as that function's own spawn had."""
    done: dict[int, dict] = {}

    def get(n: int) -> dict:
        if n not in done:
            mine = {name: (fn, bound) for name, (fn, worlds, bound) in RANK_FUNCTIONS.items() if n in worlds}
            done[n] = run_folded(n, {name: (fn, ()) for name, (fn, _) in mine.items()},
                                 timeout_s=sum(b for _, b in mine.values()),
                                 collective_timeout_s=max(b for _, b in mine.values()) / 2)
        return done[n]

    return get
