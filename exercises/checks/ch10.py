"""Checks of chapter 10's exercises (``exercises/10_3d_parallelism.py``); see exercises/grading.py.

All in one process, integer and float arithmetic:

* ``rank_coordinates`` / ``axis_groups``: over layouts of 1 to 24 ranks with every axis degree 1-3 (odd
  sizes included), every rank's coordinates must satisfy ``rank = ((pp_i dp + dp_i) cp + cp_i) tp + tp_i``
  (the formula itself, not refimpl's code) and lie inside the grid; out-of-range ranks raise ``ValueError``.
  The groups along each single axis and along ``("dp", "cp")`` must partition the ranks, have the axes'
  product as size, and hold exactly the ranks that agree with the first member in the other coordinates
  (checked from :class:`refimpl.distributed.ParallelDims`, a different implementation); bad axis names
  raise ``ValueError``.
* ``state_bytes_per_gpu``: worked by hand for 1.6e10 parameters at dp 4 x cp 2 x tp 2 x pp 2 (stages 0-3),
  then on a grid of layouts and stages against :func:`refimpl.planner.zero_memory_paper` of the GPU's
  share, relative error 1e-12; ``zero_stage = 4`` raises ``ValueError``.

``MUTANTS``: plausible wrong implementations, one per task (tests/test_exercises.py grades each and expects
its task alone to fail): tp taken as the outermost axis; ZeRO sharded over dp only (cp forgotten).
"""

from __future__ import annotations

import itertools

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


TASKS = [
    Task(name="rank_coordinates, axis_groups", points=3, check=check_grid),
    Task(name="state_bytes_per_gpu", points=2, check=check_state),
]

_HEADER = "from exercises.reference.ch10 import *  # noqa: F403\n"
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
}
