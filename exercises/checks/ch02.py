"""Checks of chapter 02's exercises (the ring, ``exercises/02_collectives.py``); see exercises/grading.py.

Each function runs on 2 and 3 ranks (``refimpl.launch.run_ranks``; each rank loads the graded file
again by path) on lengths 1, 2, 5, 64 and 1001, so some chunks are uneven and some empty, on integer-
valued float32 and on int64, and is compared with ``torch.distributed`` (exact: integer sums do not depend
on the order of the additions) and, for the all-reduce, on random floats within the rounding bound
``gamma_(n-1) sum |x_i|``, ``gamma_k = k u / (1 - k u)``. A ``refimpl.comm.tracer.CommTracer``
checks the rules: only ``isend`` and ``irecv``, ``n - 1`` sends per phase, and exactly the ring's bytes
(measured from the tensors handed to ``isend``, against ``refimpl.planner.ring_bytes_sent``).

Starting ranks costs seconds, so one run per world size checks all three functions and the three tasks
read its verdicts (cached per file content); a function that fails on 3 ranks is not run again on 2. A
function that hangs or crashes a rank spoils that run; the functions are then rerun one by one to find
the culprit. A stub is recognised without starting any rank.
``MUTANTS`` holds one plausible wrong implementation per task (tests/course/cli/test_exercises.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from exercises.grading import Task, load_module

WORLDS = (3, 2)  # 3 first: most wrong rings fail there, and the 2-rank run is then skipped
LENGTHS = (1, 2, 5, 64, 1001)
TIMEOUT_S = 90
COLLECTIVE_TIMEOUT_S = 20
NAMES = ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")
NOT_IMPLEMENTED = "not implemented yet"
OTHER_RANK = "another rank failed"


def _ints(shape, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=g).to(dtype=dtype, device=device)


def _traffic(tracer, numel: int, element_size: int, n: int, rank: int, op: str, what: str) -> None:
    from refimpl.planner import ring_bytes_sent

    used = set(tracer.summary())
    assert used <= {"isend", "irecv"}, (
        f"{what}: only the given isend/irecv may communicate, but the tracer saw {sorted(used)}")
    sends = tracer.select(op="isend")
    steps = (n - 1) * (2 if op == "all_reduce" else 1)
    if numel >= n:  # (with S < n a ring may skip its empty chunks)
        assert len(sends) == steps, (
            f"{what}: {len(sends)} isend calls on rank {rank} of {n}, want {steps} (one per step); "
            "communicate through refimpl.comm.ops.isend/irecv (imported in the exercise file)")
    sent = tracer.measured_bytes_sent()  # the bytes of the tensors handed to isend
    want = ring_bytes_sent(numel, n, rank, element_size, op=op)
    assert sent == want, (f"{what}: rank {rank} of {n} sent {sent} bytes, the ring sends {want} "
                          f"(every chunk but one per phase, to the rank on the right)")


class _OtherRankFailed(AssertionError):
    """This rank passed the case, another did not: stop here too, so the ranks stay in step."""


def _in_step(ctx, case: Callable[..., None], *args) -> None:
    """Run one case on every rank, then agree: if it failed anywhere, every rank raises (a rank that went on
    to the next case alone would wait for its peers in a collective they never join)."""
    error: BaseException | None = None
    try:
        case(*args)
    except Exception as exc:  # noqa: BLE001 - NotImplementedError included: re-raised below
        error = exc
    flag = torch.tensor([0 if error is None else 1], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if flag.item():
        raise _OtherRankFailed("another rank failed")


def _reduce_scatter_case(fn: Callable, ctx, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from refimpl.comm.tracer import CommTracer

    n, r = ctx.world_size, ctx.rank
    x = _ints(shape, 100 * r + len(shape) + shape[0], dtype, ctx.device)
    kept = x.clone()
    total = x.clone()
    dist.all_reduce(total)
    with CommTracer() as tracer:
        got = fn(x)
    what = f"ring_reduce_scatter(shape {tuple(shape)}, {dtype}) on {n} ranks"
    want = torch.tensor_split(total.flatten(), n)[r]
    assert torch.equal(x, kept), f"{what}: the input tensor was modified"
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
        f"{what}: rank {r} returned {getattr(got, 'shape', got)!r}, want shape {tuple(want.shape)} "
        f"(chunk {r} of torch.tensor_split of the flat sum)")
    assert torch.equal(got, want), (
        f"{what}: rank {r} got {got.tolist()[:6]}, want {want.tolist()[:6]} (chunk {r} of the sum)")
    _traffic(tracer, x.numel(), x.element_size(), n, r, "reduce_scatter", what)


def _all_gather_case(fn: Callable, ctx, dtype: torch.dtype, numel: int) -> None:
    from refimpl.comm.tracer import CommTracer

    n, r = ctx.world_size, ctx.rank
    full = _ints((numel,), 7 * numel, dtype, ctx.device)  # the same on every rank
    shard = torch.tensor_split(full, n)[r].clone()
    with CommTracer() as tracer:
        got = fn(shard, numel)
    what = f"ring_all_gather(numel={numel}, {dtype}) on {n} ranks"
    assert isinstance(got, torch.Tensor) and got.shape == full.shape, (
        f"{what}: rank {r} returned {getattr(got, 'shape', got)!r}, want shape ({numel},)")
    assert torch.equal(got, full), f"{what}: rank {r} got {got.tolist()[:6]}, want {full.tolist()[:6]}"
    _traffic(tracer, numel, full.element_size(), n, r, "all_gather", what)
    if numel % n == 0:  # PyTorch's own all-gather agrees
        parts = [torch.empty_like(shard) for _ in range(n)]
        dist.all_gather(parts, shard)
        assert torch.equal(torch.cat(parts), got)


def _all_reduce_case(fn: Callable, ctx, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from refimpl.comm.tracer import CommTracer

    n, r = ctx.world_size, ctx.rank
    x = _ints(shape, 100 * r + len(shape) + shape[0], dtype, ctx.device)
    want = x.clone()
    dist.all_reduce(want)
    with CommTracer() as tracer:
        got = fn(x)
    what = f"ring_all_reduce(shape {tuple(shape)}, {dtype}) on {n} ranks"
    assert got is x, f"{what}: must work in place and return its argument"
    assert torch.equal(x, want), (
        f"{what}: rank {r} got {x.flatten().tolist()[:6]}, want {want.flatten().tolist()[:6]}")
    _traffic(tracer, x.numel(), x.element_size(), n, r, "all_reduce", what)


def _all_reduce_floats_case(fn: Callable, ctx) -> None:
    """Random floats: any order of additions is within gamma_(n-1) sum |x_i| of the exact sum."""
    n, r = ctx.world_size, ctx.rank
    x = torch.randn(1001, generator=torch.Generator().manual_seed(r)).to(ctx.device)
    exact, magnitude = x.double(), x.double().abs()
    dist.all_reduce(exact)
    dist.all_reduce(magnitude)
    fn(x)
    u = torch.finfo(torch.float32).eps / 2
    bound = (n - 1) * u / (1 - (n - 1) * u) * magnitude
    assert ((x.double() - exact).abs() <= bound).all(), \
        f"ring_all_reduce on random floats, {n} ranks: farther from the exact sum than rounding allows"


SHAPES = [(s,) for s in LENGTHS] + [(3, 7)]
DTYPES = (torch.float32, torch.int64)


def _check_reduce_scatter(fn: Callable, ctx) -> None:
    for dtype in DTYPES:
        for shape in SHAPES:
            _in_step(ctx, _reduce_scatter_case, fn, ctx, dtype, shape)


def _check_all_gather(fn: Callable, ctx) -> None:
    for dtype in DTYPES:
        for numel in LENGTHS:
            _in_step(ctx, _all_gather_case, fn, ctx, dtype, numel)


def _check_all_reduce(fn: Callable, ctx) -> None:
    for dtype in DTYPES:
        for shape in SHAPES:
            _in_step(ctx, _all_reduce_case, fn, ctx, dtype, shape)
    _in_step(ctx, _all_reduce_floats_case, fn, ctx)


CHECKS = {"ring_reduce_scatter": _check_reduce_scatter, "ring_all_gather": _check_all_gather,
          "ring_all_reduce": _check_all_reduce}


def _on_rank(ctx, path: str, names: list[str]) -> dict[str, str | None]:
    """On each rank: run the checks of ``names``; None for a pass, else the reason."""
    mod = load_module(path)
    verdicts: dict[str, str | None] = {}
    for name in names:
        try:
            CHECKS[name](getattr(mod, name), ctx)
            verdicts[name] = None
        except NotImplementedError:
            verdicts[name] = NOT_IMPLEMENTED
        except _OtherRankFailed:
            verdicts[name] = OTHER_RANK
        except Exception as exc:  # noqa: BLE001 - a wrong answer: the reason goes to the learner
            verdicts[name] = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
    return verdicts


def _probe(fn: Callable, *args) -> bool:
    """Call ``fn`` here, without ranks: False for a stub (NotImplementedError), True otherwise (an
    implementation may well fail without a process group; that is expected and ignored)."""
    try:
        fn(*args)
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 - e.g. "Default process group has not been initialized"
        pass
    return True


def _run(path: str, world: int, names: list[str]) -> dict[str, str | None]:
    from exercises.rank_batch import run_ranks
    from refimpl.launch import RankFailed

    try:
        per_rank = run_ranks(_on_rank, world, path, names, timeout_s=TIMEOUT_S,
                             collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    except RankFailed as exc:
        if len(names) > 1:  # find which function spoiled the run
            out: dict[str, str | None] = {}
            for name in names:
                out.update(_run(path, world, [name]))
            return out
        last = [line for line in str(exc).splitlines() if line.strip()][-1].strip()
        return {names[0]: f"on {world} ranks a rank hung or crashed: {last}"}
    verdicts: dict[str, str | None] = {}
    for name in names:
        reasons = [(r, v[name]) for r, v in enumerate(per_rank) if v[name] is not None]
        if not reasons:
            verdicts[name] = None
        elif all(v in (NOT_IMPLEMENTED, OTHER_RANK) for _, v in reasons) and \
                any(v == NOT_IMPLEMENTED for _, v in reasons):
            verdicts[name] = NOT_IMPLEMENTED
        else:
            real = [(r, v) for r, v in reasons if v not in (NOT_IMPLEMENTED, OTHER_RANK)] or reasons
            rank, reason = real[0]
            verdicts[name] = f"[rank {rank}] {reason}"
    return verdicts


_VERDICTS: dict[str, dict[str, str | None]] = {}


def _verdicts(path: str) -> dict[str, str | None]:
    """Every function's verdict for the file at ``path`` (computed once per file content)."""
    key = f"{Path(path).resolve()}:{hashlib.sha256(Path(path).read_bytes()).hexdigest()}"
    if key not in _VERDICTS:
        mod = load_module(path)
        probes = {"ring_reduce_scatter": (torch.arange(5.0),), "ring_all_gather": (torch.arange(5.0), 5),
                  "ring_all_reduce": (torch.arange(5.0),)}
        verdicts: dict[str, str | None] = {name: None for name in NAMES}
        todo = []
        for name in NAMES:
            if _probe(getattr(mod, name), *probes[name]):
                todo.append(name)
            else:
                verdicts[name] = NOT_IMPLEMENTED
        for world in WORLDS:
            if not todo:
                break
            for name, reason in _run(path, world, todo).items():
                verdicts[name] = verdicts[name] or reason
            todo = [name for name in todo if verdicts[name] is None]
        _VERDICTS[key] = verdicts
    return _VERDICTS[key]


def _task(name: str) -> Callable[[str], None]:
    def check(path: str) -> None:
        reason = _verdicts(path)[name]
        if reason == NOT_IMPLEMENTED:
            raise NotImplementedError(name)
        if reason is not None:
            raise AssertionError(reason)

    check.__name__ = f"check_{name}"
    return check


TASKS = [
    Task(name="02.1 ring_reduce_scatter (2, 3 ranks)", points=4, check=_task("ring_reduce_scatter")),
    Task(name="02.2 ring_all_gather (2, 3 ranks)", points=3, check=_task("ring_all_gather")),
    Task(name="02.3 ring_all_reduce (2, 3 ranks)", points=3, check=_task("ring_all_reduce")),
]

_MUTANT_HEADER = '''\
from exercises.reference.ch02 import *  # noqa: F403
import torch
import torch.distributed as dist
from refimpl.comm.ops import irecv, isend
'''

MUTANTS = {
    # the textbook indexing, which leaves the complete sum in chunk r + 1, but returns chunk r
    "02.1 ring_reduce_scatter (2, 3 ranks)": _MUTANT_HEADER + '''
def ring_reduce_scatter(tensor, group=None):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(torch.tensor_split(tensor.detach().flatten().clone(), n))
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        buf = torch.empty_like(chunks[recv_i])
        rq, sq = irecv(buf, src=(r - 1) % n), isend(chunks[send_i], dst=(r + 1) % n)
        rq.wait()
        sq.wait()
        chunks[recv_i] += buf
    return chunks[r]
''',
    # the reduce-scatter's indices reused: each rank forwards a chunk it does not have yet
    "02.2 ring_all_gather (2, 3 ranks)": _MUTANT_HEADER + '''
def ring_all_gather(shard, numel, group=None):
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(numel, dtype=shard.dtype, device=shard.device)
    chunks = list(torch.tensor_split(out, n))
    chunks[r].copy_(shard)
    for s in range(n - 1):
        send_i, recv_i = (r - s - 1) % n, (r - s - 2) % n
        rq, sq = irecv(chunks[recv_i], src=(r - 1) % n), isend(chunks[send_i], dst=(r + 1) % n)
        rq.wait()
        sq.wait()
    return out
''',
    # the negative control of the lesson: reduce-scatter without the all-gather phase
    "02.3 ring_all_reduce (2, 3 ranks)": _MUTANT_HEADER + '''
from refimpl.comm.ring import _ring_reduce_scatter_

def ring_all_reduce(tensor, group=None):
    n, r = dist.get_world_size(), dist.get_rank()
    _ring_reduce_scatter_(list(torch.tensor_split(tensor.view(-1), n)), r, n, None)
    return tensor
''',
}
