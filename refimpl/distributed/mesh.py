"""The layout of the ranks: ``ParallelDims`` (``pp x dp x cp x tp``) and one process group per axis.

Chapter 12 (the 3D trainer) explains it; chapters 06 (tensor), 07 (context) and 08 (pipeline) use it. The
ranks ``0 .. W-1`` are arranged as a 4-D grid of shape ``(pp, dp, cp, tp)`` in row-major order, so that

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i,        W = pp * dp * cp * tp.

**Why this order** (Megatron-LM, Shoeybi et al. 2019, and Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters", section 3): the innermost axis gets adjacent ranks, and adjacent
ranks share a node on a GPU box (``torchrun`` numbers a node's GPUs consecutively). Tensor parallelism
all-reduces activations twice per layer in forward and twice in backward, on the critical path, so it must
run over NVLink: ``tp`` is innermost. Context parallelism passes key/value blocks around a ring every layer
(overlappable with attention): next to ``tp``. Data parallelism reduces gradients once per step (bucketed,
overlapped with backward): across nodes is fine. Pipeline parallelism sends one activation per micro-batch
between neighbouring stages, the least traffic of all: ``pp`` is outermost, spanning nodes.

The axes are data: ``AXES`` names them outermost first, ``ParallelDims.axes`` pairs them with
their degrees, and the arithmetic (coordinates, ``rank_of``, ``groups_of``) is
``refimpl.distributed.grid.RankGrid``'s, the same for any list of axes. A **view** is a named tuple of
axes whose group is built too (``VIEWS``): ``loss`` = ``dp x cp``, ``batch`` = ``dp``.
``ParallelDims.refactor`` gives a second factorization of the same ranks (``dp -> dp_replicate x
dp_shard``, the expert view ``ep`` inside ``dp x cp``) whose groups ``build_groups`` creates the same way.

``ParallelDims`` holds the degrees only (pure arithmetic, no process group): its checks run before any
process starts. ``ParallelDims.build`` creates the groups on an initialised default group and returns
``ParallelGroups``, built once per rank and passed explicitly (no global). The loss and the gradients of
data parallelism are averaged over the ``dp x cp`` group (the ranks that see different tokens of the same
model shard). ``ParallelDims.device_mesh`` gives torch's ``DeviceMesh`` with the same axis names, to
compare with DTensor (``parallelize_module``, ``fully_shard``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from refimpl.config import ConfigError, ParallelConfig
from refimpl.distributed.grid import RankGrid

AXES = ("pp", "dp", "cp", "tp")  # outermost first: the row-major order of the rank grid
LOSS_AXES = ("dp", "cp")  # the loss and data-parallel gradients are averaged over these
BATCH_AXES = ("dp",)  # the ranks that read different sequences (cp splits one sequence, tp and pp share it)
VIEWS: tuple[tuple[str, tuple[str, ...]], ...] = (("loss", LOSS_AXES), ("batch", BATCH_AXES))
"""The derived views, ``(name, axes)``: ``ParallelDims.build`` creates a group for each besides the
single axes (one already built, like ``batch``, is not built twice)."""
DESCRIBE_ORDER = ("dp", "cp", "tp", "pp")  # how ``ParallelDims.describe`` lists the degrees
HSDP_AXES = ("dp_replicate", "dp_shard")  # dp refactored for hybrid sharding: replicas outside shards
SHARD_AXES = ("dp_shard", "cp")  # HSDP's shard group: ZeRO-3 shards over these, replicates over dp_replicate
EXPERT_AXES = ("edp", "ep")  # dp x cp refactored for expert parallelism: ep innermost (torchtitan's dp2ep)
KEY_ORDER = ("pp", "dp", "dp_replicate", "dp_shard", "edp", "ep", "cp", "tp")  # the axes groups are keyed by


def group_name(*axes: str) -> str:
    """The name of the group of ``axes``, the one vocabulary of groups: a placement's axes
    (``refimpl.parallel.placements``), the keys of the bytes sent in ``metrics.jsonl`` and the planner's
    predictions of them. The axes in ``KEY_ORDER`` joined by `` x ``: ``group_name("cp", "dp")`` is
    ``"dp x cp"``, the expert groups ``"ep"`` and ``"edp"``, HSDP's ``"dp_shard x cp"`` and
    ``"dp_replicate"``."""
    unknown = sorted(set(axes) - set(KEY_ORDER))
    if unknown or not axes:
        raise ValueError(f"a group is named by axes of {KEY_ORDER}, not {axes}")
    return " x ".join(a for a in KEY_ORDER if a in axes)


@dataclass(frozen=True, kw_only=True)
class Coordinates:
    """One rank's position in the grid: ``rank = ((pp * DP + dp) * CP + cp) * TP + tp``."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees of the four parallel axes: data (``dp``), context (``cp``), tensor (``tp``), pipeline
    (``pp``). Their product is the world size; see the module docstring for the rank order and why.

    ``dp_replicate`` (HSDP, hybrid sharding; chapter 04): the ``dp`` ranks as ``dp_replicate x dp_shard``,
    replicas outermost (torchtitan's ``[pp, dp_replicate, dp_shard, cp, tp]``), so a shard group is
    ``dp / dp_replicate`` adjacent ranks (inside a node) and a replica group spans the nodes. The rank
    order is unchanged: the same ranks, a second factorization of ``dp`` (``refactor``).

    ``ep`` (expert parallelism, chapter 09): a second view of the same ranks. The ``dp x cp`` ranks (the
    ones that see different tokens) refactored as ``edp x ep``, ``ep`` innermost: an expert-parallel group
    is ``ep`` consecutive ranks of the ``dp x cp`` view (torchtitan's dp2ep; Megatron-LM's MoE parallel
    folding), an expert-data-parallel group (``edp = dp cp / ep``) the ranks that hold the same experts.
    Expert weights are split over ``ep`` and averaged over ``edp``, dense ones averaged over ``dp x cp``
    (``expert_grid``). ``ep`` must divide ``dp x cp``; every other group and the rank order are
    unchanged."""

    dp: int
    cp: int = 1
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in (*AXES, "dp_replicate", "ep"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"the {axis} degree must be a positive integer, got {value!r}")
        if self.dp % self.dp_replicate:
            raise ConfigError(f"dp_replicate {self.dp_replicate} must divide dp {self.dp} (HSDP: dp = "
                              "dp_replicate x dp_shard)")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"ep {self.ep} must divide dp x cp = {self.dp} x {self.cp} (the expert-parallel"
                              " groups are carved out of the ranks that see different tokens)")

    @property
    def edp(self) -> int:
        """The expert-data-parallel degree ``dp x cp / ep``: the ranks that hold the same experts."""
        return self.dp * self.cp // self.ep

    @property
    def dp_shard(self) -> int:
        """The ranks of a shard group along dp: ``dp / dp_replicate``."""
        return self.dp // self.dp_replicate

    @classmethod
    def from_world(cls, world_size: int, *, dp: int | None = None, cp: int = 1, tp: int = 1,
                   pp: int = 1, dp_replicate: int = 1, ep: int = 1) -> ParallelDims:
        """The layout of ``world_size`` ranks; ``dp`` defaults to ``world_size / (tp * pp * cp)``."""
        if dp is None:
            others = cls(dp=1, cp=cp, tp=tp, pp=pp).world_size  # checks the given degrees first
            if world_size % others:
                raise ConfigError(f"world size {world_size} is not divisible by tp x pp x cp = {tp} x {pp} "
                                  f"x {cp} = {others}")
            dp = world_size // others
        dims = cls(dp=dp, cp=cp, tp=tp, pp=pp, dp_replicate=dp_replicate, ep=ep)
        dims.check(world_size)
        return dims

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """The grid as data: ``((name, degree), ...)`` in ``AXES`` order, outermost first."""
        return tuple((axis, getattr(self, axis)) for axis in AXES)

    @property
    def grid(self) -> RankGrid:
        return RankGrid(axes=self.axes)

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The grid's shape in ``AXES`` order ``(pp, dp, cp, tp)``."""
        return self.grid.shape  # type: ignore[return-value]

    def describe(self) -> str:
        hsdp = (f" (dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard})" if self.dp_replicate > 1
                else "")
        experts = f" (experts: ep {self.ep} x edp {self.edp})" if self.ep > 1 else ""
        return " x ".join(f"{axis} {getattr(self, axis)}" for axis in DESCRIBE_ORDER) + hsdp + experts

    def config(self, **options: Any) -> ParallelConfig:
        """The ``refimpl.config.ParallelConfig`` of this layout with the technique ``options``
        (``dims.config(zero_stage=1)``): what ``refimpl.parallel.parallelize`` takes."""
        return ParallelConfig(dp=self.dp, cp=self.cp, tp=self.tp, pp=self.pp, dp_replicate=self.dp_replicate,
                              ep=self.ep, **options)

    def check(self, world_size: int) -> None:
        """Refuse a layout whose product is not the world size."""
        if self.world_size != world_size:
            raise ConfigError(f"the layout {self.describe()} = {self.world_size} ranks does not match the "
                              f"world size {world_size}")

    def rank_of(self, coords: Coordinates) -> int:
        return self.grid.rank_of(asdict(coords))

    def coordinates(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1} of {self.describe()}")
        return Coordinates(**self.grid.coordinates(rank))

    def groups_of(self, *axes: str) -> list[tuple[int, ...]]:
        """Every group spanning ``axes`` (the other coordinates fixed), ranks ascending, in a fixed order:
        all ranks must create the groups in the same order (gloo's and NCCL's ``new_group`` rule)."""
        return self.grid.groups_of(*axes)

    def view(self, name: str) -> tuple[str, ...]:
        """The axes of the derived view ``name`` (``VIEWS``: ``"loss"`` is ``("dp", "cp")``)."""
        views = dict(VIEWS)
        if name not in views:
            raise KeyError(f"no view {name!r}; there are {sorted(views)}")
        return views[name]

    def refactor(self, old: tuple[str, ...], new: tuple[tuple[str, int], ...]) -> RankGrid:
        """A second factorization of the same ranks (``RankGrid.refactor``), e.g. ``("dp",)`` ->
        ``(("dp_replicate", R), ("dp_shard", S))``; every rank keeps its number and the other axes their
        groups. HSDP builds its groups from it (``hsdp_grid``), expert parallelism too
        (``expert_grid``)."""
        return self.grid.refactor(old, new)

    @property
    def hsdp_grid(self) -> RankGrid:
        """The grid with ``dp`` as ``dp_replicate x dp_shard`` (HSDP's groups; the same rank numbers)."""
        return self.refactor(("dp",), (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)))

    @property
    def expert_grid(self) -> RankGrid:
        """The grid with ``dp x cp`` as ``edp x ep``, ``ep`` innermost (the same rank numbers): rank ``r``
        of the ``dp x cp`` view (``dp_i * cp + cp_i``) is expert-parallel rank ``r % ep`` of group
        ``r // ep``."""
        return self.refactor(("dp", "cp"), (("edp", self.edp), ("ep", self.ep)))

    def build(self, *, rank: int, world_size: int, timeout_s: float,
              backend: str | None = None) -> ParallelGroups:
        """Create the groups of every axis and of every view (``dp x cp``) (collective: every rank calls it,
        after ``init_process_group``) and keep this rank's. ``backend`` defaults to the default group's.

        ``timeout_s`` bounds every collective on these groups (pass ``ctx.timeout_s``): without it torch
        gives a new group its 30-minute default, and a hung rank would stall the others for 30 minutes
        instead of failing them within the run's timeout (``tests/ranks/cli/serial/test_elastic.py``'s hung
        rank)."""
        self.check(world_size)
        keys = [(a,) for a in AXES] + [axes for _, axes in VIEWS]
        groups, members = build_groups(self.grid, keys, rank=rank, world_size=world_size,
                                       timeout_s=timeout_s, backend=backend)
        if self.dp_replicate > 1:  # HSDP: the groups of the second factorization of dp
            hsdp, hsdp_members = build_groups(self.hsdp_grid, [("dp_replicate",), SHARD_AXES], rank=rank,
                                              world_size=world_size, timeout_s=timeout_s, backend=backend)
            groups, members = groups | hsdp, members | hsdp_members
        if self.ep > 1:  # expert parallelism: the groups of the second factorization of dp x cp
            expert, expert_members = build_groups(self.expert_grid, [(a,) for a in EXPERT_AXES], rank=rank,
                                                  world_size=world_size, timeout_s=timeout_s, backend=backend)
            groups, members = groups | expert, members | expert_members
        return ParallelGroups(dims=self, rank=rank, coords=self.coordinates(rank), groups=groups,
                              members=members)

    def device_mesh(self, device_type: str):
        """torch's ``DeviceMesh`` of the same grid, dims named ``("pp", "dp", "cp", "tp")`` (collective)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)


def build_groups(grid: RankGrid, keys: list[tuple[str, ...]], *, rank: int, world_size: int, timeout_s: float,
                 backend: str | None = None) -> tuple[dict[tuple[str, ...], dist.ProcessGroup],
                                                      dict[tuple[str, ...], tuple[int, ...]]]:
    """Create every group of each axis tuple in ``keys`` (collective: all ranks, same order), keep this
    rank's, and warm them up (``warm_up``). A key is put in grid order; a repeated one is built once.
    Returns ``(groups, members)`` keyed by the axis tuple."""
    if not dist.is_initialized():
        raise RuntimeError("ParallelDims.build needs an initialised default process group "
                           "(refimpl.distributed.init_distributed)")
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"rank {rank} of {world_size} given, but the default group says rank "
                           f"{dist.get_rank()} of {dist.get_world_size()}")
    if grid.world_size != world_size:
        raise RuntimeError(f"the grid {grid.axes} has {grid.world_size} ranks, not {world_size}")
    timeout = timedelta(seconds=timeout_s)
    groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
    members: dict[tuple[str, ...], tuple[int, ...]] = {}
    for axes in dict.fromkeys(tuple(a for a in grid.names if a in key) for key in keys):
        for ranks in grid.groups_of(*axes):  # all of them, on every rank, in the same order
            group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
            if rank in ranks:
                groups[axes], members[axes] = group, ranks
    warm_up(groups)
    return groups, members


def warm_up(groups: dict[tuple[str, ...], dist.ProcessGroup]) -> None:
    """One barrier on each of this rank's groups, in the same order on every rank, before any send.

    NCCL creates a group's communicator lazily, at the group's first call, and torch documents that when
    ``batch_isend_irecv`` is that first call "all ranks of the group must participate", otherwise the
    behaviour is undefined. A pipeline's or a ring's first batched exchange involves two ranks of the group
    only, so every group gets a collective here, where all its ranks are present. The groups of one axis are
    disjoint and every rank walks the axes in the same order, so the barriers cannot wait on each other in a
    cycle. On gloo they cost a few milliseconds; the call is the same on both backends so that CPU runs it.
    """
    for axes in sorted(groups):
        dist.barrier(group=groups[axes])


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """This rank's process groups, one per axis and one per view (``dp x cp``), from
    ``ParallelDims.build``."""

    dims: ParallelDims
    rank: int
    coords: Coordinates
    groups: dict[tuple[str, ...], dist.ProcessGroup] = field(repr=False)
    members: dict[tuple[str, ...], tuple[int, ...]]

    def group(self, *axes: str) -> dist.ProcessGroup:
        """The group of ``axes``: one axis name, or ``"dp", "cp"`` for the loss and gradient average."""
        return self.groups[self._key(axes)]

    def ranks(self, *axes: str) -> tuple[int, ...]:
        """The global ranks of this rank's group of ``axes``, ascending."""
        return self.members[self._key(axes)]

    def named(self) -> dict[str, dist.ProcessGroup]:
        """Every group by its ``group_name``."""
        return {group_name(*axes): g for axes, g in self.groups.items()}

    def view(self, name: str) -> dist.ProcessGroup:
        """The group of the view ``name`` (``VIEWS``): ``view("loss")`` is ``group("dp", "cp")``."""
        return self.group(*self.dims.view(name))

    def _key(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        key = tuple(a for a in KEY_ORDER if a in axes)
        if key not in self.groups or len(key) != len(axes):
            raise KeyError(f"no group for axes {axes}; there are {sorted(self.groups)}")
        return key
