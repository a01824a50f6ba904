"""Process-group setup from the torchrun environment, device choice, seeding and teardown (chapter 00).

``torchrun`` (and our own launchers) describe a rank with environment variables: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. From them :func:`init_distributed`
builds a :class:`DistributedContext`: NCCL and ``cuda:LOCAL_RANK`` when CUDA is there, else gloo on the
CPU with one thread per rank. A missing environment means a single process (world size 1), so the same
script runs under ``python`` and under ``torchrun``. Every collective gets an explicit timeout so a rank
that dies or stalls turns into an error instead of a hang.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class DistributedContext:
    """Who this process is: rank, world size, local rank, device, backend, and the collective timeout its
    process groups were created with (every group made later must get it too: torch gives a ``new_group``
    without one its 30-minute default, not the default group's)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float = 300.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def choose_device(local_rank: int, local_world_size: int | None = None) -> tuple[torch.device, str]:
    """``(cuda:local_rank, "nccl")`` when every rank of this node gets a GPU, else ``(cpu, "gloo")``.

    All ranks must make the same choice: one rank on NCCL and another on gloo would hang at the first
    collective, so 2 ranks on a 1-GPU box both use the CPU.
    """
    n = local_world_size if local_world_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= max(n, local_rank + 1):
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(*, timeout_s: float = 300.0, backend: str | None = None) -> DistributedContext:
    """Initialise the default process group from the environment (or a world of one without it)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device, default_backend = choose_device(local_rank)
    backend = backend or default_backend
    if device.type == "cpu":
        torch.set_num_threads(1)  # N ranks on N cores: one thread each, or they fight over the cores
    else:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeError(f"WORLD_SIZE={world_size} but {var} is not set; launch with torchrun")
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistributedContext(
        rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend,
        timeout_s=timeout_s,
    )


def seed_everything(seed: int, *, rank: int = 0) -> None:
    """Seed Python, NumPy and torch with ``seed + rank`` (per-rank streams, e.g. for dropout).

    Model initialisation does not use these streams (it takes its own generator), so all ranks still
    start from the same weights.
    """
    s = seed + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def log0(ctx: DistributedContext, *args: object) -> None:
    """Print on rank 0 only, flushed (several ranks share one terminal)."""
    if ctx.rank == 0:
        print(*args, flush=True)


def all_reduce_mean(value: float, ctx: DistributedContext) -> float:
    """The mean of a Python float over all ranks (for logging)."""
    if ctx.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.item() / ctx.world_size


def teardown() -> None:
    """Destroy the process group if there is one; safe to call twice."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except Exception as exc:  # a peer already gone: still release our resources
            print(f"teardown: barrier failed ({exc}); destroying the group anyway", file=sys.stderr)
        dist.destroy_process_group()
