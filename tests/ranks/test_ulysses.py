"""DeepSpeed-Ulysses (all-to-all sequence parallelism) against one-device full-sequence SDPA (chapter 07).

At cp = 2 and 4 ranks (the whole world; at 4 also two groups of 2, so the group's rank is used):

* the all-to-all pair ``sequence_to_heads`` / ``heads_to_sequence``, forward and backward, equals its
  definition computed locally from every rank's tensors, **bitwise** (integer-valued tensors), and the two
  are inverse to each other bitwise;
* ``ulysses_attention``, causal and not: the output and dQ, dK, dV of each rank's sequence chunk equal
  one-device full-sequence ``scaled_dot_product_attention`` (float64) within ``FACTOR x spread``, the spread
  measured in the same run (one device in float32 against float64, on the same chunk; at least 1 ulp of the
  chunk's largest value); negative control: an all-to-all that concatenates the token chunks in reversed rank
  order fails the same check;
* the tracer: forward makes four all-to-alls (q, k, v in, the output back) and backward four (dO in, dQ,
  dK, dV back), each handed the local tensor ``b a (s/cp) d`` float32 elements (payload measured from the
  tensors) and booked as sending ``(cp-1)/cp`` of it (the block addressed to itself stays), against the
  issue's formula computed here from the shapes;
* a group of one is plain SDPA with no collective; heads or sequence that do not divide by cp are one-line
  ``ValueError`` s naming both numbers.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from refimpl.comm import CommTracer
from refimpl.launch import run_ranks
from refimpl.parallel.context_parallel import ulysses as uly
from tests.support.timeouts import SPAWN_TIMEOUT_S

FACTOR = 4.0  # Ulysses runs the same per-head SDPA as one device (another blocking at most); x2 margin
B, HEADS, SEQ, HEAD_DIM = 2, 8, 12, 8  # 8 heads, 12 tokens: divide by cp = 2 and 4 (2+ heads per rank)
NAMES = ("out", "dq", "dk", "dv")


def _ints(shape, seed: int) -> torch.Tensor:
    """Integer-valued floats in [-8, 8]: moved, never summed, so any error is a misplaced element."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(torch.float32)


def _randn(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _check_pair(group, seed: int) -> dict:
    """Both all-to-alls forward and backward against their definitions, bitwise, and their round trip."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    sc, ah = 3, HEADS // cp  # an odd local chunk is fine: only the heads must divide
    mine_heads, mine_tokens = slice(r * ah, (r + 1) * ah), slice(r * sc, (r + 1) * sc)
    xs = [_ints((B, HEADS, sc, HEAD_DIM), seed + j) for j in range(cp)]          # rank j's [b, a, s/cp, d]
    dys = [_ints((B, ah, cp * sc, HEAD_DIM), seed + 50 + j) for j in range(cp)]  # rank j's [b, a/cp, s, d]
    x = xs[r].clone().requires_grad_()
    y = uly.sequence_to_heads(x, group)
    y.backward(dys[r])
    z = dys[r].clone().requires_grad_()
    w = uly.heads_to_sequence(z, group)
    w.backward(xs[r])
    return {
        "s2h_fwd": torch.equal(y, torch.cat(xs, 2)[:, mine_heads]),
        "s2h_bwd": torch.equal(x.grad, torch.cat(dys, 1)[:, :, mine_tokens]),
        "h2s_fwd": torch.equal(w, torch.cat(dys, 1)[:, :, mine_tokens]),
        "h2s_bwd": torch.equal(z.grad, torch.cat(xs, 2)[:, mine_heads]),
        "round_trip": torch.equal(uly.heads_to_sequence(uly.sequence_to_heads(xs[r], group), group), xs[r]),
    }


def _wrong_order_attention(q, k, v, *, cp_group, causal):
    """Negative control: Ulysses whose first all-to-all joins the token chunks in reversed rank order."""
    cp = dist.get_world_size(cp_group)

    def s2h(t):
        y = uly.sequence_to_heads(t, cp_group)              # [b, a/cp, s, d]
        return torch.cat(y.chunk(cp, dim=2)[::-1], dim=2)   # [b, a/cp, s, d], chunks cp-1, ..., 0

    o = F.scaled_dot_product_attention(s2h(q), s2h(k), s2h(v), is_causal=causal)
    return uly.heads_to_sequence(o, cp_group)


def _attention(fn, qkv, dout, chunk, group, causal) -> tuple[dict, CommTracer]:
    """``fn`` on my chunk of q, k, v (float32), backward with my chunk of dout; results in float64."""
    q, k, v = (t[:, :, chunk].float().clone().requires_grad_() for t in qkv)  # fresh leaves, qkv untouched
    with CommTracer() as tracer:
        o = fn(q, k, v, cp_group=group, causal=causal)
        tracer.step()
        o.backward(dout[:, :, chunk].float())
    got = dict(zip(NAMES, (o, q.grad, k.grad, v.grad), strict=True))
    return {n: t.detach().double() for n, t in got.items()}, tracer


def _reference(qkv, dout, causal, dtype) -> dict:
    """One device, the whole sequence: SDPA's output and dQ, dK, dV in ``dtype``."""
    q, k, v = (t.to(dtype).clone().requires_grad_() for t in qkv)  # fresh leaves, qkv untouched
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(dout.to(dtype))
    return {n: t.detach().double() for n, t in zip(NAMES, (o, q.grad, k.grad, v.grad), strict=True)}


def _check_attention(group, causal: bool, seed: int) -> dict:
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    sc = SEQ // cp
    chunk = slice(r * sc, (r + 1) * sc)
    shape = (B, HEADS, SEQ, HEAD_DIM)
    qkv = [_randn(shape, seed + i) for i in range(3)]  # every rank draws the whole sequence, keeps its chunk
    dout = _randn(shape, seed + 3)
    r64, r32 = _reference(qkv, dout, causal, torch.float64), _reference(qkv, dout, causal, torch.float32)
    ours, tracer = _attention(uly.ulysses_attention, qkv, dout, chunk, group, causal)
    broken, _ = _attention(_wrong_order_attention, qkv, dout, chunk, group, causal)
    out: dict = {"scale": {}, "err": {}, "broken_err": {}, "bitwise_f32": {}}
    for n in NAMES:
        ref = r64[n][:, :, chunk]
        ulp = float(np.spacing(np.float32(ref.abs().max())))
        out["scale"][n] = max(float((r32[n][:, :, chunk] - ref).abs().max()), ulp)
        out["err"][n] = float((ours[n] - ref).abs().max())
        out["broken_err"][n] = float((broken[n] - ref).abs().max())
        out["bitwise_f32"][n] = torch.equal(ours[n], r32[n][:, :, chunk])
    local_bytes = B * HEADS * sc * HEAD_DIM * 4  # the "local tensor" of each rank: [b, a, s/cp, d] float32
    out["traffic"] = {
        "formula_per_call": (cp - 1) / cp * local_bytes,
        "formula_payload": local_bytes,
        "steps": [[(e.op, e.nbytes, e.wire_bytes, e.group_size) for e in tracer.select(step=s)]
                  for s in (0, 1)],
        "sent": [tracer.bytes_sent(step=s) for s in (0, 1)],
    }
    return out


def _one_line_error(fn, *numbers) -> bool:
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        return "\n" not in msg and all(str(n) in msg for n in numbers)
    return False


def _worker(ctx) -> dict:
    timeout = timedelta(seconds=ctx.timeout_s)
    world, cp = dist.group.WORLD, ctx.world_size
    out: dict = {"pair": {"world": _check_pair(world, 0)}}
    if cp == 4:  # two groups of 2: the group's own rank picks the heads and the tokens
        pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
        out["pair"]["pairs"] = _check_pair(pairs[ctx.rank // 2], 100 + 10 * (ctx.rank // 2))
    out["attention"] = {c: _check_attention(world, c, 1000 + 10 * c) for c in (False, True)}
    singles = [dist.new_group([q], timeout=timeout) for q in range(cp)]
    alone = singles[ctx.rank]
    q, k, v = (_randn((B, 3, 5, HEAD_DIM), 7 + i).float() for i in range(3))  # 3 heads, 5 tokens: any size
    with CommTracer() as tracer:
        o = uly.ulysses_attention(q, k, v, cp_group=alone, causal=True)
        same = uly.sequence_to_heads(q, alone) is q and uly.heads_to_sequence(q, alone) is q
    out["single"] = {"sdpa": torch.equal(o, F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                     "identity": same, "no_collective": tracer.events == []}
    odd_heads = torch.zeros(B, cp + 1, 2, HEAD_DIM)  # cp + 1 heads never divide by cp
    odd_seq = torch.zeros(B, 1, cp + 1, HEAD_DIM)    # nor cp + 1 tokens
    out["errors"] = {
        "heads_s2h": _one_line_error(lambda: uly.sequence_to_heads(odd_heads, world), cp + 1, cp),
        "heads_attention": _one_line_error(
            lambda: uly.ulysses_attention(odd_heads, odd_heads, odd_heads, cp_group=world, causal=False),
            cp + 1, cp),
        "seq_h2s": _one_line_error(lambda: uly.heads_to_sequence(odd_seq, world), cp + 1, cp),
    }
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_the_all_to_all_pair_equals_its_definition_and_is_its_own_inverse_bitwise(results):
    cp, per_rank = results
    for rank, out in enumerate(per_rank):
        for group, checks in out["pair"].items():
            assert all(checks.values()), (cp, rank, group, checks)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_ulysses_output_and_grads_equal_one_device_sdpa_within_the_measured_spread(results):
    cp, per_rank = results
    for rank, out in enumerate(per_rank):
        for causal, case in out["attention"].items():
            for n in NAMES:
                ratio = case["err"][n] / (FACTOR * case["scale"][n])
                assert ratio <= 1.0, (cp, rank, causal, n, case["err"][n], case["scale"][n])


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_negative_control_chunks_concatenated_in_the_wrong_order_fail_the_same_check(results):
    cp, per_rank = results
    for rank, out in enumerate(per_rank):
        for causal, case in out["attention"].items():
            failed = [n for n in NAMES if case["broken_err"][n] > FACTOR * case["scale"][n]]
            assert "out" in failed, (cp, rank, causal, case["broken_err"], case["scale"])


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_four_all_to_alls_each_way_each_sending_cp_minus_1_over_cp_of_the_local_tensor(results):
    cp, per_rank = results
    for rank, out in enumerate(per_rank):
        for causal, case in out["attention"].items():
            t = case["traffic"]
            for step, events in enumerate(t["steps"]):  # 0: fwd (q, k, v, out); 1: bwd (dO, dQ, dK, dV)
                assert [e[0] for e in events] == ["all_to_all"] * 4, (cp, rank, causal, step, events)
                assert all(e[1] == t["formula_payload"] and e[3] == cp for e in events), (cp, rank, events)
                assert all(e[2] == t["formula_per_call"] for e in events), (cp, rank, events, t)
                assert t["sent"][step] == 4 * t["formula_per_call"], (cp, rank, causal, step, t["sent"])


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_a_group_of_one_is_plain_sdpa_and_sizes_that_do_not_divide_are_one_line_errors(results):
    cp, per_rank = results
    for rank, out in enumerate(per_rank):
        assert all(out["single"].values()), (cp, rank, out["single"])
        assert all(out["errors"].values()), (cp, rank, out["errors"])


def test_without_a_process_group_ulysses_is_plain_sdpa():
    q, k, v = (_randn((B, 3, 5, HEAD_DIM), i).float() for i in range(3))
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.equal(uly.ulysses_attention(q, k, v, cp_group=None, causal=causal), expected)
    with pytest.raises(ValueError, match="with g dividing a"):
        uly.ulysses_attention(q, k[:, :, :4], v, cp_group=None, causal=False)
    with pytest.raises(ValueError, match="with g dividing a"):  # 2 key/value heads for 3 query heads
        uly.ulysses_attention(q, k[:, :2], v[:, :2], cp_group=None, causal=False)
    gqa = F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], is_causal=True, enable_gqa=True)
    assert torch.equal(uly.ulysses_attention(q, k[:, :1], v[:, :1], cp_group=None, causal=True), gqa)
