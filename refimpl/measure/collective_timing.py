"""Latency and bandwidth measured: collectives and point-to-point messages timed per size (chapter 02).

What the alpha-beta (Hockney) model ``T(S) = alpha + S / beta`` is fitted to
(``refimpl.planner.fit_alpha_beta``; Thakur, Rabenseifner & Gropp, IJHPCA 2005, price the collectives
with it):

* ``measure_p2p``: ping-pong between two ranks, one-way time = half the round trip;
* ``measure_collective``: any collective, e.g. ``ops.all_reduce`` or ``ring_all_reduce``.

Buffers are made on the process group's device (``group_device``: ``cuda:<current>`` under NCCL, which
moves CUDA tensors only, the CPU under gloo) unless ``device`` names one; the GPU is synchronised around each
timed call, since a collective on NCCL returns before it has run.

Each size is run ``warmup`` times unmeasured (connection setup, allocator, caches), then ``repeats`` times;
the time of one repeat is the slowest rank's, and the median over repeats is kept (robust to a stray
slow run on a shared machine). Timings on an oversubscribed CPU are only illustrative: docs/ARCHITECTURE.md
keeps absolute times out of assertions. ``refimpl.viz.plot_alpha_beta`` draws them against the fit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refimpl.comm import ops

__all__ = ["DEFAULT_SIZES", "Timings", "group_device", "measure_collective", "measure_p2p"]

DEFAULT_SIZES: tuple[int, ...] = (4, 64, 1024, 16 * 1024, 256 * 1024, 4 * 1024 * 1024)
"""Message sizes in bytes, from one float32 to 4 MiB."""


@dataclass(frozen=True, kw_only=True)
class Timings:
    """Median seconds of one ``op`` per message size, on ``world_size`` ranks (the same on every rank)."""

    op: str
    world_size: int
    sizes_bytes: tuple[int, ...]
    seconds: tuple[float, ...]
    repeats: int


def group_device(group=None) -> torch.device:
    """The device a collective on ``group`` (default: the default group) takes its tensors on: the current
    CUDA device when the group's backend is NCCL (it has no CPU path: "No backend type associated with device
    type cpu"), else the CPU (gloo; also without a process group)."""
    if not dist.is_initialized():
        return torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(values: list[float], device: torch.device, group) -> list[float]:
    """Element-wise max over the ranks (a repeat takes as long as its slowest rank)."""
    if group is None and not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # bookkeeping: not traced on purpose
    return t.tolist()


def measure_collective(
    fn: Callable[..., object],
    sizes_bytes: Sequence[int] = DEFAULT_SIZES,
    *,
    name: str | None = None,
    repeats: int = 5,
    warmup: int = 2,
    group=None,
    device: torch.device | str | None = None,
) -> Timings:
    """Median time of ``fn(buffer, group=group)`` on float32 buffers of each size. Call on every rank.

    ``fn`` is e.g. ``refimpl.comm.ops.all_reduce`` or ``refimpl.comm.ring.ring_all_reduce``.
    Buffers are zeros (sums stay finite however often they run) of ``max(1, size // 4)`` elements, on
    ``device`` (None: the rank's device for ``group``, ``group_device``).
    """
    device = group_device(group) if device is None else torch.device(device)
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    medians = []
    for size in sizes_bytes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)  # (size/4,)
        times = []
        for i in range(warmup + repeats):
            if n > 1:
                dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            fn(buf, group=group)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        medians.append(statistics.median(_slowest(times, device, group)))
    own_name: str = getattr(fn, "__name__", "collective")
    return Timings(op=name or own_name, world_size=n,
                   sizes_bytes=tuple(int(s) for s in sizes_bytes), seconds=tuple(medians), repeats=repeats)


def measure_p2p(
    sizes_bytes: Sequence[int] = DEFAULT_SIZES,
    *,
    src: int = 0,
    dst: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    group=None,
    device: torch.device | str | None = None,
) -> Timings:
    """One-way time of a message between group ranks ``src`` and ``dst``: half a ping-pong's round trip.

    Call on every rank of the group (the others wait); every rank gets the same ``Timings``. Uses
    blocking ``ops.send``/``ops.recv``, so an active tracer sees each message (the pair is ordered, send
    against receive, so NCCL's blocking unbatched calls meet). ``device``: as in ``measure_collective``.
    """
    device = group_device(group) if device is None else torch.device(device)
    rank, n = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    if n < 2 or src == dst or not (0 <= src < n and 0 <= dst < n):
        raise ValueError(f"need two distinct ranks of a group of at least 2; got src={src}, dst={dst}, n={n}")
    g_src, g_dst = ((src, dst) if group is None
                    else (dist.get_global_rank(group, src), dist.get_global_rank(group, dst)))
    medians = []
    for size in sizes_bytes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)  # (size/4,)
        times = []
        dist.barrier(group=group)
        for i in range(warmup + repeats):
            _sync(device)
            t0 = time.perf_counter()
            if rank == src:
                ops.send(buf, dst=g_dst, group=group)
                ops.recv(buf, src=g_dst, group=group)
            elif rank == dst:
                ops.recv(buf, src=g_src, group=group)
                ops.send(buf, dst=g_src, group=group)
            _sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - t0) / 2)
        medians.append(statistics.median(times) if rank == src else 0.0)
    t = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.broadcast(t, src=g_src, group=group)  # bookkeeping: src's clock is the measurement
    return Timings(op="p2p", world_size=2, sizes_bytes=tuple(int(s) for s in sizes_bytes),
                   seconds=tuple(t.tolist()), repeats=repeats)
