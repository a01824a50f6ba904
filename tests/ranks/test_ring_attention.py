"""Ring attention against one-device full-sequence SDPA, its bytes, its causal balance (chapter 07).

At cp = 2 and 4, causal and not, zigzag and contiguous: each rank runs
``refimpl.parallel.context_parallel.ring_attention.ring_attention`` forward and backward on its part of
the sequence; the parts are gathered (``gather_sequence``) and compared with
``scaled_dot_product_attention(is_causal=...)`` of the whole sequence on one device: the output and dQ, dK,
dV, each within ``FACTOR x spread``, ``spread`` measured in the same run (one-device SDPA in float32 against
float64, per tensor). Negative controls fail the same check: a merge that averages the block outputs
instead of the log-sum-exp rule, and a diagonal block left without its causal mask. At world 4 the ring
also runs on the groups {0, 2} and {1, 3} (peers are global ranks, not group ranks).

Measured, not restated: the tracer's bytes (forward each rank ``isend`` s cp - 1 K/V blocks, (cp-1)/cp of
the whole sequence's K and V; backward that plus as much in dK/dV) and the causal work (the block
attentions each rank's forward actually computed, counted by wrapping the block function) against
``causal_work`` and against the pairs of chunks the global causal mask leaves anything in. A rank that
never sends makes its neighbour fail within the short collective timeout, with a message naming the peer.
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from refimpl.comm import CommTracer
from refimpl.launch import RankFailed, run_ranks
from refimpl.parallel.context_parallel import RingTimeline
from refimpl.parallel.context_parallel import ring_attention as ra
from refimpl.parallel.context_parallel import sequence_layout as sl
from tests.support.timeouts import SPAWN_TIMEOUT_S

FACTOR = 4.0  # float32 attention in another order errs up to ~2.5x SDPA's own spread (measured): x1.6 margin
B, A, D, DV, CHUNK = 2, 2, 8, 6, 3  # batch, heads, head dims of q/k and v, tokens per zigzag chunk
CASES = [(causal, layout) for causal in (False, True) for layout in sl.LAYOUTS]


GQA = (4, 2)  # grouped-query attention's case: 4 query heads, 2 key/value heads


def _globals(cp: int, seed: int = 0, heads: tuple[int, int] = (A, A)) -> dict[str, torch.Tensor]:
    """Whole-sequence q [B, a, s, D], k, v [B, g, s, D|DV] and the upstream gradient, float32,
    s = 2 cp CHUNK; ``heads = (a, g)``."""
    g = torch.Generator().manual_seed(seed + cp)
    s, (a, kv) = 2 * cp * CHUNK, heads
    shapes = {"q": (B, a, s, D), "k": (B, kv, s, D), "v": (B, kv, s, DV), "do": (B, a, s, DV)}
    return {n: torch.randn(shape, generator=g) for n, shape in shapes.items()}


def _run(group, cp: int, causal: bool, layout: str, heads: tuple[int, int] = (A, A)) -> dict:
    """Ring attention forward (tracer step 0) and backward (step 1) on this rank's part of ``_globals``."""
    r = dist.get_rank(group)
    part = {n: sl.split_sequence(t, dim=2, cp_rank=r, cp_size=cp, layout=layout)  # [B, a|g, s/cp, D|DV]
            for n, t in _globals(cp, heads=heads).items()}
    q, k, v = (part[n].clone().requires_grad_() for n in "qkv")
    calls = []
    block = ra.block_attention
    ra.block_attention = lambda *a, **kw: calls.append(1) or block(*a, **kw)  # count what forward computes
    timeline = RingTimeline()
    try:
        with CommTracer() as tracer:
            out = ra.ring_attention(q, k, v, cp_group=group, causal=causal, layout=layout, timeline=timeline)
            tracer.step()
            out.backward(part["do"])
    finally:
        ra.block_attention = block
    steps = [[e for e in tracer.select(step=s) if e.op == "isend"] for s in (0, 1)]
    return {"out": out.detach().numpy(), "dq": q.grad.numpy(), "dk": k.grad.numpy(), "dv": v.grad.numpy(),
            "work": len(calls), "sent": [tracer.measured_bytes_sent(step=s) for s in (0, 1)],
            "isends": [len(s) for s in steps], "peers": sorted({e.peer for s in steps for e in s}),
            "ops": sorted({e.op for e in tracer.events}),
            "spans": [(sp.kind, sp.step, sp.start, sp.end) for sp in timeline.spans]}


def _averaging_merge(out, lse, block_out, block_lse):
    """Negative control: the plain mean of the block outputs instead of the log-sum-exp rule."""
    return (block_out, block_lse) if out is None else ((out + block_out) / 2, torch.logaddexp(lse, block_lse))


def _no_mask(n, device):
    """Negative control: the diagonal block without its causal mask."""
    return torch.zeros(n, n, dtype=torch.bool, device=device)


def _tiled_groups(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Negative control: query head ``i`` reading key/value head ``i mod g`` (tiled, not grouped)."""
    return kv.repeat(1, heads // kv.shape[1], 1, 1)


def _broken(group, cp: int, name: str, fake, heads: tuple[int, int] = (A, A)) -> dict:
    original = getattr(ra, name)
    setattr(ra, name, fake)
    try:
        return _run(group, cp, True, "zigzag", heads)
    finally:
        setattr(ra, name, original)


def _one_line_error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return "" if "\n" in str(e) else str(e)
    return ""


def _worker(ctx) -> dict:
    cp, world = ctx.world_size, dist.group.WORLD
    out: dict = {f"{c}/{lay}": _run(world, cp, c, lay) for c, lay in CASES}
    out["average_merge"] = _broken(world, cp, "merge_partial_attention", _averaging_merge)
    out["no_mask"] = _broken(world, cp, "_future_mask", _no_mask)
    out["gqa"] = _run(world, cp, True, "zigzag", GQA)
    out["gqa tiled"] = _broken(world, cp, "expand_groups", _tiled_groups, GQA)
    if cp == 4:  # groups {0, 2} and {1, 3}: group rank 1 of {1, 3} is global rank 3
        timeout = timedelta(seconds=ctx.timeout_s)
        pairs = [dist.new_group([0, 2], timeout=timeout), dist.new_group([1, 3], timeout=timeout)]
        out["pair"] = _run(pairs[ctx.rank % 2], 2, True, "zigzag")
    odd = torch.zeros(B, A, 2 * CHUNK + 1, D)  # 7 local tokens: 7 cp is not a multiple of 2 cp
    out["error/odd"] = _one_line_error(lambda: ra.ring_attention(odd, odd, odd, cp_group=world, causal=True))
    out["error/split"] = _one_line_error(lambda: sl.zigzag_split(odd, dim=2, cp_rank=0, cp_size=cp))
    out["error/layout"] = _one_line_error(lambda: ra.ring_attention(odd, odd, odd, cp_group=world,
                                                                    causal=True, layout="striped"))
    return out


def _reference(cp: int, causal: bool, dtype: torch.dtype,
               heads: tuple[int, int] = (A, A)) -> dict[str, np.ndarray]:
    """One device, the whole sequence: SDPA's output and dQ, dK, dV in ``dtype`` (as float64 arrays)."""
    t = _globals(cp, heads=heads)
    q, k, v = (t[n].to(dtype).requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads[0] != heads[1])
    out.backward(t["do"].to(dtype))
    return {n: x.detach().double().numpy() for n, x in (("out", out), ("dq", q.grad), ("dk", k.grad),
                                                         ("dv", v.grad))}


def _errors(per_rank: list[dict], causal: bool, layout: str, cp: int,
            heads: tuple[int, int] = (A, A)) -> dict[str, float]:
    """Per tensor: the gathered ring result's max error vs float64 SDPA over FACTOR x the float32 spread."""
    r32, r64 = _reference(cp, causal, torch.float32, heads), _reference(cp, causal, torch.float64, heads)
    ratios = {}
    for n in r64:
        got = sl.gather_sequence([torch.from_numpy(p[n]) for p in per_rank], dim=2, layout=layout).double()
        spread = float(np.abs(r32[n] - r64[n]).max())
        ratios[n] = float(np.abs(got.numpy() - r64[n]).max()) / (FACTOR * max(spread, 1e-12))
    return ratios


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_output_and_gradients_equal_full_sequence_sdpa_within_the_measured_spread(results):
    cp, per_rank = results
    for causal, layout in CASES:
        ratios = _errors([p[f"{causal}/{layout}"] for p in per_rank], causal, layout, cp)
        assert max(ratios.values()) <= 1.0, (cp, causal, layout, ratios)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_negative_controls_an_averaging_merge_and_a_missing_causal_mask_fail_the_same_check(results):
    cp, per_rank = results
    for key in ("average_merge", "no_mask"):
        ratios = _errors([p[key] for p in per_rank], True, "zigzag", cp)
        assert ratios["out"] > 1.0, (cp, key, ratios)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("results", [4], indirect=True, ids=["cp4"])  # groups {0, 2}, {1, 3} need 4 ranks
def test_a_ring_on_non_adjacent_ranks_sends_to_global_ranks_and_is_exact(results):
    cp, per_rank = results
    assert cp == 4
    for members in ([0, 2], [1, 3]):
        parts = [per_rank[g]["pair"] for g in members]
        assert max(_errors(parts, True, "zigzag", 2).values()) <= 1.0, members
        for me, part in zip(members, parts, strict=True):
            assert part["peers"] == [m for m in members if m != me], (members, me, part["peers"])


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_bytes_each_rank_sends_cp_minus_one_kv_blocks_forward_and_as_much_again_in_dk_dv(results):
    cp, per_rank = results
    t = _globals(cp)
    kv = t["k"].nbytes + t["v"].nbytes  # the whole sequence's K and V, float32
    for rank, out in enumerate(per_rank):
        for causal, layout in CASES:
            run = out[f"{causal}/{layout}"]
            assert run["ops"] == ["irecv", "isend"], run["ops"]
            assert run["isends"] == [2 * (cp - 1), 4 * (cp - 1)], (rank, causal, layout, run["isends"])
            assert run["sent"] == [(cp - 1) * kv // cp, 2 * (cp - 1) * kv // cp], (rank, causal, layout)
            assert run["peers"] == [(rank + 1) % cp], (rank, run["peers"])


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_grouped_query_attention_equals_sdpa_and_moves_kv_at_their_own_head_count(results):
    """4 query heads, 2 key/value heads (zig-zag, causal): output, dQ, dK, dV within the measured spread of
    SDPA's ``enable_gqa`` (query head i reads key/value head i // 2); the ring sends the k/v blocks at 2
    heads, ``(cp-1)/cp`` of the whole sequence's K and V of 2 heads, half of what repeating them to 4 heads
    would move (picotron's ring). Negative control: head i reading key/value head i mod 2 fails."""
    cp, per_rank = results
    ratios = _errors([o["gqa"] for o in per_rank], True, "zigzag", cp, GQA)
    assert max(ratios.values()) <= 1, ratios
    tiled = _errors([o["gqa tiled"] for o in per_rank], True, "zigzag", cp, GQA)
    assert tiled["out"] > 100, tiled
    t = _globals(cp, heads=GQA)
    kv = t["k"].nbytes + t["v"].nbytes  # the whole sequence's K and V at 2 heads, float32
    repeated = 2 * kv  # at 4 heads
    for out in per_rank:
        assert out["gqa"]["sent"][0] == (cp - 1) * kv // cp == (cp - 1) * repeated // (2 * cp)


def test_the_timeline_has_one_compute_span_per_step_and_each_transfer_posted_before_and_waited_after_it(
        results):
    cp, per_rank = results
    for rank in per_rank:
        spans = rank["True/zigzag"]["spans"]
        compute = {st: (a, b) for kind, st, a, b in spans if kind == "compute"}
        transfer = {st: (a, b) for kind, st, a, b in spans if kind == "transfer"}
        assert sorted(compute) == list(range(cp)) and sorted(transfer) == list(range(cp - 1))
        for st, (a, b) in transfer.items():  # the overlap: posted before the block's compute, waited after
            assert a <= compute[st][0] <= compute[st][1] <= b
            assert b <= compute[st + 1][0]  # the next step computes with the block that arrived


def _mask_pairs(cp: int, layout: str) -> list[int]:
    """Per rank, the (query chunk, key chunk) pairs in which the global causal mask allows anything."""
    chunk = 2 * CHUNK if layout == "contiguous" else CHUNK
    s = 2 * cp * CHUNK
    allowed = torch.ones(s, s, dtype=torch.bool).tril()  # [query, key]
    blocks = allowed.reshape(s // chunk, chunk, s // chunk, chunk).any(3).any(1)  # [q chunk, k chunk]
    owner = [r for i in range(s // chunk) for r in range(cp) if i in sl.chunk_ids(cp_rank=r, cp_size=cp,
                                                                                 layout=layout)]
    return [int(blocks[[i for i, o in enumerate(owner) if o == r]].sum()) for r in range(cp)]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_causal_work_contiguous_is_unbalanced_and_zigzag_is_equal(results):
    cp, per_rank = results
    for layout in sl.LAYOUTS:
        measured = [out[f"True/{layout}"]["work"] for out in per_rank]
        assert measured == sl.causal_work(cp_size=cp, layout=layout) == _mask_pairs(cp, layout), layout
    contiguous = [out["True/contiguous"]["work"] for out in per_rank]
    zigzag = [out["True/zigzag"]["work"] for out in per_rank]
    assert contiguous[0] == 1 and contiguous[-1] == cp, contiguous
    assert len(set(zigzag)) == 1 and zigzag[0] == 2 * cp + 1, zigzag
    assert [out["False/zigzag"]["work"] for out in per_rank] == [4 * cp] * cp  # no mask: every pair


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_lengths_that_do_not_divide_and_unknown_layouts_are_one_line_errors(results):
    _, per_rank = results
    for out in per_rank:
        assert "does not divide into 2*cp" in out["error/odd"], out["error/odd"]
        assert "does not divide into 2*cp" in out["error/split"], out["error/split"]
        assert "layout must be one of" in out["error/layout"], out["error/layout"]


def test_zigzag_split_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i_and_gather_inverts_it():
    for cp in (1, 2, 3, 4):
        x = torch.arange(2 * cp * CHUNK).reshape(1, -1)
        parts = [sl.zigzag_split(x, dim=1, cp_rank=r, cp_size=cp) for r in range(cp)]
        for r, part in enumerate(parts):
            late = 2 * cp - 1 - r
            want = [*range(r * CHUNK, (r + 1) * CHUNK), *range(late * CHUNK, (late + 1) * CHUNK)]
            assert part.flatten().tolist() == want, (cp, r)
            positions = sl.sequence_positions(seq_len=x.shape[1], cp_rank=r, cp_size=cp, layout="zigzag")
            assert torch.equal(positions, part.flatten())
        assert torch.equal(sl.zigzag_gather(parts, dim=1), x)
        contiguous = [sl.split_sequence(x, dim=1, cp_rank=r, cp_size=cp, layout="contiguous")
                      for r in range(cp)]
        assert torch.equal(torch.cat(contiguous, 1), x)
        assert torch.equal(sl.gather_sequence(contiguous, dim=1, layout="contiguous"), x)


def test_without_a_process_group_ring_attention_is_plain_sdpa():
    t = _globals(1)
    for causal in (False, True):
        got = ra.ring_attention(t["q"], t["k"], t["v"], cp_group=None, causal=causal)
        assert torch.equal(got, F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=causal))


def _silent_neighbour(ctx) -> None:
    """Rank 1 never sends (it sleeps past the timeout); rank 0 waits for its K/V block."""
    if ctx.rank == 1:
        time.sleep(30)
        return
    q = torch.zeros(B, A, 2 * CHUNK, D)
    ra.ring_attention(q, q, q, cp_group=dist.group.WORLD, causal=True)


@pytest.mark.timeout(60)
def test_a_rank_that_never_sends_fails_fast_with_a_clear_message():
    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(_silent_neighbour, 2, timeout_s=40, collective_timeout_s=2)
    elapsed = time.monotonic() - start
    assert failed.value.rank == 0, failed.value.summary
    assert "ring exchange step 0: the block from rank 1" in failed.value.summary, failed.value.summary
    assert elapsed < 20, elapsed
