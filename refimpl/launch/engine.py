"""The engine side of notebook ranks (``refimpl.launch.notebook``): what runs on each ipyparallel engine
(path, process group, device; teardown), and how a rank's failure comes back (``RankError`` with the
rank's traceback, ipyparallel's own frames dropped).

The engine functions are shipped with ``ipyparallel.interactive``: their globals are the engine's
namespace, so they import for themselves and leave ``rank``, ``world_size``, ``device``, ``dist`` and
``torch`` there for the ``%%px`` cells.
"""

from __future__ import annotations

import re
from typing import Any

from refimpl.launch.run_ranks import _exception_line

__all__ = ["RankError"]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class RankError(RuntimeError):
    """A function failed on one or more ranks; ``failures`` maps rank -> that rank's traceback text."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        short = [f"rank {r}: {_exception_line(tb)}" for r, tb in sorted(failures.items())]
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
        # short first (which rank, which assertion), the tracebacks after
        super().__init__("\n".join(short) + "\n\n" + "\n".join(parts))


def _clean_traceback(tb: str) -> str:
    """Drop colour codes and the frames of ipyparallel's own apply machinery from an engine traceback."""
    lines = _ANSI.sub("", tb).rstrip().splitlines()
    kept: list[str] = []
    skipping = False
    for line in lines:
        if line.startswith("File "):
            skipping = "ipyparallel/engine/kernel.py" in line or line.startswith("File <string>:1")
        if not skipping:
            kept.append(line)
    if lines and (not kept or kept[-1] != lines[-1]):
        kept.append(lines[-1])  # the exception line, whatever frame raised
    return "\n".join(kept)


def _failures(results: list[Any]) -> dict[int, str]:
    """Rank -> cleaned traceback for every failed AsyncResult (one per rank, in rank order)."""
    import ipyparallel as ipp

    failures: dict[int, str] = {}
    for rank, ar in enumerate(results):
        if not ar.ready():
            failures[rank] = "(no answer: still running, e.g. blocked in a collective)"
            continue
        try:
            ar.get(0)
        except ipp.error.RemoteError as e:
            elist = getattr(e, "elist", None) or [(e.ename, e.evalue, e.traceback, e.engine_info)]
            for ename, evalue, tb, _ in elist:
                failures[rank] = _clean_traceback(tb or f"{ename}: {evalue}")
    return failures


def _prepare_engine(paths: list[str]) -> None:
    """Runs on every engine first: extend sys.path, import torch (slow: do it before the clock starts)."""
    import sys

    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch.distributed  # noqa: F401


def _init_engine(
    rank_: int, world_size_: int, port: int, backend: str | None, timeout_s: float
) -> tuple[str, str]:
    """Runs on each engine (shipped as an interactive function): env, device, process group.

    It is self-contained (imports inside) because its globals are the engine's namespace, where it
    leaves ``rank``, ``world_size``, ``device``, ``dist`` and ``torch`` for the ``%%px`` cells. With
    ``REFIMPL_DEVICE_LINT=1`` the engine runs every later cell under the device lint
    (``refimpl.distributed.device_lint``): a host tensor reaching a collective fails the cell.
    """
    import datetime
    import os

    import torch
    import torch.distributed as dist

    env = {"RANK": rank_, "WORLD_SIZE": world_size_, "LOCAL_RANK": rank_, "LOCAL_WORLD_SIZE": world_size_}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the notebook's kernel hosts the store on ``port``
    if backend is None:
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size_
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", rank_)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend, rank=rank_, world_size=world_size_, timeout=datetime.timedelta(seconds=timeout_s)
    )
    globals().update(rank=rank_, world_size=world_size_, device=device, dist=dist, torch=torch)
    from refimpl.distributed.device_lint import DeviceLint, device_lint_enabled

    if device_lint_enabled() and "device_lint" not in globals():  # every %%px cell from now on, once
        globals()["device_lint"] = DeviceLint().__enter__()
    return str(device), backend


def _teardown_engine() -> None:
    """Runs on each engine at stop: destroy the process group if there is one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
