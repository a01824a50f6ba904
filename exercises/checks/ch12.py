"""Checks of chapter 12's exercises (``exercises/12_3d_parallelism.py``); see exercises/grading.py.

All in one process, integer and float arithmetic:

* ``rank_coordinates`` / ``axis_groups``: over layouts of 1 to 24 ranks with every axis degree 1-3 (odd
  sizes included), every rank's coordinates must satisfy ``rank = ((pp_i dp + dp_i) cp + cp_i) tp + tp_i``
  (the formula itself, not refimpl's code) and lie inside the grid; out-of-range ranks raise ``ValueError``.
  The groups along each single axis and along ``("dp", "cp")`` must partition the ranks, have the axes'
  product as size, and hold exactly the ranks that agree with the first member in the other coordinates
  (checked from ``refimpl.distributed.ParallelDims``, a different implementation); bad axis names
  raise ``ValueError``.
* ``state_bytes_per_gpu``: worked by hand for 1.6e10 parameters at dp 4 x cp 2 x tp 2 x pp 2 (stages 0-3),
  then on a grid of layouts and stages against ``refimpl.planner.zero_memory_paper`` of the GPU's
  share, relative error 1e-12; ``zero_stage = 4`` raises ``ValueError``.

* ``gradient_average_group`` / ``counted_in_grad_norm``: graded against refimpl's trainer code on 8 ranks
  (``refimpl.launch.run_ranks``, once per process): at dp 1 x cp 2 x tp 2 x pp 2 each rank runs
  ``refimpl.parallel.parallelize.parallelize`` and the trainer's optimizer setup
  (``refimpl.parallel.parallelize.Parallelized.build_optimizer``) on a tied and an untied GPT, reports the
  ranks of the process group it averages gradients over, and fills every gradient it holds with random
  values of a random norm; the global norm the trainer's clipping computes must equal the one the learner's
  counting gives (relative 1e-5; one gradient counted twice or not at all moves it by about 1%). The average
  group is also checked against ``refimpl.distributed.ParallelDims.groups_of`` over the grid of layouts.

``MUTANTS``: plausible wrong implementations, one per task or a list (tests/course/cli/test_exercises.py
grades each and expects its task alone to fail): tp taken as the outermost axis; ZeRO sharded over dp only (cp
forgotten); gradients averaged over dp only (cp forgotten), replicated parameters counted on every tp rank,
the tied embedding's pipeline copy counted twice.
"""

from __future__ import annotations

import functools
import itertools
import math

from exercises.grading import Task, load_module
from refimpl.distributed import ParallelDims
from refimpl.planner import zero_memory_paper

AXES = ("pp", "dp", "cp", "tp")
LAYOUTS = [dict(zip(AXES, d, strict=True)) for d in itertools.product((1, 2, 3), repeat=4)
           if d[0] * d[1] * d[2] * d[3] <= 24]


def _raises_value_error(fn, *args, **kwargs) -> bool:
    try:
        fn(*args, **kwargs)
    except ValueError:
        return True
    return False


def check_grid(path: str) -> None:
    module = load_module(path)
    coords, groups = module.rank_coordinates, module.axis_groups
    for layout in LAYOUTS:
        world = layout["pp"] * layout["dp"] * layout["cp"] * layout["tp"]
        where = "dp {dp} x cp {cp} x tp {tp} x pp {pp}".format(**layout)
        for rank in range(world):
            got = coords(rank, **layout)
            assert isinstance(got, tuple) and len(got) == 4, (
                f"{where}: return (pp_i, dp_i, cp_i, tp_i), got {got!r}")
            p, d, c, t = got
            inside = all(0 <= v < layout[a] for v, a in zip(got, AXES, strict=True))
            assert inside, f"{where}, rank {rank}: coordinates {got} outside the grid {layout}"
            back = ((p * layout["dp"] + d) * layout["cp"] + c) * layout["tp"] + t
            assert back == rank, (
                f"{where}, rank {rank}: (pp, dp, cp, tp) = {got} gives rank {back} by "
                "((pp_i dp + dp_i) cp + cp_i) tp + tp_i: tp is the innermost axis, it varies fastest")
        for bad in (-1, world):
            assert _raises_value_error(coords, bad, **layout), f"{where}: rank {bad} must raise ValueError"
        ref = ParallelDims(**layout)
        for axes in (("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp")):
            got = groups(axes, **layout)
            size = 1
            for a in axes:
                size *= layout[a]
            assert sorted(r for g in got for r in g) == list(range(world)), (
                f"{where}, axes {axes}: the groups must hold every rank once, got {got}")
            assert got == sorted(got, key=lambda g: g[0]), f"{where}, axes {axes}: sort groups by first rank"
            for g in got:
                assert list(g) == sorted(g) and len(g) == size, (
                    f"{where}, axes {axes}: group {g} must be ascending with {size} ranks")
                first = ref.coordinates(g[0])
                same = [r for r in range(world) if all(
                    getattr(ref.coordinates(r), a) == getattr(first, a) for a in AXES if a not in axes)]
                assert list(g) == same, (
                    f"{where}, axes {axes}: rank {g[0]}'s group is {same} (the ranks that agree with it "
                    f"outside {axes}), got {g}")
    for bad in (("xx",), ("tp", "tp"), ()):
        assert _raises_value_error(groups, bad, dp=2, cp=1, tp=2, pp=1), f"axes {bad} must raise ValueError"


def check_state(path: str) -> None:
    fn = load_module(path).state_bytes_per_gpu
    n, layout = 1.6e10, {"dp": 4, "cp": 2, "tp": 2, "pp": 2}  # 4e9 parameters per GPU, ZeRO over 8 ranks
    by_hand = {0: (8e9, 8e9, 48e9), 1: (8e9, 8e9, 6e9), 2: (8e9, 1e9, 6e9), 3: (1e9, 1e9, 6e9)}
    for stage, want in by_hand.items():
        got = fn(n, **layout, zero_stage=stage)
        values = (got.weights, got.grads, got.optimizer)
        assert all(abs(g - w) <= 1e-9 * w for g, w in zip(values, want, strict=True)), (
            f"N = 1.6e10 at dp 4 x cp 2 x tp 2 x pp 2, ZeRO-{stage}: (weights, grads, optimizer) = {values}, "
            f"want {want} (N / (tp pp) = 4e9 per GPU; ZeRO shards over the dp x cp = 8 ranks)")
    for layout in LAYOUTS:
        for stage in (0, 1, 2, 3):
            got = fn(7.3e9, **layout, zero_stage=stage)
            share = 7.3e9 / (layout["tp"] * layout["pp"])
            want = zero_memory_paper(share, layout["dp"] * layout["cp"], stage)
            for field in ("weights", "grads", "optimizer"):
                g, w = getattr(got, field), getattr(want, field)
                assert abs(g - w) <= 1e-12 * w, f"{layout}, ZeRO-{stage}: {field} {g}, want {w}"
    assert _raises_value_error(fn, 1e9, dp=2, cp=1, tp=1, pp=1, zero_stage=4), "ZeRO-4 must raise ValueError"


# ---- task 3: the gradients' average group and the norm's counting, against the trainer's code -------------

RUN_LAYOUT = {"dp": 1, "cp": 2, "tp": 2, "pp": 2}


def _gradients_on_rank(ctx, layout: dict) -> dict:
    """This rank's average group and, per tie setting, its stage, its gradients' squared norms by name and
    the global norm the trainer's clipping computes from them."""
    import torch
    import torch.distributed as dist

    from refimpl.config import ModelConfig, OptimConfig
    from refimpl.models import GPT
    from refimpl.parallel.parallelize import parallelize

    groups = ParallelDims(**layout).build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=60)
    out: dict = {}
    for tied in (True, False):
        config = ModelConfig(vocab_size=64, num_layers=4, hidden_size=16, num_attention_heads=2,
                             max_seq_len=8, tie_word_embeddings=tied)
        par = parallelize(GPT(config), groups)
        setup = par.build_optimizer(OptimConfig(grad_clip=1e9))
        out["group"] = tuple(dist.get_process_group_ranks(par.group))
        gen = torch.Generator().manual_seed(1000 * ctx.rank + tied)
        squares = {}
        for name, p in par.pipeline.named_parameters_full():
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            norm2 = 1 + float(torch.rand((), generator=gen, dtype=torch.float64))  # in [1, 2): none alike
            p.grad = (g * math.sqrt(norm2) / g.norm()).to(p.dtype)
            squares[name] = float(p.grad.double().square().sum())
        (stage,) = par.pipeline.stage_ids
        out[tied] = {"stage": stage, "squares": squares, "norm": float(setup.clip_fn(None))}
    return out


@functools.cache
def _trainer_gradients() -> tuple[dict, ...]:
    """The 8 ranks' reports (one run per process: every graded module is compared with the same run)."""
    from refimpl.launch import run_ranks

    world = math.prod(RUN_LAYOUT.values())
    return tuple(run_ranks(_gradients_on_rank, world, RUN_LAYOUT, timeout_s=120))


def check_gradients(path: str) -> None:
    module = load_module(path)
    average, counted = module.gradient_average_group, module.counted_in_grad_norm
    counted("final_layernorm.weight", stage=0, pp=1, tp_rank=0, tp=1, tied=False)  # a stub raises here
    for layout in LAYOUTS:
        ref = ParallelDims(**layout)
        for rank in range(ref.world_size):
            want = next(g for g in ref.groups_of("dp", "cp") if rank in g)
            got = average(rank, **layout)
            assert tuple(got) == want, (
                f"{ref.describe()}, rank {rank}: gradients averaged over {tuple(got)}, the trainer's group "
                f"is {want}")
    reports = _trainer_gradients()
    dims = ParallelDims(**RUN_LAYOUT)
    for rank, report in enumerate(reports):
        got = tuple(average(rank, **RUN_LAYOUT))
        assert got == report["group"], (
            f"at {dims.describe()}, rank {rank}: gradients averaged over {got}, the trainer's process group "
            f"holds {report['group']}")
    for tied in (True, False):
        for c in range(RUN_LAYOUT["cp"]):  # the norm is all-reduced over tp and pp: one per cp coordinate
            ranks = [r for r in range(dims.world_size) if dims.coordinates(r).cp == c]
            total = 0.0
            for rank in ranks:
                report = reports[rank][tied]
                for name, square in report["squares"].items():
                    if counted(name, stage=report["stage"], pp=RUN_LAYOUT["pp"],
                               tp_rank=dims.coordinates(rank).tp, tp=RUN_LAYOUT["tp"], tied=tied):
                        total += square
            yours, trainer = math.sqrt(total), reports[ranks[0]][tied]["norm"]
            assert abs(yours - trainer) <= 1e-5 * trainer, (
                f"at {dims.describe()} ({'tied' if tied else 'untied'} embeddings, random gradients on the "
                f"ranks {ranks}): your counting gives ||g|| = {yours:.6f}, the trainer's clipping computes "
                f"{trainer:.6f}: some gradient is counted on more than one rank, or on none")


TASKS = [
    Task(name="rank_coordinates, axis_groups", points=3, check=check_grid),
    Task(name="state_bytes_per_gpu", points=2, check=check_state),
    Task(name="gradient_average_group, counted_in_grad_norm", points=3, check=check_gradients),
]

_HEADER = "from exercises.reference.ch12 import *  # noqa: F403\n"
MUTANTS = {
    "rank_coordinates, axis_groups": _HEADER + (
        "from refimpl.distributed import ParallelDims\n"
        "def rank_coordinates(rank, *, dp, cp, tp, pp):  # tp taken as the outermost axis\n"
        "    if not 0 <= rank < dp * cp * tp * pp:\n"
        "        raise ValueError(rank)\n"
        "    rest, pp_i = divmod(rank, pp)\n"
        "    rest, cp_i = divmod(rest, cp)\n"
        "    tp_i, dp_i = divmod(rest, dp)\n"
        "    return (pp_i, dp_i, cp_i, tp_i)\n"
    ),
    "state_bytes_per_gpu": _HEADER + (
        "def state_bytes_per_gpu(num_params, *, dp, cp, tp, pp, zero_stage):  # cp forgotten\n"
        "    if zero_stage not in (0, 1, 2, 3):\n"
        "        raise ValueError(zero_stage)\n"
        "    share = num_params / (tp * pp)\n"
        "    return StateMemory(weights=2 * share / (dp if zero_stage >= 3 else 1),\n"
        "                       grads=2 * share / (dp if zero_stage >= 2 else 1),\n"
        "                       optimizer=12 * share / (dp if zero_stage >= 1 else 1))\n"
    ),
    "gradient_average_group, counted_in_grad_norm": [
        _HEADER + (
            "from refimpl.distributed import ParallelDims\n"
            "def gradient_average_group(rank, *, dp, cp, tp, pp):  # over dp only: cp forgotten\n"
            "    dims = ParallelDims(dp=dp, cp=cp, tp=tp, pp=pp)\n"
            "    return next(g for g in dims.groups_of('dp') if rank in g)\n"
        ),
        _HEADER + (
            "from exercises.reference import ch12 as _ref\n"
            "def counted_in_grad_norm(name, *, stage, pp, tp_rank, tp, tied):  # replicas counted tp times\n"
            "    return _ref.counted_in_grad_norm(name, stage=stage, pp=pp, tp_rank=0, tp=tp, tied=tied)\n"
        ),
        _HEADER + (
            "from exercises.reference import ch12 as _ref\n"
            "def counted_in_grad_norm(name, *, stage, pp, tp_rank, tp, tied):  # the tied copy counted too\n"
            "    return _ref.counted_in_grad_norm(name, stage=stage, pp=pp, tp_rank=tp_rank, tp=tp,\n"
            "                                     tied=False)\n"
        ),
    ],
}
