"""When to save: every N steps, every M minutes, at once on SIGTERM, the same on every rank (chapter 11)."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from refimpl.checkpoint.checkpointer import CheckpointConfig


class SaveSchedule:
    """Decides, identically on every rank, whether to save after a step.

    Every ``every_steps`` steps (no communication); every ``every_minutes`` by rank 0's clock; and at once
    when any rank received SIGTERM (``stop_requested`` then tells the trainer to stop after saving). The
    time and signal flags travel in one tensor, one all-reduce (MAX) per step, on ``device`` for the default
    process group's backend, and come back to the host in one read (one GPU sync per step, not one per
    flag); with nothing to agree on (no minutes, no signal handler, or one rank) no tensor is made at all.

    A step that never ends (a hang, a run too large for the machine) would keep a SIGTERM waiting for ever,
    so a second SIGTERM, or the first once ``grace_s`` seconds have passed without the save (``None``:
    wait for ever), exits at once: a line on stderr and ``os._exit(143)`` (128 + SIGTERM), no save; the
    newest committed checkpoint stays valid (the commit is atomic, chapter 11). The grace runs in a thread
    of its own, so it fires even while the main thread is inside a long kernel; the second SIGTERM's
    handler runs in the main thread, as every Python signal handler does.
    """

    def __init__(self, config: CheckpointConfig, *, device: torch.device | str = "cpu",
                 grace_s: float | None = 60.0) -> None:
        if grace_s is not None and not grace_s >= 0:
            raise ValueError(f"the SIGTERM grace must be >= 0 seconds or None, got {grace_s}")
        self.grace_s = grace_s
        self._closed = threading.Event()  # stands the grace timer down
        self.every_steps = config.every_steps
        self.every_s = None if config.every_minutes is None else 60.0 * config.every_minutes
        self.device = torch.device(device)
        self.stop_requested = False
        self._signalled = False
        self._last = time.monotonic()
        self._previous = None
        self._use_signal = config.save_on_sigterm and threading.current_thread() is threading.main_thread()
        if self._use_signal:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self._signalled:
            self._exit_now("a second SIGTERM")
        self._signalled = True
        grace = "" if self.grace_s is None else f", or {self.grace_s:g} s (--sigterm-grace) before it,"
        os.write(2, f"\nSIGTERM: saving at the end of this step, then stopping; a second SIGTERM{grace} "
                    "exits at once without saving\n".encode())
        if self.grace_s is not None:
            threading.Thread(target=self._grace_timer, name="sigterm-grace", daemon=True).start()

    def _grace_timer(self) -> None:
        if not self._closed.wait(self.grace_s):
            self._exit_now(f"the step did not end within the grace of {self.grace_s:g} s (--sigterm-grace)")

    @staticmethod
    def _exit_now(why: str) -> None:
        os.write(2, f"error: SIGTERM: {why}; exiting at once with status 143, without saving (the newest "
                    "committed checkpoint stays valid)\n".encode())
        os._exit(143)

    def due(self, step: int) -> bool:
        """After ``step`` completed steps: save now? Collective when minutes or SIGTERM are watched."""
        timed = self.every_s is not None and time.monotonic() - self._last >= self.every_s
        signalled = self._signalled
        watched = self._use_signal or self.every_s is not None
        if watched and dist.is_initialized() and dist.get_world_size() > 1:
            signalled, timed = self._agree(signalled, timed and dist.get_rank() == 0)  # rank 0's clock
        self.stop_requested = self.stop_requested or signalled
        due = signalled or timed or (self.every_steps is not None and step % self.every_steps == 0)
        if due:
            self._last = time.monotonic()
        return due

    def _agree(self, signalled: bool, timed: bool) -> tuple[bool, bool]:
        """Both flags, each the MAX over the ranks: one tensor, one all-reduce, one read back."""
        from refimpl.comm import ops

        flags = torch.tensor([float(signalled), float(timed)], device=self.device)
        ops.all_reduce(flags, op=ops.ReduceOp.MAX)
        signalled, timed = (value > 0 for value in flags.tolist())  # one device-to-host copy
        return signalled, timed

    def close(self) -> None:
        self._closed.set()
        if self._use_signal:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
