"""Process-group setup from the torchrun environment, device choice, seeding and teardown (chapter 00).

``torchrun`` (and our own launchers) describe a rank with environment variables: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. From them ``init_distributed``
builds a ``DistributedContext``: NCCL and ``cuda:LOCAL_RANK`` when CUDA is there (``cuda:0`` when each
process is shown one GPU of its own), else gloo on the CPU with one thread per rank; an explicit backend
decides the device, and too few GPUs for the local ranks is an error, never a silent CPU run
(``choose_device``). A missing environment means a single process (world size 1), so the same
script runs under ``python`` and under ``torchrun``. Every collective gets an explicit timeout so a rank
that dies or stalls turns into an error instead of a hang.

**A rank never outlives its launcher** (``exit_with_parent``). A launcher that is SIGKILLed (a job
timeout, ``kill -9``, an OOM kill) cannot stop its ranks, and a rank blocked in a receive would wait there
until killed by hand. So a rank started by ``torchrun`` (``TORCHELASTIC_RUN_ID`` in the environment) asks,
when ``init_distributed`` sets it up, to die with its parent: on
Linux the kernel sends it SIGKILL when the parent exits (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, through
ctypes); elsewhere a daemon thread polls ``os.getppid()`` every half second and SIGKILLs the rank when it
changes. Right after, the parent is compared with the one read before the request: a parent that died in
between is not watched by the kernel any more, so the rank exits at once. What stays open is the time
before ``init_distributed`` runs (the interpreter's start and ``import torch``, a second or two): a
launcher killed then leaves a rank whose parent is already the reaper; it fails at its first collective,
within the timeout. Under ``PR_SET_PDEATHSIG`` "the parent" is the thread that forked the rank: torchrun
forks from its main thread. The ranks of ``refimpl.launch.run_ranks`` are not the caller's children
(a fork server's, which outlives the caller as long as they live): they watch the caller by its pid
(``exit_with_process``).
"""

from __future__ import annotations

import ctypes
import os
import random
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
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


BACKENDS = ("gloo", "nccl")


def choose_device(local_rank: int, local_world_size: int | None = None, *, backend: str | None = None,
                  shared_view: bool = False) -> tuple[torch.device, str]:
    """This rank's ``(device, backend)``, the same rule on every rank of a node.

    1. An explicit ``backend`` decides the device: ``"gloo"`` -> the CPU (even on a GPU box: a CPU run asked
       for); ``"nccl"`` -> a GPU as in 3-4 (a RuntimeError without CUDA: NCCL moves CUDA tensors only).
    2. No CUDA -> ``(cpu, "gloo")``.
    3. At least as many GPUs as local ranks -> ``(cuda:local_rank, "nccl")``.
    4. Exactly one visible GPU while the node runs several ranks -> ``(cuda:0, "nccl")``: one GPU per
       process, each rank shown its own (Slurm's ``--gpus-per-task``, one GPU per Kubernetes container,
       ``CUDA_VISIBLE_DEVICES`` set per rank).
    5. Otherwise (CUDA there, fewer GPUs than local ranks, not one each) -> a RuntimeError naming the counts
       and the two ways out (``--backend gloo``, ``CUDA_VISIBLE_DEVICES=""``).

    Why no silent CPU fallback: a GPU job that trains on its CPUs runs on for hours at a hundredth of the
    speed and reports nothing wrong (it used to, whenever each process saw one GPU). Why every rank must
    decide alike: one rank on NCCL and another on gloo would hang at the first collective.
    ``local_world_size``: the ranks on this node (default ``LOCAL_WORLD_SIZE``, else 1). ``shared_view``:
    the caller knows that every local rank sees the devices it sees (the self-launcher, whose torchrun
    children inherit its environment), so one GPU for several ranks is the shortage of rule 5, not rule 4.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "gloo":
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        if backend == "nccl":
            raise RuntimeError("backend nccl needs CUDA, and torch.cuda.is_available() is False on this "
                               "machine; use --backend gloo (CPU ranks)")
        return torch.device("cpu"), "gloo"
    n = local_world_size if local_world_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ranks, gpus = max(n, local_rank + 1), torch.cuda.device_count()
    if gpus >= ranks:
        return torch.device("cuda", local_rank), "nccl"
    if gpus == 1 and not shared_view:
        return torch.device("cuda", 0), "nccl"
    raise RuntimeError(
        f"{ranks} ranks on this node but {gpus} visible GPU(s) (torch.cuda.device_count()), and not one per "
        f"rank: NCCL needs a GPU of its own for each rank. Start at most {gpus} ranks per node, give each "
        "rank its own GPU (CUDA_VISIBLE_DEVICES per rank), or train on the CPU: --backend gloo, or "
        "CUDA_VISIBLE_DEVICES=\"\" to hide the GPUs")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>: the signal this process gets when its parent thread exits


def set_parent_death_signal(sig: int = 9) -> bool:
    """Linux: ``prctl(PR_SET_PDEATHSIG, sig)`` (default 9, SIGKILL) through ctypes; True if the kernel took
    it, False elsewhere.

    It survives ``execve`` (so a ``preexec_fn`` can give it to a child program), not ``fork``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(int(sig)), ctypes.c_ulong(0),
                          ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):
        return False


def _kill_self() -> None:
    """SIGKILL this process, as the kernel's death signal would (Windows has no SIGKILL: terminate)."""
    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


def _poll_parent(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _kill_self()


def exit_with_parent(parent_pid: int | None = None, *, use_prctl: bool = True, poll_s: float = 0.5) -> str:
    """Make this process die when its parent does (module docstring); returns how: "prctl" or "poll".

    ``parent_pid``: the parent expected (default: ``os.getppid()`` now). The race is closed by looking
    again after the request: a parent other than the expected one means it is already gone (the rank was
    handed to a reaper), and this process kills itself. ``use_prctl=False`` takes the fallback of systems
    without ``prctl`` (a daemon thread polling ``os.getppid()`` every ``poll_s``), e.g. to test it."""
    parent = os.getppid() if parent_pid is None else parent_pid
    how = "prctl" if use_prctl and set_parent_death_signal() else "poll"
    if how == "poll":
        threading.Thread(target=_poll_parent, args=(parent, poll_s), name="exit-with-parent",
                         daemon=True).start()
    if os.getppid() != parent:  # the parent died before anything watched it
        _kill_self()
    return how


def _poll_process(pid: int, poll_s: float) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:  # it exists, under another user
            pass
        time.sleep(poll_s)
    _kill_self()


def _wait_pidfd(fd: int) -> None:
    select.select([fd], [], [])  # readable once the process has exited (a zombie counts)
    _kill_self()


def exit_with_process(pid: int, *, poll_s: float = 0.5) -> str:
    """Make this process die when process ``pid`` (not its parent) exits; returns how: "pidfd" or "poll".

    For a rank whose launcher is not its parent: ``refimpl.launch.run_ranks`` forks ranks from a fork
    server, which lives as long as any of them does (each holds its "alive" pipe), so the ranks watch the
    caller itself. A daemon thread waits on a pidfd (Linux 5.3 and later: woken the moment ``pid`` exits);
    elsewhere it polls ``os.kill(pid, 0)`` every ``poll_s`` (a dead ``pid`` that nobody reaped stays a
    zombie, which that poll cannot tell from a live one). A ``pid`` already gone kills this process now."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        _kill_self()
        raise  # not reached: SIGKILL ends the process first
    except (AttributeError, OSError):  # no pidfd: not Linux, an old kernel, not permitted
        fd = None
    if fd is None:
        thread = threading.Thread(target=_poll_process, args=(pid, poll_s), name="exit-with-process",
                                  daemon=True)
    else:
        thread = threading.Thread(target=_wait_pidfd, args=(fd,), name="exit-with-process", daemon=True)
    thread.start()
    return "poll" if fd is None else "pidfd"


def preexec_exit_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess``: the child program dies with this process (Linux; None elsewhere,
    where a child program cannot be made to). Used by the trainer's self-launch for its torchrun."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()  # read before the fork: the child compares its parent with it after the prctl

    def preexec() -> None:
        set_parent_death_signal()
        if os.getppid() != parent:  # this process died between the fork and the prctl
            os._exit(1)

    return preexec


def init_distributed(*, timeout_s: float = 300.0, backend: str | None = None,
                     watch_parent: bool | None = None) -> DistributedContext:
    """Initialise the default process group from the environment (or a world of one without it).

    ``backend``: ``"gloo"`` (CPU ranks, also on a GPU box) or ``"nccl"`` (GPU ranks); None: the device and
    backend ``choose_device`` picks. ``watch_parent``: die with the launcher (``exit_with_parent``);
    default: when ``torchrun`` started this process (``TORCHELASTIC_RUN_ID`` is set)."""
    if watch_parent if watch_parent is not None else "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent()  # first, before anything can block
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device, backend = choose_device(local_rank, backend=backend)
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
