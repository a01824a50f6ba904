"""Restarts under torchrun, decided from the disk (chapter 11): the agent's counters, the resume decision,
and the torchrun command line and environment that start (and restart) the workers.

``TORCHELASTIC_RESTART_COUNT`` counts the restarts *of this agent*: for reports only. Whether to resume is
read from the checkpoints on disk and the job's ``TORCHELASTIC_RUN_ID`` (``resume_mode``). Every
launch sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``elastic_env``): with the rendezvous store
shared with the workers (torch's default), restarted gloo workers can read stale addresses and hang.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def restart_count() -> int:
    """How many times *this agent* restarted its workers (0 outside torchrun). For reports only."""
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


def run_id() -> str | None:
    """The job's rendezvous id (the same on every agent and restart of one torchrun job), or None."""
    return os.environ.get(RUN_ID_ENV) or None


def resume_mode(requested: str, folder: str | os.PathLike, job: str | None) -> str:
    """The resume mode to give the ``refimpl.checkpoint.Checkpointer``, decided from the disk.

    ``auto`` stays ``auto``. ``never`` becomes ``auto`` when every checkpoint in ``folder`` was written by
    the job ``job`` (a restart of this job continues its own run) and stays ``never`` (which refuses the
    folder) when any was written by another run or by an unknown one.
    """
    if requested != "never" or not job:
        return requested
    from refimpl.checkpoint import CheckpointError, list_checkpoints, read_manifest

    found = list_checkpoints(folder)
    if not found:
        return "never"
    for path in found:
        try:
            owner = read_manifest(path).get("state", {}).get("run_id")
        except CheckpointError:
            return "never"  # unreadable: not provably ours
        if owner != job:
            return "never"
    return "auto"


def elastic_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a torchrun launch: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see the module
    docstring), one intra-op thread per CPU rank, unbuffered output."""
    env = dict(os.environ if base is None else base)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                RESTART_COUNT_ENV, RUN_ID_ENV, "GROUP_RANK", "ROLE_RANK"):
        env.pop(var, None)  # a launch from inside a rank must not inherit that rank's identity
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def torchrun_command(args: Sequence[str], *, nproc_per_node: int, max_restarts: int = 0,
                     nnodes: str | None = None, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     rdzv_conf: str | None = None, module: str = "refimpl.train") -> list[str]:
    """``python -m torch.distributed.run ... -m module args``: standalone, or one agent of an elastic job
    (``nnodes="1:2"``, a c10d rendezvous at ``rdzv_endpoint`` named ``rdzv_id``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}",
           f"--max-restarts={max_restarts}"]
    if nnodes is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None or rdzv_id is None:
            raise ValueError("an elastic launch (nnodes) needs rdzv_endpoint and rdzv_id")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
        if rdzv_conf:
            cmd.append(f"--rdzv-conf={rdzv_conf}")
    return [*cmd, "-m", module, *args]
