"""The trainer's ``--link RATE`` (``python -m refimpl.train --nproc-per-node N --link 400mbit``): the
self-launch runs its ``torchrun`` inside a private network namespace whose loopback is shaped to ``RATE``
(``unshare -rn python -m refimpl.launch.shaped_exec RATE CALLER -- torchrun ...``; the namespace and the
shaping of ``refimpl.launch.shaped_link``), so every rank's traffic, the rendezvous included, crosses a link
of that bandwidth: a run on two CPU cores becomes communication-bound as on a cluster's network (chapter 03).
The command runs as a child that dies with this process, and this process with its caller (``CALLER``, the
trainer's pid): no rank outlives the launcher.
"""

from __future__ import annotations

import subprocess
import sys

from refimpl.distributed.env import exit_with_process, preexec_exit_with_parent
from refimpl.launch.shaped_link import shape_loopback

__all__ = ["main", "shaped_command"]


def shaped_command(cmd: list[str], *, rate: str, caller: int) -> list[str]:
    """``cmd`` run behind a loopback shaped to ``rate`` (a rate ``check_link`` accepted)."""
    return ["unshare", "-rn", sys.executable, "-m", "refimpl.launch.shaped_exec", rate, str(caller), "--",
            *cmd]


def main(argv: list[str] | None = None) -> int:
    """Shape the namespace's loopback, then run the command after ``--``; its exit status."""
    args = sys.argv[1:] if argv is None else argv
    rate, caller, sep, *cmd = args
    if sep != "--" or not cmd:
        print("usage: python -m refimpl.launch.shaped_exec RATE CALLER_PID -- COMMAND...", file=sys.stderr)
        return 2
    exit_with_process(int(caller))  # the trainer gone: this process, and so the command, too
    shape_loopback(rate)
    return subprocess.call(cmd, preexec_fn=preexec_exit_with_parent())


if __name__ == "__main__":
    sys.exit(main())
