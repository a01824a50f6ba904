"""Run a command from a notebook cell: its output as it comes, and an exception when it fails (chapter 00).

``!torchrun ...`` in a cell hides a failure (the cell goes on as if nothing happened); ``run_command``
raises ``CommandFailed`` with the exit code and the tail of the output, and kills the command's
whole process group on a timeout or an interrupt, so nothing it started outlives the call.
See docs/ARCHITECTURE.md, "Running many ranks".
"""

from __future__ import annotations

import codecs
import contextlib
import os
import queue
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

__all__ = ["CommandFailed", "run_command"]


class CommandFailed(RuntimeError):
    """A command run by ``run_command`` exited non-zero or ran past its timeout."""

    def __init__(self, cmd: Sequence[str], returncode: int | None, output: str, timed_out: bool) -> None:
        self.cmd = list(cmd)
        self.returncode = returncode
        self.output = output
        self.timed_out = timed_out
        tail = "\n".join(output.splitlines()[-40:])
        why = "timed out (process group killed)" if timed_out else f"exited with code {returncode}"
        super().__init__(f"command {shlex.join(self.cmd)} {why}; last output:\n{tail}")


def run_command(
    cmd: Sequence[str] | str,
    *,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> str:
    """Run ``cmd`` (e.g. ``torchrun ...``) from a cell, print its output as it comes, return all of it.

    A string is split like a shell would (no shell is run). The child runs in its own process group with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and ``PYTHONUNBUFFERED=1`` unless ``env`` says otherwise.
    Raises ``CommandFailed`` (exit code and the tail of the output) on a non-zero exit, or after killing
    the whole process group when it runs past ``timeout_s`` (or on KeyboardInterrupt, which is re-raised).
    """
    argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    child_env = {
        **os.environ,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env,
        cwd=cwd,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # a thread reads; the caller's thread prints (so output lands in the cell)
        # Raw chunks, not lines: a progress bar redraws its line with "\r", which a cell shows in place
        # (reading lines in text mode would turn every redraw into a new line).
        assert proc.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := os.read(proc.stdout.fileno(), 65536):
            lines.put(decoder.decode(chunk))
        if tail := decoder.decode(b"", final=True):
            lines.put(tail)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    out: list[str] = []
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                break
            out.append(line)
            print(line, end="", flush=True)
        proc.wait(timeout=max(0.01, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # on timeout or KeyboardInterrupt, nothing of the command may outlive the call
        if proc.poll() is None:
            _kill_group(proc)
    reader.join(timeout=5)
    while not lines.empty():
        line = lines.get_nowait()
        out.append(line or "")
    output = "".join(out)
    if timed_out or proc.returncode != 0:
        raise CommandFailed(argv, None if timed_out else proc.returncode, output, timed_out)
    return output


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child's whole process group (it was started in a new session), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
