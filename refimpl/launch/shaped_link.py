"""Ranks behind a rate-limited link: ``run_ranks`` inside a private network namespace whose loopback is
shaped to a given bandwidth, where communication, not the cores, sets the pace (for measuring overlap).

On two CPU cores over raw loopback communication is nearly free: gloo's copy threads compete with the
matmuls for the same cores, so overlapping the two cannot be seen. Behind a link of, say, 400 Mbit/s the
link is the bottleneck and the cores are free, as between GPUs across a network.

``run_ranks(fn, n, ..., link="400mbit")`` runs the ranks this way: the caller starts one helper process with
``unshare -rn`` (a new user and network namespace, no privileges needed where the kernel allows unprivileged
user namespaces), the helper brings the namespace's loopback up, attaches an ``htb`` queueing discipline to it
(``tc qdisc add dev lo root handle 1: htb default 10``, one class at ``rate`` = ``ceil`` = the link), then
calls ``refimpl.launch.run_ranks`` there (``refimpl.launch.shaped_helper``), so every rank's traffic
(the rendezvous store included) crosses the shaped loopback, and pickles the results back. The namespace
disappears with the helper. ``shaped_link_unavailable`` says why a machine cannot do it (no ``unshare`` or
``tc``, user namespaces refused); tests skip with that reason. The helper dies with its caller (a parent-death
signal and a watch of the caller's pid), and the ranks with the helper, as always."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from refimpl.launch.timed import one_timed_run_at_a_time, raise_this_process

__all__ = ["check_link", "run_shaped", "shape_loopback", "shaped_link_unavailable"]

RATE = re.compile(r"^(\d+(\.\d+)?)(kbit|mbit|gbit)$")


def check_link(link: str) -> str:
    """``link`` as ``tc`` takes it (``400mbit``, ``1gbit``, ``2.5gbit``); a ``ValueError`` otherwise."""
    if not isinstance(link, str) or not RATE.match(link.strip().lower()):
        raise ValueError(f"link={link!r}: give a rate such as '400mbit' or '1gbit' (kbit, mbit or gbit)")
    return link.strip().lower()


def shape_loopback(rate: str) -> None:
    """Inside the namespace: loopback up, one ``htb`` class at ``rate`` for all of its traffic."""
    for cmd in (["ip", "link", "set", "lo", "up"],
                ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10"],
                ["tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", rate,
                 "ceil", rate]):
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def shaped_link_unavailable() -> str | None:
    """Why this machine cannot shape a link (a sentence), or None when it can: ``unshare`` and ``tc``
    installed (Debian's util-linux and iproute2) and an unprivileged user namespace allowed."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install util-linux iproute2)"
    probe = subprocess.run(["unshare", "-rn", "tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode:
        return f"no private network namespace here (unshare -rn: {probe.stderr.strip() or probe.returncode})"
    return None


def run_shaped(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, *,
               link: str, priority: int = 0) -> tuple:
    """``refimpl.launch.run_ranks`` behind ``link`` (module docstring): ``("ok", results)``, or
    ``("error", rank, message)`` for ``run_ranks`` to raise as ``refimpl.launch.RankFailed``.
    ``priority`` > 0 starts the helper in a session of its own and raises its and so the ranks' scheduling
    priority by that much, the session's too (``refimpl.launch.timed.raise_this_process``; where allowed,
    e.g. as root): timings on a machine busy with other work then see the cores the ranks need. Such a
    timed run waits for any other on the machine to end first (``one_timed_run_at_a_time``)."""
    from refimpl.distributed.env import preexec_exit_with_parent

    rate = check_link(link)
    why = shaped_link_unavailable()
    if why is not None:
        raise RuntimeError(f"link={rate!r}: {why}")
    timeout_s = float(kwargs.get("timeout_s", 120.0))
    with tempfile.TemporaryDirectory(prefix="shaped-") as tmp:
        request, reply = Path(tmp) / "request.pkl", Path(tmp) / "reply.pkl"
        request.write_bytes(pickle.dumps((fn, world_size, args, kwargs, os.getpid())))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        die_with_caller = preexec_exit_with_parent()

        def preexec() -> None:
            if priority > 0:  # in a session of its own (start_new_session): its autogroup is the ranks'
                raise_this_process(priority)
            if die_with_caller is not None:
                die_with_caller()

        with one_timed_run_at_a_time() if priority > 0 else contextlib.nullcontext():
            proc = subprocess.run(["unshare", "-rn", sys.executable, "-m", "refimpl.launch.shaped_helper",
                                   str(request), str(reply), rate], env=env, capture_output=True, text=True,
                                  timeout=timeout_s + 60, preexec_fn=preexec, start_new_session=priority > 0)
        if not reply.exists():
            return ("error", None, f"the shaped-link helper exited with {proc.returncode} without a result:\n"
                                   f"{proc.stderr[-3000:]}")
        return pickle.loads(reply.read_bytes())


