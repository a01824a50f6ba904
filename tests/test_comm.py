"""Chapter 02: the ring collectives against torch.distributed, the tracer's byte counts, the cost model.

Multi-rank checks are batched: one :func:`refimpl.launch.run_ranks` per world size runs every check on
the ranks (a spawn costs seconds), and a rank that fails raises with its traceback. Integer-valued data
make every comparison with ``torch.distributed`` exact; the float case is bounded by the rounding error
of a sum in any order, ``gamma_(n-1) sum |x_i|`` with ``gamma_k = k u / (1 - k u)``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.comm.cost_model import AlphaBeta, Timings, fit_alpha_beta, measure_collective, measure_p2p
from refimpl.comm.ring import (
    _ring_reduce_scatter_,
    chunk_sizes,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_bytes_sent,
    ring_reduce_scatter,
)
from refimpl.comm.tracer import CommTracer
from refimpl.launch import run_ranks

LENGTHS = (1, 5, 64, 1001)


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
    from refimpl.comm.cost_model import plot_alpha_beta
    from refimpl.comm.pictures import plot_timeline, plot_who_holds_what
    from refimpl.comm.tracer import CommEvent

    a, b = torch.tensor([10.0, 11.0]), torch.tensor([20.0, 21.0])
    fig = plot_who_holds_what({"all-reduce": ([a, b], [a + b, a + b]), "send": ([a, None], [a, a])},
                              path=tmp_path / "who.png")
    assert len(fig.axes) == 4 and (tmp_path / "who.png").stat().st_size > 0
    ev = CommEvent(op="isend", nbytes=8, wire_bytes=8.0, group_size=2, peer=1, start=1.0, end=1.002, step=0,
                   async_op=True)
    assert plot_timeline([[ev], []], path=tmp_path / "tl.png").axes
    t = Timings(op="p2p", world_size=2, sizes_bytes=(4, 4096), seconds=(1e-5, 2e-5), repeats=1)
    fig = plot_alpha_beta([t], models={"model": lambda s: 1e-5 + s / 1e9}, path=tmp_path / "ab.png")
    assert isinstance(fit_alpha_beta(t.sizes_bytes, t.seconds), AlphaBeta) and fig.axes


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
                dist.reduce_scatter_tensor(theirs, x, group=group)
                assert torch.equal(shard, theirs)
    # random floats: both within the rounding bound of a sum of n terms from the exact (float64) sum
    x = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    ours, theirs, exact, magnitude = x.clone(), x.clone(), x.double(), x.double().abs()
    ring_all_reduce(ours, group=group)
    for t in (theirs, exact, magnitude):
        dist.all_reduce(t, group=group)
    u = torch.finfo(torch.float32).eps / 2
    bound = (n - 1) * u / (1 - (n - 1) * u) * magnitude  # gamma_(n-1) sum |x_i| (Higham, ch. 4)
    assert ((ours.double() - exact).abs() <= bound).all()
    assert ((theirs.double() - exact).abs() <= bound).all()
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
    # the measurement plumbing (no timing is asserted: DESIGN.md, timings live in benchmarks)
    t = measure_collective(ring_all_reduce, (4, 4096), repeats=1, warmup=1)
    p = measure_p2p((4, 4096), repeats=1, warmup=0)
    out["timings"] = (t, p)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_on_ranks(world_size):
    """World sizes 2 and 4, plus sub-groups of 3 and 2 ranks in the 4-rank run (1 rank: no ranks needed)."""
    results = run_ranks(_ranks_worker, world_size, timeout_s=200)
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
