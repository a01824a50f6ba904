"""Start a notebook's engines by forking one process that has already imported torch (Linux).

    python -m refimpl.launch.engine_zygote N     (env: IPP_CLUSTER_ID, IPP_PROFILE_DIR of the controller)

ipyparallel's local launcher starts each engine as a new Python, which imports ipyparallel, then a
"nanny" (one more Python per engine, which relays signals), then torch when the first cell runs: on the
course's 2-core machine, 4 engines took about 9 s of that before the first cell could run. Here one
process (the *zygote*, as Android calls its preloaded parent of every app) imports ``torch.distributed``
and the engine application once, then forks ``N`` children, each of which runs an ipyparallel engine that
registers with the controller named by the environment, exactly as a launched one would. Forking after
``import torch`` is what a ``DataLoader``'s workers do under the fork start method: nothing has started
a thread pool, a CUDA context or a process group yet (each engine makes its own when it becomes a rank).

No nanny: ``refimpl.launch.notebook.Ranks`` stops its engines by PID and the reaper kills them with
the kernel (``refimpl.launch.reaper``); nothing sends an engine a signal through ipyparallel. Each
child dies with the zygote (``PR_SET_PDEATHSIG``), and the zygote ends when its children have, passing
on a SIGTERM or SIGINT it gets: no engine outlives the process that started it. Chapter 00 shows the
ranks; docs/ARCHITECTURE.md, "Running many ranks".
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the zygote) exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _run_engine(zygote_pid: int) -> None:
    """In a forked child: become an ipyparallel engine (returns when the engine stops)."""
    _die_with_parent()
    if os.getppid() != zygote_pid:  # the zygote died before prctl took effect
        os._exit(1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    from ipyparallel.engine.app import IPEngine

    sys.argv = ["ipengine"]
    IPEngine.launch_instance(argv=["--IPEngine.enable_nanny=False"])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit() or int(args[0]) < 1:
        print("usage: python -m refimpl.launch.engine_zygote N  (N >= 1 engines)", file=sys.stderr)
        return 2
    import torch.distributed  # noqa: F401  (the slow import, once for every engine)
    from ipyparallel.engine.app import IPEngine  # noqa: F401

    zygote_pid, children = os.getpid(), []
    for _ in range(int(args[0])):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _run_engine(zygote_pid)
            except BaseException:  # noqa: BLE001 - the engine's own error is already logged
                code = 1
            os._exit(code)  # never run the zygote's code (or its atexit handlers) in a child
        children.append(pid)

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    status = 0
    for child in children:
        _, code = os.waitpid(child, 0)
        status = status or os.waitstatus_to_exitcode(code)
    return 0 if status in (0, -signal.SIGTERM, -signal.SIGKILL) else 1


if __name__ == "__main__":
    sys.exit(main())
