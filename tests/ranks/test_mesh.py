"""``ParallelDims`` (refimpl/distributed/mesh.py): the rank formula, the groups measured through real
collectives on 8 ranks, torch's ``DeviceMesh`` of the same layout, and bad layouts refused."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from refimpl.config import ConfigError
from refimpl.distributed import ParallelDims
from refimpl.distributed.group_info import group_rank_size
from refimpl.distributed.mesh import AXES, LOSS_AXES, VIEWS, Coordinates, build_groups
from refimpl.launch import run_ranks
from tests.support.timeouts import SPAWN_TIMEOUT_S

WORLD = 8
LAYOUTS = {  # name -> degrees
    "dp8": dict(dp=8),
    "dp2-tp2-pp2": dict(dp=2, tp=2, pp=2),
    "tp2-pp4": dict(dp=1, tp=2, pp=4),
    "dp2-cp4": dict(dp=2, cp=4),
}


def _formula_groups(dims: ParallelDims, axes: tuple[str, ...]) -> set[tuple[int, ...]]:
    """The groups straight from rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i, written out again."""
    groups: dict[tuple, list[int]] = {}
    for p, d, c, t in itertools.product(*(range(n) for n in dims.shape)):
        rank = ((p * dims.dp + d) * dims.cp + c) * dims.tp + t
        coords = dict(pp=p, dp=d, cp=c, tp=t)
        groups.setdefault(tuple(coords[a] for a in AXES if a not in axes), []).append(rank)
    return {tuple(sorted(g)) for g in groups.values()}


ALL_AXES = [(a,) for a in AXES] + [("dp", "cp")]

# Today's groups, printed by the hard-coded four-axis ParallelDims
# (git show 5cc94a3:refimpl/distributed/mesh.py) before the axes became data, and written out literally:
# the rework must reproduce them bitwise.
TODAY = {  # layout -> {axes: groups_of(*axes)} and "coords": [(pp, dp, cp, tp) of rank 0..7]
    "dp2-tp2-pp2": {
        ("pp",): [(0, 4), (1, 5), (2, 6), (3, 7)],
        ("dp",): [(0, 2), (1, 3), (4, 6), (5, 7)],
        ("cp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("tp",): [(0, 1), (2, 3), (4, 5), (6, 7)],
        ("dp", "cp"): [(0, 2), (1, 3), (4, 6), (5, 7)],
        "coords": [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1),
                   (1, 0, 0, 0), (1, 0, 0, 1), (1, 1, 0, 0), (1, 1, 0, 1)],
    },
    "dp8": {
        ("pp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("dp",): [(0, 1, 2, 3, 4, 5, 6, 7)],
        ("cp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("tp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("dp", "cp"): [(0, 1, 2, 3, 4, 5, 6, 7)],
        "coords": [(0, 0, 0, 0), (0, 1, 0, 0), (0, 2, 0, 0), (0, 3, 0, 0),
                   (0, 4, 0, 0), (0, 5, 0, 0), (0, 6, 0, 0), (0, 7, 0, 0)],
    },
    "pp2-tp4": {
        ("pp",): [(0, 4), (1, 5), (2, 6), (3, 7)],
        ("dp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("cp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("tp",): [(0, 1, 2, 3), (4, 5, 6, 7)],
        ("dp", "cp"): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        "coords": [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 3),
                   (1, 0, 0, 0), (1, 0, 0, 1), (1, 0, 0, 2), (1, 0, 0, 3)],
    },
    "cp2-dp2-tp2": {
        ("pp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("dp",): [(0, 4), (1, 5), (2, 6), (3, 7)],
        ("cp",): [(0, 2), (1, 3), (4, 6), (5, 7)],
        ("tp",): [(0, 1), (2, 3), (4, 5), (6, 7)],
        ("dp", "cp"): [(0, 2, 4, 6), (1, 3, 5, 7)],
        "coords": [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1),
                   (0, 1, 0, 0), (0, 1, 0, 1), (0, 1, 1, 0), (0, 1, 1, 1)],
    },
    "tp2-pp4": {
        ("pp",): [(0, 2, 4, 6), (1, 3, 5, 7)],
        ("dp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("cp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("tp",): [(0, 1), (2, 3), (4, 5), (6, 7)],
        ("dp", "cp"): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        "coords": [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1),
                   (2, 0, 0, 0), (2, 0, 0, 1), (3, 0, 0, 0), (3, 0, 0, 1)],
    },
    "dp2-cp4": {
        ("pp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("dp",): [(0, 4), (1, 5), (2, 6), (3, 7)],
        ("cp",): [(0, 1, 2, 3), (4, 5, 6, 7)],
        ("tp",): [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
        ("dp", "cp"): [(0, 1, 2, 3, 4, 5, 6, 7)],
        "coords": [(0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 2, 0), (0, 0, 3, 0),
                   (0, 1, 0, 0), (0, 1, 1, 0), (0, 1, 2, 0), (0, 1, 3, 0)],
    },
}

TODAY_DEGREES = {"dp2-tp2-pp2": dict(dp=2, tp=2, pp=2), "dp8": dict(dp=8), "pp2-tp4": dict(dp=1, pp=2, tp=4),
                 "cp2-dp2-tp2": dict(dp=2, cp=2, tp=2), "tp2-pp4": dict(dp=1, tp=2, pp=4),
                 "dp2-cp4": dict(dp=2, cp=4)}


@pytest.mark.parametrize("name", list(TODAY))
def test_groups_equal_todays_groups_written_out(name):
    """Axes as data changed no rank's number and no group: every axis, the loss view and the coordinates
    equal the table printed by the four-axis code, element by element and in the same order."""
    dims = ParallelDims(**TODAY_DEGREES[name])
    today = TODAY[name]
    for axes in ALL_AXES:
        assert dims.groups_of(*axes) == today[axes], (name, axes)
    assert dims.groups_of(*dims.view("loss")) == today[("dp", "cp")]
    assert dims.groups_of(*dims.view("batch")) == today[("dp",)]
    assert [tuple(getattr(dims.coordinates(r), a) for a in AXES) for r in range(WORLD)] == today["coords"]
    assert dims.axes == tuple((a, TODAY_DEGREES[name].get(a, 1)) for a in AXES)


def test_views_are_data():
    assert dict(VIEWS) == {"loss": LOSS_AXES, "batch": ("dp",)}
    with pytest.raises(KeyError, match="no view"):
        ParallelDims(dp=2).view("expert")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_groups_and_coordinates_follow_the_formula(name):
    dims = ParallelDims(**LAYOUTS[name])
    assert dims.world_size == WORLD
    for axes in ALL_AXES:
        groups = dims.groups_of(*axes)
        assert set(groups) == _formula_groups(dims, axes), axes
        assert sorted(r for g in groups for r in g) == list(range(WORLD))  # a partition of the ranks
    for rank in range(WORLD):
        c = dims.coordinates(rank)
        assert ((c.pp * dims.dp + c.dp) * dims.cp + c.cp) * dims.tp + c.tp == rank
        assert dims.rank_of(c) == rank


def test_tp_is_innermost_and_pp_outermost():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert dims.groups_of("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]  # adjacent ranks: one node
    assert dims.groups_of("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert dims.groups_of("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert dims.coordinates(5) == Coordinates(pp=1, dp=0, cp=0, tp=1)


def _measure_groups(ctx, layouts: dict[str, dict]) -> dict:
    out = {}
    for name, degrees in layouts.items():
        dims = ParallelDims(**degrees)
        groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
        measured = {}
        for axes in ALL_AXES:
            t = torch.tensor([float(ctx.rank)], dtype=torch.float64)
            dist.all_reduce(t, group=groups.group(*axes))
            size = torch.ones(1, dtype=torch.float64)
            dist.all_reduce(size, group=groups.group(*axes))
            measured[axes] = (groups.ranks(*axes), t.item(), size.item(),
                              tuple(dist.get_process_group_ranks(groups.group(*axes))),
                              group_rank_size(groups.group(*axes)))
        assert groups.view("loss") is groups.group(*LOSS_AXES) and sorted(groups.groups) == sorted(ALL_AXES)
        mesh = dims.device_mesh("cpu")
        torch_groups = {a: tuple(sorted(dist.get_process_group_ranks(mesh.get_group(a)))) for a in AXES}
        out[name] = (groups.coords, measured, torch_groups, mesh.mesh_dim_names)
    hsdp = ParallelDims(dp=4, tp=2).refactor(("dp",), (("dp_replicate", 2), ("dp_shard", 2)))
    built, members = build_groups(hsdp, [("dp_shard",), ("dp_replicate",)], rank=ctx.rank,
                                  world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    sums = {}
    for axes, group in built.items():
        t = torch.tensor([float(ctx.rank)], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        sums[axes] = (members[axes], t.item())
    return out, sums


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_groups_measured_through_real_collectives_on_8_ranks():
    ranks = run_ranks(_measure_groups, WORLD, LAYOUTS, timeout_s=SPAWN_TIMEOUT_S)
    hsdp = ParallelDims(dp=4, tp=2).refactor(("dp",), (("dp_replicate", 2), ("dp_shard", 2)))
    for rank, (_, sums) in enumerate(ranks):  # the second factorization's groups, built on the same ranks
        assert sorted(sums) == [("dp_replicate",), ("dp_shard",)]
        for axes, (members, rank_sum) in sums.items():
            assert members == hsdp.group_of(rank, *axes) and rank_sum == sum(members), (rank, axes)
    for name, degrees in LAYOUTS.items():
        dims = ParallelDims(**degrees)
        for rank, (result, _) in enumerate(ranks):
            coords, measured, torch_groups, names = result[name]
            assert coords == dims.coordinates(rank)
            assert names == AXES
            for axes in ALL_AXES:
                members, rank_sum, size, pg_ranks, rank_size = measured[axes]
                (expected,) = [g for g in _formula_groups(dims, axes) if rank in g]
                assert members == expected and tuple(sorted(pg_ranks)) == expected, (name, rank, axes)
                # measured through the real group: the sum of the rank ids is the sum of its members
                assert rank_sum == sum(expected) and size == len(expected), (name, rank, axes)
                assert rank_size == (expected.index(rank), len(expected)), (name, rank, axes)
            for axis in AXES:  # torch's DeviceMesh of the same layout has the same groups
                assert torch_groups[axis] == measured[(axis,)][0], (name, rank, axis)


def test_negative_control_another_order_would_be_caught():
    """A dp-innermost order (ranks 0, 1 in one dp group) differs from ours: the checks above can fail."""
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert (0, 1) not in dims.groups_of("dp") and (0, 1) in dims.groups_of("tp")
    assert set(dims.groups_of("tp")) != _formula_groups(ParallelDims(dp=2, tp=2, pp=2), ("dp",))


def _split_dp_formula(dims: ParallelDims, shard: int, axis: str) -> list[tuple[int, ...]]:
    """``dp = r * S + s`` (replicate outer, shard inner): rank = ((pp*DP + r*S + s) * CP + cp) * TP + tp;
    the group of ``axis`` is the ranks agreeing on every other coordinate."""
    groups: dict[tuple, list[int]] = {}
    for p, r, s, c, t in itertools.product(range(dims.pp), range(dims.dp // shard), range(shard),
                                           range(dims.cp), range(dims.tp)):
        rank = ((p * dims.dp + r * shard + s) * dims.cp + c) * dims.tp + t
        coords = dict(pp=p, dp_replicate=r, dp_shard=s, cp=c, tp=t)
        groups.setdefault(tuple(v for k, v in coords.items() if k != axis), []).append(rank)
    return sorted(tuple(g) for g in groups.values())


SPLITS = [(dict(dp=8), 4), (dict(dp=8), 2), (dict(dp=4, tp=2), 2), (dict(dp=4, pp=2), 2),
          (dict(dp=2, cp=2, tp=2), 1), (dict(dp=4, cp=2), 2)]


@pytest.mark.parametrize("degrees, shard", SPLITS)
def test_dp_split_into_replicate_x_shard_is_a_second_factorization_of_the_same_ranks(degrees, shard):
    dims = ParallelDims(**degrees)
    hsdp = dims.refactor(("dp",), (("dp_replicate", dims.dp // shard), ("dp_shard", shard)))
    assert hsdp.names == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and hsdp.world_size == WORLD
    for axis in ("dp_replicate", "dp_shard"):
        assert sorted(hsdp.groups_of(axis)) == _split_dp_formula(dims, shard, axis), axis
    for axis in ("pp", "cp", "tp"):  # the untouched axes keep their groups, in order
        assert hsdp.groups_of(axis) == dims.groups_of(axis)
    assert sorted(hsdp.groups_of("dp_replicate", "dp_shard")) == sorted(dims.groups_of("dp"))
    for rank in range(WORLD):  # every rank keeps its number: dp = r * S + s
        c, h = dims.coordinates(rank), hsdp.coordinates(rank)
        assert h["dp_replicate"] * shard + h["dp_shard"] == c.dp and hsdp.rank_of(h) == rank


def test_the_hsdp_layout_is_its_refactored_grid():
    """``ParallelDims(dp_replicate=R)`` (the trainer's ``--dp-replicate``) builds its groups from exactly
    this second factorization; R must divide dp; the layout names it."""
    dims = ParallelDims(dp=4, tp=2, dp_replicate=2)
    assert dims.hsdp_grid == dims.refactor(("dp",), (("dp_replicate", 2), ("dp_shard", 2)))
    assert dims.dp_shard == 2 and dims.grid == ParallelDims(dp=4, tp=2).grid  # the rank order is unchanged
    assert "dp_replicate 2 x dp_shard 2" in dims.describe()
    assert dims.config(zero_stage=3).dp_replicate == 2
    with pytest.raises(ConfigError, match="dp_replicate 3 must divide dp 4"):
        ParallelDims(dp=4, dp_replicate=3)


def test_expert_view_inside_dp_x_cp():
    """``ep`` inside the loss view: ``dp * CP + cp = e * EP + ep``, so an ep group is the ranks with the same
    (pp, efsdp, tp), consecutive blocks of ``EP`` loss-group positions."""
    dims = ParallelDims(dp=2, cp=2, tp=2)
    expert = dims.refactor(LOSS_AXES, (("efsdp", 2), ("ep", 2)))
    assert expert.groups_of("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert expert.groups_of("efsdp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    loss = dims.groups_of(*LOSS_AXES)
    assert all(any(set(g) <= set(lg) for lg in loss) for g in expert.groups_of("ep"))
    assert expert.groups_of("tp") == dims.groups_of("tp")
    whole = ParallelDims(dp=4, cp=2).refactor(LOSS_AXES, (("efsdp", 1), ("ep", 8)))
    assert whole.groups_of("ep") == [tuple(range(WORLD))]


def test_negative_control_the_other_split_order_and_bad_factorizations():
    """Shard outer, replicate inner would give other dp_shard groups (the formula test can fail); axes that
    are not adjacent, or a product that differs, are refused."""
    dims = ParallelDims(dp=4, tp=2)
    swapped = dims.refactor(("dp",), (("dp_shard", 2), ("dp_replicate", 2)))
    assert sorted(swapped.groups_of("dp_shard")) != _split_dp_formula(dims, 2, "dp_shard")
    with pytest.raises(ValueError, match="not adjacent"):
        ParallelDims(dp=2, tp=2, pp=2).refactor(("pp", "tp"), (("x", 4),))
    with pytest.raises(ValueError, match="ranks per block"):
        dims.refactor(("dp",), (("dp_replicate", 2), ("dp_shard", 3)))


def test_group_rank_size_without_a_process_group():
    assert not dist.is_initialized()
    assert group_rank_size(None) == (0, 1)
    with pytest.raises(RuntimeError, match="not initialised"):
        group_rank_size(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("degrees, fragment", [
    (dict(dp=3, tp=2), "does not match the world size 8"),
    (dict(dp=16), "does not match the world size 8"),
])
def test_product_not_the_world_size_is_refused(degrees, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        ParallelDims(**degrees).check(WORLD)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("degrees", [dict(dp=0), dict(dp=2, tp=-1), dict(dp=2, pp=0), dict(dp=2, cp=1.5),
                                     dict(dp=True)])
def test_zero_negative_or_non_integer_degree_is_refused(degrees):
    with pytest.raises(ConfigError, match="degree must be a positive integer"):
        ParallelDims(**degrees)


def test_from_world_defaults_dp_and_refuses_what_does_not_divide():
    assert ParallelDims.from_world(8, tp=2) == ParallelDims(dp=4, tp=2)
    assert ParallelDims.from_world(8, tp=2, pp=2, cp=2) == ParallelDims(dp=1, cp=2, tp=2, pp=2)
    with pytest.raises(ConfigError, match="not divisible by tp x pp x cp"):
        ParallelDims.from_world(8, tp=3)
    with pytest.raises(ConfigError, match="does not match the world size 8"):
        ParallelDims.from_world(8, dp=2, tp=2)


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        ParallelDims(2, 1, 1, 1)  # type: ignore[misc]
    dims = ParallelDims(dp=2)
    with pytest.raises(AttributeError):
        dims.dp = 4  # type: ignore[misc]


GROUP_TIMEOUT_S = 3.0


def _stall_on_the_dp_group(ctx, timeout_s: float) -> float | None:
    """Rank 1 never joins an all-reduce on the dp group; rank 0 returns how long it waited for it."""
    import time

    groups = ParallelDims(dp=2).build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=timeout_s)
    group = groups.group("dp")
    if ctx.rank == 1:
        time.sleep(GROUP_TIMEOUT_S + 8)
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError:
        return time.monotonic() - t0
    return float("inf")  # the collective completed: impossible without rank 1


@pytest.mark.timeout(120)
def test_a_built_group_times_out_within_the_given_timeout():
    """A hung rank must fail the others within the run's collective timeout on the layout's groups too
    (torch gives a ``new_group`` without a timeout 30 minutes, not the default group's). The default
    group's timeout here is 50 s, so only the layout group's own 3 s can end the wait this early; without
    ``timeout_s`` in ``build`` the wait outlasts rank 1 and tests/ranks/cli/serial/test_elastic.py's hung rank
    fails."""
    waited = run_ranks(_stall_on_the_dp_group, 2, GROUP_TIMEOUT_S, timeout_s=60,
                       collective_timeout_s=50)[0]
    assert waited is not None and GROUP_TIMEOUT_S - 0.5 <= waited <= GROUP_TIMEOUT_S + 5, waited



def _record_warm_up(ctx) -> tuple[list[tuple[int, ...]], dict]:
    """The groups ``build`` runs a barrier on, in order (``dist.barrier`` wrapped on this rank only)."""
    seen, barrier = [], dist.barrier

    def recording(group=None, **kwargs):
        seen.append(tuple(sorted(dist.get_process_group_ranks(group))))
        return barrier(group=group, **kwargs)

    dist.barrier = recording
    try:
        groups = ParallelDims(pp=2, dp=2).build(rank=ctx.rank, world_size=ctx.world_size,
                                                timeout_s=ctx.timeout_s)
    finally:
        dist.barrier = barrier
    return seen, {axes: groups.ranks(*axes) for axes in ALL_AXES}


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_build_runs_one_collective_on_each_group_before_any_send():
    """NCCL's rule for ``batch_isend_irecv``: when it is a group's first call, every rank of the group must
    take part. A pipeline's first exchange involves two ranks of the pp group only, so ``build`` runs one
    barrier on each of this rank's groups, in the same order everywhere
    (remove ``warm_up`` and this fails)."""
    for rank, (seen, mine) in enumerate(run_ranks(_record_warm_up, 4, timeout_s=SPAWN_TIMEOUT_S)):
        assert sorted(seen) == sorted(mine.values()), (rank, seen, mine)
        assert seen == [mine[axes] for axes in sorted(mine)], (rank, seen)  # one order on every rank
