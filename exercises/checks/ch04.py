"""Checks of chapter 04's exercises (ZeRO); see exercises/grading.py for the contract.

Tasks 1 and 6 run here. Tasks 2 to 5 run on 2 ranks (``refimpl.launch.run_ranks``), each rank loading
the graded file again by path; the shapes are uneven on purpose (3 rows over 2 ranks: 2 and 1; 1 row: 1 and
0), results are compared with a single-process computation of the same arithmetic, and a tracer checks
that the traffic went through ``refimpl.comm.ops`` as a reduce-scatter and an all-gather. Tasks 4 and 5
chain three units and record, from hooks of the grader's own inside each unit, which units hold memory
while each one computes its forward and its backward.
"""

from __future__ import annotations

import torch
from torch import nn

from exercises.grading import Task, load_module, probe_stub

WORLD = 2
TIMEOUT_S = 120


def _rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)




# ------------------------------------------------------------------------------------------ 04.1
def check_shard_rows(path: str) -> None:
    mod = load_module(path)
    got = [tuple(mod.shard_rows(9, r, 4)) for r in range(4)]
    assert got == [(0, 3), (3, 6), (6, 9), (9, 9)], (
        f"shard_rows(9, r, 4) for r = 0..3 gave {got}; want chunks of ceil(9/4) = 3 rows: "
        "[(0, 3), (3, 6), (6, 9), (9, 9)]")
    for rows in (1, 2, 3, 5, 8, 9, 31, 259):
        for n in (1, 2, 3, 4, 7, 8):
            for r in range(n):
                want, have = _rows(rows, r, n), tuple(mod.shard_rows(rows, r, n))
                assert have == want, f"shard_rows({rows}, {r}, {n}) = {have}, want {want}"
    try:
        mod.shard_rows(4, 2, 2)
    except ValueError:
        pass
    else:
        raise AssertionError("shard_rows(4, rank=2, world_size=2) must raise ValueError")


# ------------------------------------------------------------------------------------------ 04.2
def _params(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (3,), (1, 4), (6,)]  # rows over 2 ranks: 2+1, 2+1, 1+0 (an empty shard), 3+3
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(step: int, rank: int, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    grads = [torch.randn(p.shape, generator=g) for p in params]
    grads[3] = None  # the last parameter gets no gradient: it must be left alone
    return grads


def _step_on_rank(ctx, path: str) -> None:
    from refimpl.comm.tracer import CommTracer

    mod = load_module(path)
    rank, world = ctx.rank, ctx.world_size
    params = _params(0)
    shards = [p.detach()[slice(*_rows(p.shape[0], rank, world))] for p in params]
    # SGD with momentum, not Adam: it is sensitive to the scale of the gradient (a sum is not a mean)
    opt = torch.optim.SGD(shards, lr=0.1, momentum=0.9)
    ref = _params(0)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    with CommTracer() as tracer:
        for step in range(2):
            for p, g in zip(params, _grads(step, rank, params), strict=True):
                p.grad = g
            mod.sharded_step(params, shards, opt)
            per_rank = [_grads(step, r, ref) for r in range(world)]
            for i, p in enumerate(ref):
                p.grad = None if per_rank[0][i] is None else sum(gr[i] for gr in per_rank) / world
            ref_opt.step()
    for i, (p, want) in enumerate(zip(params, ref, strict=True)):
        assert torch.allclose(p.detach(), want.detach(), rtol=1e-5, atol=1e-6), (
            f"rank {rank}: parameter {i} (shape {tuple(p.shape)}) after 2 steps differs from one device "
            f"training on the mean gradient by {(p - want).abs().max().item():.3g}; is the gradient the mean "
            "over ranks, and are the updated rows gathered back into every rank's parameter?")
    assert all(s.grad is None for s in shards), "set shards[i].grad = None after the step"
    summary = tracer.summary()
    assert "all_reduce" not in summary, "no all-reduce: reduce-scatter the gradients, all-gather the rows"
    for op in ("reduce_scatter", "all_gather"):
        assert op in summary, f"no {op} seen: use refimpl.comm.ops so that the tracer sees it"
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    stepped = sum(s.numel() for s, p in zip(shards, params, strict=True) if p.grad is not None)
    assert sum(t.numel() for t in state) == stepped, "the optimizer state must stay sharded"


def check_sharded_step(path: str) -> None:
    from exercises.rank_batch import run_ranks

    mod = load_module(path)
    params = _params(0)
    probe_stub(mod.sharded_step, params, [p.detach() for p in params], torch.optim.SGD(params, lr=0.1))
    run_ranks(_step_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


# ------------------------------------------------------------------------------------------ 04.3
def _unit() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3))  # rows: 3+3, 3+3, 2+1, 2+1


def _unit_on_rank(ctx, path: str) -> None:
    from refimpl.comm.tracer import CommTracer

    mod = load_module(path)
    rank, world = ctx.rank, ctx.world_size
    reference = _unit()
    unit = _unit()
    fulls, shards = [], []
    for m in unit.modules():
        for name, p in list(m._parameters.items()):
            full = nn.Parameter(torch.empty_like(p))
            full.untyped_storage().resize_(0)  # sharded: the full tensor holds no memory
            shards.append(p.detach()[slice(*_rows(p.shape[0], rank, world))].clone())
            m._parameters[name] = full
            fulls.append(full)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    with CommTracer() as tracer:
        mod.unshard_(fulls, shards)
        for f, p in zip(fulls, reference.parameters(), strict=True):
            assert torch.equal(f.detach(), p.detach()), "after unshard_ a full parameter is not the original"
        out = unit(x)
        mod.reshard_(fulls)
        assert all(f.untyped_storage().nbytes() == 0 for f in fulls), \
            "after reshard_ every full parameter must hold 0 bytes (untyped_storage().resize_(0))"
        mod.unshard_(fulls, shards)
        out.square().sum().backward()
        mod.reshard_(fulls)
    reference(x).square().sum().backward()
    for i, (f, p) in enumerate(zip(fulls, reference.parameters(), strict=True)):
        assert f.grad is not None and torch.equal(f.grad, p.grad), (  # the same arithmetic: the same bits
            f"rank {rank}: gradient of parameter {i} after gather/free/gather is not the plain module's")
    assert "all_gather" in tracer.summary(), "no all_gather seen: use refimpl.comm.ops.all_gather_into_tensor"


def check_unshard(path: str) -> None:
    from exercises.rank_batch import run_ranks

    mod = load_module(path)
    full = nn.Parameter(torch.zeros(2, 3))
    probe_stub(mod.reshard_, [full])
    probe_stub(mod.unshard_, [full], [torch.ones(2, 3)])
    run_ranks(_unit_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


# ------------------------------------------------------------------------------------------ 04.4 / 04.5
UNITS = 3


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4)) for _ in range(UNITS)])


def _chain_on_rank(ctx, path: str, prefetch: bool) -> list:
    from refimpl.comm.tracer import CommTracer

    mod = load_module(path)
    rank, world = ctx.rank, ctx.world_size
    reference, chain = _chain(), _chain()
    fulls: list[list[nn.Parameter]] = []
    shards: list[list[torch.Tensor]] = []
    for unit in chain:
        unit_fulls, unit_shards = [], []
        for m in unit.modules():
            for name, p in list(m._parameters.items()):
                full = nn.Parameter(torch.empty_like(p))
                full.untyped_storage().resize_(0)
                unit_shards.append(p.detach()[slice(*_rows(p.shape[0], rank, world))].clone())
                m._parameters[name] = full
                unit_fulls.append(full)
        fulls.append(unit_fulls)
        shards.append(unit_shards)

    def held() -> set[int]:
        return {u for u, fs in enumerate(fulls) if any(f.untyped_storage().nbytes() > 0 for f in fs)}

    log: list[tuple[str, int, set[int]]] = []
    for u, unit in enumerate(chain):  # the grader's probes, inside each unit: its first Linear
        def on_forward(module, args, u=u):
            log.append(("forward", u, held()))
            pairs = zip(fulls[u], reference[u].parameters(), strict=True)
            assert all(torch.equal(f.detach(), p.detach()) for f, p in pairs), (
                f"rank {rank}: unit {u} computes its forward with parameters that are not the full ones")

        def mark(module, args, out, u=u):
            out.register_hook(lambda grad, u=u: log.append(("backward", u, held())))

        unit[0].register_forward_pre_hook(on_forward)
        unit[0].register_forward_hook(mark)
    mod.install_unit_hooks(list(chain), fulls, shards, prefetch=prefetch)
    with CommTracer() as tracer:
        for step in range(2):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            out = chain(x)
            assert not held(), f"rank {rank}: after the chain's forward units {sorted(held())} hold memory"
            out.square().sum().backward()
            assert not held(), f"rank {rank}: after backward units {sorted(held())} still hold memory"
            reference.zero_grad()
            reference(x).square().sum().backward()
            for u in range(UNITS):
                for i, (f, p) in enumerate(zip(fulls[u], reference[u].parameters(), strict=True)):
                    assert f.grad is not None and torch.equal(f.grad, p.grad), (  # same arithmetic, same bits
                        f"rank {rank}, step {step}: the gradient of unit {u}'s parameter {i} is not the "
                        "plain chain's")
                    f.grad = None
            tracer.step()
    for step in range(2):
        gathers = len(tracer.select(op="all_gather", step=step))
        assert gathers == 2 * UNITS, (
            f"rank {rank}: {gathers} all-gathers in step {step}, want {2 * UNITS}: each unit once for "
            "forward and once for backward (gathered through your unshard_, so through refimpl.comm.ops)")
    return log


def _log_of(path: str, prefetch: bool) -> list:
    from exercises.rank_batch import run_ranks

    mod = load_module(path)
    probe_stub(mod.install_unit_hooks, [], [], [])
    return run_ranks(_chain_on_rank, WORLD, path, prefetch, timeout_s=TIMEOUT_S)[0]


def check_unit_schedule(path: str) -> None:
    for phase, u, held in _log_of(path, prefetch=False):
        assert held == {u}, (
            f"while unit {u} computes its {phase}, units {sorted(held)} hold memory; want only unit {u}"
            + (" (is every unit freed once its backward is over?)" if phase == "backward" else ""))


def check_unit_prefetch(path: str) -> None:
    for phase, u, held in _log_of(path, prefetch=True):
        if phase == "forward":
            want = {u, u + 1} if u + 1 < UNITS else {u}
            assert held == want, (f"with prefetch, while unit {u} computes its forward units {sorted(held)} "
                                  f"hold memory; want {sorted(want)}: the next unit gathered ahead, no other")
        else:
            want = {u, u - 1} if u > 0 else {u}
            assert want <= held, (f"with prefetch, while unit {u} computes its backward units {sorted(held)} "
                                  f"hold memory; want {sorted(want)} among them: the previous unit ahead")


# ------------------------------------------------------------------------------------------ 04.6
def _rows_2d(out: int, tp_rank: int, tp: int, dp_rank: int, dp: int) -> tuple[int, int]:
    """The tp rank's block of rows, then its dp chunk of that block, in rows of the full weight."""
    t0, t1 = _rows(out, tp_rank, tp)
    d0, d1 = _rows(t1 - t0, dp_rank, dp)
    return t0 + d0, t0 + d1


def _hint_2d(have: tuple[int, int], out: int, tp_rank: int, tp: int, dp_rank: int, dp: int) -> str:
    """What a wrong answer looks like it did, when it matches a known wrong rule."""
    if have == _rows(out, tp_rank * dp + dp_rank, tp * dp):
        return (" (that is chunk tp_rank * dp_size + dp_rank of the whole weight cut tp x dp ways: it agrees "
                "only when the rows divide; ZeRO-3 cuts the block the tp rank holds)")
    if have == _rows(out, dp_rank, dp):
        return " (that is the dp rows of the whole weight: ZeRO-3 over TP shards the tp rank's block)"
    t0, t1 = _rows(out, dp_rank, dp)
    d0, d1 = _rows(t1 - t0, tp_rank, tp)
    if have == (t0 + d0, t0 + d1):
        return " (that cuts dp first and tp inside it: tensor parallelism owns the block, ZeRO-3 cuts it)"
    return ""


def check_rows_of_2d_shard(path: str) -> None:
    mod = load_module(path)

    def rows(out: int, t: int, tp: int, d: int, dp: int) -> tuple[int, int]:
        return tuple(mod.rows_of_2d_shard(out, tp_rank=t, tp_size=tp, dp_rank=d, dp_size=dp))

    ranks = [(t, d) for t in range(2) for d in range(2)]
    got = [rows(192, t, 2, d, 2) for t, d in ranks]
    want = [(0, 48), (48, 96), (96, 144), (144, 192)]
    wrong = [(have, t, d) for have, w, (t, d) in zip(got, want, ranks, strict=True) if have != w]
    assert not wrong, (f"the 192 rows of chapter 04's query_key_value at tp 2 x dp 2 gave {got} for (tp, dp) "
                       f"= {ranks}; want {want}" + (_hint_2d(wrong[0][0], 192, wrong[0][1], 2, wrong[0][2], 2)
                                                    if wrong else ""))
    # uneven: dp chunks of a block (10 over tp 2 x dp 4), empty tp blocks (3 over tp 4), odd sizes
    for out, tp, dp in ((10, 2, 4), (3, 4, 2), (37, 2, 3), (259, 4, 4), (9, 3, 2), (5, 1, 4), (7, 4, 1)):
        for t in range(tp):
            for d in range(dp):
                want, have = _rows_2d(out, t, tp, d, dp), rows(out, t, tp, d, dp)
                assert have == want, (f"rows_of_2d_shard({out}, tp_rank={t}, tp_size={tp}, dp_rank={d}, "
                                      f"dp_size={dp}) = {have}, want {want}"
                                      + _hint_2d(have, out, t, tp, d, dp))
    for kw in (dict(tp_rank=2, tp_size=2, dp_rank=0, dp_size=2),
               dict(tp_rank=0, tp_size=2, dp_rank=2, dp_size=2)):
        try:
            mod.rows_of_2d_shard(8, **kw)
        except ValueError:
            continue
        raise AssertionError(f"rows_of_2d_shard(8, {kw}) must raise ValueError: a rank outside its group")


TASKS = [
    Task(name="04.1 shard_rows", points=3, check=check_shard_rows),
    Task(name="04.2 sharded_step (2 ranks)", points=4, check=check_sharded_step),
    Task(name="04.3 unshard_ and reshard_ around a unit (2 ranks)", points=3, check=check_unshard),
    Task(name="04.4 ZeRO-3 schedule: gather and free around forward and backward", points=3,
         check=check_unit_schedule),
    Task(name="04.5 ZeRO-3 prefetch of the next unit", points=2, check=check_unit_prefetch),
    Task(name="04.6 rows_of_2d_shard: ZeRO-3 over tensor parallelism", points=2,
         check=check_rows_of_2d_shard),
]

# Plausible wrong answers, each of which must fail its own task and only that one
# (tests/course/cli/test_exercises.py).
MUTANTS = {
    "04.1 shard_rows": '''
from exercises.reference.ch04 import *  # noqa: F403


def shard_rows(rows, rank, world_size):
    chunk = rows // world_size  # floor: the last rows belong to nobody
    return rank * chunk, (rank + 1) * chunk
''',
    "04.2 sharded_step (2 ranks)": '''
import torch
import torch.distributed as dist

from exercises.reference.ch04 import *  # noqa: F403
from refimpl.comm import ops
from refimpl.parallel.zero import ShardSpec, all_gather_into, pack_for_reduce_scatter, unpack_reduce_scatter


def sharded_step(params, shards, optimizer, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    stepped = []
    for p, shard in zip(params, shards):
        if p.grad is None:
            continue
        spec = ShardSpec(p.shape, rank, n)
        packed = pack_for_reduce_scatter([p.grad], [spec])
        out = packed.new_empty(packed.shape[1])
        ops.reduce_scatter_tensor(out, packed.view(-1), group=group)  # the sum: never divided by n
        shard.grad = unpack_reduce_scatter(out, [spec])[0].clone()
        stepped.append((p, shard, spec))
    optimizer.step()
    with torch.no_grad():
        for p, shard, spec in stepped:
            all_gather_into([shard], [spec], [p.detach()], group)
            shard.grad = None
''',
    "04.3 unshard_ and reshard_ around a unit (2 ranks)": '''
import torch
import torch.distributed as dist

from exercises.reference.ch04 import *  # noqa: F403
from refimpl.parallel.zero import ShardSpec, all_gather_into


def unshard_(fulls, shards, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    for f in fulls:
        f.untyped_storage().resize_(f.numel() * f.element_size())
    with torch.no_grad():  # writes into the parameter itself: its version counter moves
        specs = [ShardSpec(f.shape, rank, n) for f in fulls]
        all_gather_into(list(shards), specs, list(fulls), group)
''',
    "04.4 ZeRO-3 schedule: gather and free around forward and backward": '''
from exercises.reference.ch04 import *  # noqa: F403
from exercises.reference.ch04 import reshard_, unshard_


def install_unit_hooks(units, fulls, shards, group=None, *, prefetch=False):
    gathered, ready, handles = [False] * len(units), [0] * len(units), []

    def gather(u):
        if 0 <= u < len(units) and not gathered[u]:
            unshard_(fulls[u], shards[u], group)
            gathered[u] = True

    def free(u):
        reshard_(fulls[u])
        gathered[u] = False

    def pre(u):
        def hook(module, args):
            gather(u)
            if prefetch:
                gather(u + 1)
        return hook

    def post(u):
        def hook(module, args, output):
            free(u)

            def before_backward(grad):
                gather(u)
                if prefetch:
                    gather(u - 1)
            output.register_hook(before_backward)
        return hook

    def on_grad(u):
        def hook(param):
            ready[u] += 1
            if ready[u] == len(fulls[u]):
                ready[u] = 0
                if u == 0:  # backward is over: free every unit now (a unit is freed only at the end)
                    for v in range(len(units)):
                        free(v)
        return hook

    for u, unit in enumerate(units):
        handles += [unit.register_forward_pre_hook(pre(u)), unit.register_forward_hook(post(u))]
        handles += [f.register_post_accumulate_grad_hook(on_grad(u)) for f in fulls[u]]
    return handles
''',
    "04.5 ZeRO-3 prefetch of the next unit": '''
from exercises.reference.ch04 import *  # noqa: F403
from refimpl.parallel.zero import install_unit_hooks as _gather_when_needed


def install_unit_hooks(units, fulls, shards, group=None, *, prefetch=False):
    return _gather_when_needed(units, fulls, shards, group)  # the prefetch flag is ignored
''',
    "04.6 rows_of_2d_shard: ZeRO-3 over tensor parallelism": [
        '''
from exercises.reference.ch04 import *  # noqa: F403
from refimpl.distributed.placement import chunk_range


def rows_of_2d_shard(out_features, *, tp_rank, tp_size, dp_rank, dp_size):
    chunk_range(out_features, tp_rank, tp_size)  # the tp rank is checked, then forgotten:
    return chunk_range(out_features, dp_rank, dp_size)  # the dp rows of the whole weight, not of the block
''',
        '''
from exercises.reference.ch04 import *  # noqa: F403
from refimpl.distributed.placement import chunk_range


def rows_of_2d_shard(out_features, *, tp_rank, tp_size, dp_rank, dp_size):
    if not 0 <= dp_rank < dp_size:
        raise ValueError(dp_rank)
    # one flat cut into tp x dp chunks: right whenever the rows divide, wrong on uneven blocks
    return chunk_range(out_features, tp_rank * dp_size + dp_rank, tp_size * dp_size)
''',
    ],
}
