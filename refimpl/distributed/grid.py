"""The rank grid as data: named axes ``((name, degree), ...)``, outermost first, in row-major order.

``refimpl.distributed.mesh.ParallelDims`` is one such grid, ``(pp, dp, cp, tp)``; this
module holds the arithmetic that does not depend on which axes there are. With axes ``a_0 .. a_{k-1}`` of
degrees ``n_0 .. n_{k-1}`` (``a_0`` outermost) a rank's coordinates ``c_i`` satisfy

    rank = (...((c_0 * n_1 + c_1) * n_2 + c_2) ...) * n_{k-1} + c_{k-1},      W = n_0 * ... * n_{k-1},

and the group of a set of axes is the ranks that agree on every other coordinate.

**A second factorization of the same ranks** (``RankGrid.refactor``): a run of adjacent axes
``a_i .. a_j`` can be replaced by other axes ``b_0 .. b_m`` of the same product. The row-major index of the
run is the same number whichever way it is factored, so every rank keeps its number and the untouched axes
keep their groups; only the new axes' groups are new. Splitting ``dp`` into ``dp_replicate x dp_shard``
(HSDP: shard within a node, replicate across) is ``refactor(("dp",), (("dp_replicate", R),
("dp_shard", S)))`` with ``dp = r * S + s``; the expert view (torchtitan's ``efsdp x ep``, experts sharded
over the ranks that see different tokens) is ``refactor(("dp", "cp"), (("efsdp", E), ("ep", P)))``.
Nothing here creates a process group: ``refimpl.distributed.mesh.build_groups`` does, for any grid.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RankGrid:
    """Ranks ``0 .. W-1`` as a row-major grid over named ``axes`` (``(name, degree)``, outermost first)."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = self.names
        if not names or len(set(names)) != len(names):
            raise ValueError(f"axis names must be distinct and at least one, got {names}")
        for name, degree in self.axes:
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ValueError(f"the {name} degree must be a positive integer, got {degree!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(degree for _, degree in self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def degree(self, name: str) -> int:
        return dict(self.axes)[name]

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The row-major rank of ``coords`` (one coordinate per axis)."""
        if set(coords) != set(self.names):
            raise ValueError(f"coordinates {sorted(coords)} do not name the axes {self.names}")
        rank = 0
        for name, degree in self.axes:
            value = coords[name]
            if not 0 <= value < degree:
                raise ValueError(f"coordinate {name}={value} outside 0..{degree - 1}")
            rank = rank * degree + value
        return rank

    def coordinates(self, rank: int) -> dict[str, int]:
        """The inverse of ``rank_of``: peel the innermost axis off first."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        coords: dict[str, int] = {}
        for name, degree in reversed(self.axes):
            rank, coords[name] = divmod(rank, degree)
        return {name: coords[name] for name in self.names}

    def groups_of(self, *axes: str) -> list[tuple[int, ...]]:
        """Every group spanning ``axes`` (the other coordinates fixed), ranks ascending, in a fixed order
        (the fixed axes' coordinates row-major, outermost first): all ranks must create the groups in the
        same order (gloo's and NCCL's ``new_group`` rule)."""
        unknown = [a for a in axes if a not in self.names]
        if unknown or not axes or len(set(axes)) != len(axes):
            raise ValueError(f"axes must be distinct names from {self.names}, got {axes}")
        fixed = [a for a in self.names if a not in axes]
        groups = []
        for outer in itertools.product(*(range(self.degree(a)) for a in fixed)):
            base = dict(zip(fixed, outer, strict=True))
            members = [self.rank_of(base | dict(zip(axes, inner, strict=True)))
                       for inner in itertools.product(*(range(self.degree(a)) for a in axes))]
            groups.append(tuple(sorted(members)))
        return groups

    def group_of(self, rank: int, *axes: str) -> tuple[int, ...]:
        """The group of ``axes`` that holds ``rank``."""
        (group,) = [g for g in self.groups_of(*axes) if rank in g]
        return group

    def refactor(self, old: tuple[str, ...], new: tuple[tuple[str, int], ...]) -> RankGrid:
        """The same ranks with the adjacent axes ``old`` (outermost first) replaced by ``new`` (same product).

        Every rank keeps its number: the row-major index over ``old`` equals the one over ``new``, because
        both are the rank's position inside the block the outer axes fix, divided by the inner axes' size."""
        names = self.names
        if not old or any(a not in names for a in old):
            raise ValueError(f"axes {old} are not all axes of {names}")
        start = names.index(old[0])
        if names[start:start + len(old)] != old:
            raise ValueError(f"axes {old} are not adjacent and in order in {names}")
        before = math.prod(self.degree(a) for a in old)
        after = math.prod(degree for _, degree in new)
        if before != after:
            raise ValueError(f"{old} has {before} ranks per block, the new axes {new} have {after}")
        return RankGrid(axes=self.axes[:start] + tuple(new) + self.axes[start + len(old):])
