"""What chapter 06's checks share (``exercises/checks/ch06.py``, ``ch06_sequence.py``): the 4-rank world
split into two tensor-parallel pairs, integer-valued data, the collectives expected per pass.

Every multi-rank task runs on ``WORLD = 4`` ranks (``refimpl.launch.run_ranks``) as two groups of
``T = 2``, ranks {0, 1} and {2, 3}, each pair with its own data (``pair_seed``): an answer that takes
the world's rank or size, or makes its collectives over the world, computes with the wrong block or sums
the other pair's numbers, and fails. A group of the rank alone checks that the identity of ``t = 1`` holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

WORLD, T = 4, 2
TIMEOUT_S = 90


@dataclass(frozen=True)
class Groups:
    """My tensor-parallel ``pair``, a group of this rank ``alone``, the pair's index, my rank in the pair."""

    pair: dist.ProcessGroup
    alone: dist.ProcessGroup
    index: int
    rank: int


def groups() -> Groups:
    """Every rank creates every group (new_group is collective over the world), in the same order."""
    me = dist.get_rank()
    pairs = [dist.new_group(list(range(k, k + T))) for k in range(0, WORLD, T)]
    alone = [dist.new_group([r]) for r in range(WORLD)]
    return Groups(pair=pairs[me // T], alone=alone[me], index=me // T, rank=me % T)


def pair_seed(seed: int, g: Groups) -> int:
    """A seed that differs between the two pairs (the same on both ranks of a pair)."""
    return seed + 1000 * g.index


def ints(shape: tuple[int, ...], seed: int, device: torch.device, bound: int = 4) -> torch.Tensor:
    """Integer-valued float32 in [-bound, bound]: sums of a few products are exact, so results are bitwise."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-bound, bound + 1, shape, generator=gen).float().to(device)


def expect(tracer, step: int, want: list[tuple[str, int]], where: str) -> None:
    """The collectives of ``step`` (0: forward, 1: backward) are ``want``, as (op, payload bytes)."""
    got = [(e.op, e.nbytes) for e in tracer.select(step=step)]
    assert got or not want, (f"{where}: no collective seen; make it with refimpl.comm.ops (ops.all_reduce, "
                             "ops.all_gather_into_tensor, ops.reduce_scatter_tensor) so that the grader's "
                             "tracer sees it")
    assert got == want, f"{where}: saw {got} (op, bytes); want {want or 'no collective'}"


def raises_value_error(fn, what: str, why: str) -> None:
    """``fn()`` must raise ValueError (a size that does not divide)."""
    try:
        fn()
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - the message says what was raised instead
        raise AssertionError(f"{what} raised {type(exc).__name__}; want ValueError ({why})") from None
    raise AssertionError(f"{what} must raise ValueError: {why}")
