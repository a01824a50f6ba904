"""``group_rank_size(group)``: this rank's index in a process group and the group's size, in one place.

The tensor-, context-, data-parallel and ZeRO code each had their own (``group_size``/``group_rank``,
``cp_size``/``cp_rank``, ``_group_size``, ``_world``); they now call this one. ``None`` is the default group,
as in torch. Without an initialised default group a single process is the whole world, ``(0, 1)``, so a
layer built with no group runs on one device (the tests' one-device references); asking about a given
group then is a mistake and is refused.
"""

from __future__ import annotations

import torch.distributed as dist


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank in group, ranks in group)``; ``(0, 1)`` when ``group`` is None and torch.distributed is not
    initialised (one process); a ``RuntimeError`` when a group is given but nothing is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
