"""The conjugate collectives of tensor / sequence parallelism against their definitions (chapter 06).

Each function of ``refimpl.parallel.tensor_parallel.tp_communications`` is run forward and backward at 2
and 4 ranks (the whole world, and at 4 ranks also two groups of 2, so the group's rank is used, not the
global one) and compared **bitwise** with its definition computed locally from every rank's tensors. The
tensors hold small integers, so every sum is exact whatever order gloo adds in. A tracer checks that
forward and backward issue exactly the collective the docstring names, with the full tensor's bytes.
Negative control: an ``f`` that all-reduces in forward fails the same check. Also: a group of one is the
identity with no collective, and a dim that does not divide is a one-line ``ValueError``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from refimpl.comm import CommTracer, ops
from refimpl.launch import run_ranks
from refimpl.parallel.tensor_parallel import tp_communications as tpc
from tests.support.timeouts import SPAWN_TIMEOUT_S


def _sum(ts):
    return torch.stack(ts).sum(0)


def _mine(x, dim, r, t):
    return x.chunk(t, dim)[r]


# name -> (function, input shape at t ranks, definition of y from all xs, of dx from all dys, ops fwd, bwd)
CASES = {
    "copy": (tpc.copy_to_tensor_parallel_region, lambda t: (2, 4, 3),
             lambda xs, r, t: xs[r], lambda dys, r, t: _sum(dys), [], ["all_reduce"]),
    "reduce": (tpc.reduce_from_tensor_parallel_region, lambda t: (2, 4, 3),
               lambda xs, r, t: _sum(xs), lambda dys, r, t: dys[r], ["all_reduce"], []),
    "scatter_last": (tpc.scatter_to_tensor_parallel_region, lambda t: (2, 3, 2 * t),
                     lambda xs, r, t: _mine(xs[r], -1, r, t), lambda dys, r, t: torch.cat(dys, -1),
                     [], ["all_gather"]),
    "gather_last": (tpc.gather_from_tensor_parallel_region, lambda t: (2, 3, 5),
                    lambda xs, r, t: torch.cat(xs, -1), lambda dys, r, t: _mine(dys[r], -1, r, t),
                    ["all_gather"], []),
    "scatter_seq": (tpc.scatter_to_sequence_parallel_region, lambda t: (2, 2 * t, 3),
                    lambda xs, r, t: _mine(xs[r], 1, r, t), lambda dys, r, t: torch.cat(dys, 1),
                    [], ["all_gather"]),
    "gather_seq": (tpc.gather_from_sequence_parallel_region, lambda t: (2, 3, 5),
                   lambda xs, r, t: torch.cat(xs, 1), lambda dys, r, t: _mine(_sum(dys), 1, r, t),
                   ["all_gather"], ["reduce_scatter"]),
    "reduce_scatter_seq": (tpc.reduce_scatter_to_sequence_parallel_region, lambda t: (2, 2 * t, 3),
                           lambda xs, r, t: _mine(_sum(xs), 1, r, t), lambda dys, r, t: torch.cat(dys, 1),
                           ["reduce_scatter"], ["all_gather"]),
}


class _AllReducingCopy(torch.autograd.Function):
    """Negative control: an ``f`` that all-reduces in forward as well as in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        ops.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        dx = dy.clone()
        ops.all_reduce(dx, group=ctx.group)
        return dx, None


def _ints(shape, seed: int) -> torch.Tensor:
    """Integer-valued floats in [-8, 8]: their sums are exact in any order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(torch.float32)


def _check(name: str, fn, group, seed: int) -> dict:
    """Run ``fn`` forward and backward on ``group``; compare with ``CASES[name]``'s definition."""
    _, shape_of, y_def, dx_def, ops_fwd, ops_bwd = CASES[name]
    t, r = dist.get_world_size(group), dist.get_rank(group)
    shape = shape_of(t)
    xs = [_ints(shape, seed + q) for q in range(t)]
    y_shape = y_def(xs, r, t).shape
    dys = [_ints(y_shape, seed + 100 + q) for q in range(t)]
    x = xs[r].clone().requires_grad_()
    with CommTracer() as tracer:
        y = fn(x, group)
        tracer.step()
        y.backward(dys[r])
    fwd, bwd = tracer.select(step=0), tracer.select(step=1)
    nbytes = [max(x.numel(), y.numel()) * 4]  # the full tensor: all-reduced, gathered or reduce-scattered
    return {
        "y": tuple(y.shape) == tuple(y_shape) and torch.equal(y, y_def(xs, r, t)),
        "dx": torch.equal(x.grad, dx_def(dys, r, t)),
        "ops_fwd": [e.op for e in fwd] == ops_fwd,
        "ops_bwd": [e.op for e in bwd] == ops_bwd,
        "bytes": [e.nbytes for e in fwd + bwd] == nbytes * len(ops_fwd + ops_bwd),
        "group_size": all(e.group_size == t for e in fwd + bwd),
    }


def _one_line_error(fn, *args) -> bool:
    try:
        fn(*args)
    except ValueError as e:
        return "does not divide" in str(e) and "\n" not in str(e)
    return False


def _worker(ctx) -> dict:
    timeout = timedelta(seconds=ctx.timeout_s)
    world = dist.group.WORLD
    out: dict = {}
    for i, (name, case) in enumerate(CASES.items()):
        out[f"world/{name}"] = _check(name, case[0], world, 1000 * i)
    out["broken_copy"] = _check("copy", lambda x, g: _AllReducingCopy.apply(x, g), world, 0)
    if ctx.world_size == 4:  # two groups of 2: the group's own rank picks the chunk
        pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
        mine = pairs[ctx.rank // 2]
        for i, (name, case) in enumerate(CASES.items()):
            out[f"pair/{name}"] = _check(name, case[0], mine, 1000 * i + 10 * (ctx.rank // 2))
    singles = [dist.new_group([q], timeout=timeout) for q in range(ctx.world_size)]
    alone = singles[ctx.rank]
    x = _ints((2, 3, 5), 7).requires_grad_()  # 3 and 5 do not divide: irrelevant for a group of one
    with CommTracer() as tracer:
        ys = [case[0](x, alone) for case in CASES.values()]
        torch.stack(ys).sum().backward()
    out["single/identity"] = all(y is x for y in ys)
    out["single/no_collective"] = tracer.events == []
    out["single/grad"] = torch.equal(x.grad, torch.full_like(x, float(len(CASES))))
    odd = torch.zeros(2, 3, 5)  # seq 3 and hidden 5 do not divide by 2 or 4
    out["error/scatter_last"] = _one_line_error(tpc.scatter_to_tensor_parallel_region, odd, world)
    out["error/scatter_seq"] = _one_line_error(tpc.scatter_to_sequence_parallel_region, odd, world)
    rs = tpc.reduce_scatter_to_sequence_parallel_region
    out["error/reduce_scatter_seq"] = _one_line_error(rs, odd, world)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_each_function_forward_and_backward_equal_the_definition_bitwise(results):
    world, per_rank = results
    groups = ["world", "pair"] if world == 4 else ["world"]
    for rank, out in enumerate(per_rank):
        for g in groups:
            for name in CASES:
                checks = out[f"{g}/{name}"]
                assert checks["y"] and checks["dx"], (world, rank, g, name, checks)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_the_tracer_sees_exactly_the_named_collective_forward_and_backward(results):
    world, per_rank = results
    for rank, out in enumerate(per_rank):
        for key, checks in out.items():
            if "/" in key and key.split("/")[0] in ("world", "pair"):
                assert checks["ops_fwd"] and checks["ops_bwd"], (world, rank, key, checks)
                assert checks["bytes"] and checks["group_size"], (world, rank, key, checks)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_negative_control_an_f_that_all_reduces_in_forward_fails_the_same_check(results):
    world, per_rank = results
    for rank, out in enumerate(per_rank):
        broken = out["broken_copy"]
        assert not broken["ops_fwd"] and not broken["y"], (world, rank, broken)
        assert broken["ops_bwd"] and broken["dx"], (world, rank, broken)  # its backward is f's


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_a_group_of_one_is_the_identity_and_sizes_that_do_not_divide_are_one_line_errors(results):
    world, per_rank = results
    for rank, out in enumerate(per_rank):
        for key in ("single/identity", "single/no_collective", "single/grad", "error/scatter_last",
                    "error/scatter_seq", "error/reduce_scatter_seq"):
            assert out[key], (world, rank, key)


def test_without_a_process_group_every_function_is_the_identity():
    x = torch.ones(2, 3, 5, requires_grad=True)
    for case in CASES.values():
        assert case[0](x, None) is x
    with pytest.raises(ValueError, match="sequence = dim 1"):
        tpc.gather_from_sequence_parallel_region(torch.ones(3), None)
