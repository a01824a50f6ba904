"""The trainer's hook points (refimpl/train/hooks.py): their order within a step, ``compose``, and the
run's own probes (refimpl/train/probes.py: faults, the test sleep, the heartbeat) composed like a caller's.

Everything runs in this process (world size 1, a 1-layer GPT of width 32): the unit tier. The heartbeat is
a recording stand-in where the order of its beats is checked (a world of one has no store to beat into),
and the fault plan a recording stub; one test fires a real planned preemption (SIGTERM to this process,
caught by the save schedule's handler: the run saves and stops).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from refimpl import elastic
from refimpl.config import ConfigError
from refimpl.data import DataError
from refimpl.distributed import DistributedContext
from refimpl.measure.run_measurement import TrainerProbe
from refimpl.train import Preempted, build_parser, config_from_args, options_from_args, train
from refimpl.train import loop as train_loop
from refimpl.train.hooks import POINTS, TrainHooks, compose
from refimpl.train.probes import RunProbes

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "32", "--batch-size",
        "4", "--micro-batch-size", "2", "--lr", "1e-2", "--warmup-steps", "1", "--log-every", "1"]
WORLD_OF_ONE = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                                  backend="gloo")


@pytest.fixture(autouse=True)
def clean_run(monkeypatch):
    """A first attempt outside any launcher (the fault plan reads the restart count), and the session's
    random state given back (train() seeds Python, NumPy and torch)."""
    for name in (elastic.RESTART_COUNT_ENV, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    yield
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.random.set_rng_state(state[2])


def _options(corpus, out: Path, *extra: str):
    args = build_parser().parse_args([*TINY, "--data", str(corpus["corpus"]), "--cache-dir",
                                      str(corpus["cache"]), "--out", str(out), *extra])
    return config_from_args(args), options_from_args(args)


def _train(config, options, hooks=None) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(config, WORLD_OF_ONE, options, hooks=hooks)
    finally:
        torch.set_num_threads(threads)


class Recorder:
    """A hooks object with every point: appends ``(f"{name}.{point}", step)`` to ``log``."""

    def __init__(self, name: str, log: list, *, reading: float = 0.0) -> None:
        self.name, self.log, self.reading = name, log, reading

    def _note(self, point: str, step: int | None) -> None:
        self.log.append((f"{self.name}.{point}", step))

    def before_step(self, step, setup):
        self._note("before_step", step)

    @contextlib.contextmanager
    def around_step(self, step, setup):
        self._note("around_step enter", step)
        try:
            yield
        finally:  # an exception in the step passes through here
            self._note("around_step exit", step)

    def after_first_forward(self, step, setup):
        self._note("after_first_forward", step)

    def after_first_loss(self, step, setup, loss):
        assert loss.ndim == 0
        self._note("after_first_loss", step)

    def before_optimizer_step(self, step, setup):
        self._note("before_optimizer_step", step)

    def gradient_probe(self, step, shards):
        assert shards and all(s.tensor.dtype == torch.float32 for s in shards.values())
        self._note("gradient_probe", step)

    def after_gradient_probe(self, step, setup):
        self._note("after_gradient_probe", step)

    def before_checkpoint(self, step, setup):
        self._note("before_checkpoint", step)

    def on_failure(self, step, setup, exc):
        self._note(f"on_failure {type(exc).__name__}", step)

    def clock(self) -> float:
        self._note("clock", None)
        return self.reading


def first_difference(log: list, expected: list) -> str | None:
    """None when ``log`` is ``expected``; else where they part (the one assertion of the order tests)."""
    for i, (seen, want) in enumerate(zip(log, expected, strict=False)):
        if seen != want:
            return f"entry {i}: {seen} where {want} was expected"
    if len(log) != len(expected):
        return f"{len(log)} entries, {len(expected)} expected"
    return None


# ---------------------------------------------------------------- compose, without training


def _call_every_point(hooks: TrainHooks, step: int = 7) -> float:
    hooks.before_step(step, None)
    with hooks.around_step(step, None):
        hooks.after_first_forward(step, None)
        hooks.after_first_loss(step, None, torch.zeros(()))
        hooks.before_optimizer_step(step, None)
        hooks.gradient_probe(step, {"w": SimpleNamespace(tensor=torch.zeros(1))})
        hooks.after_gradient_probe(step, None)
    hooks.before_checkpoint(step, None)
    hooks.on_failure(step, None, RuntimeError("boom"))
    return hooks.clock()


def _both_in_order(first: str, second: str, step: int = 7) -> list:
    def both(point):
        return [(f"{first}.{point}", step), (f"{second}.{point}", step)]

    return [*both("before_step"), *both("around_step enter"), *both("after_first_forward"),
            *both("after_first_loss"), *both("before_optimizer_step"), *both("gradient_probe"),
            *both("after_gradient_probe"),
            (f"{second}.around_step exit", step), (f"{first}.around_step exit", step),  # nested
            *both("before_checkpoint"), *both("on_failure RuntimeError"),
            (f"{first}.clock", None), (f"{second}.clock", None)]


def test_compose_calls_its_members_in_order_and_nests_around_step():
    log: list = []
    reading = _call_every_point(compose(Recorder("a", log, reading=1.0), Recorder("b", log, reading=2.0)))
    assert first_difference(log, _both_in_order("a", "b")) is None, log
    assert reading == 2.0  # every clock read (each samples), the last one's reading returned
    # negative control: the members the other way round are caught by the same assertion
    log.clear()
    _call_every_point(compose(Recorder("b", log), Recorder("a", log)))
    assert first_difference(log, _both_in_order("a", "b")) == \
        "entry 0: ('b.before_step', 7) where ('a.before_step', 7) was expected"


def test_compose_reads_an_absent_point_as_none():
    log: list = []
    five = SimpleNamespace(around_step=None, after_first_loss=None, before_optimizer_step=None,
                           gradient_probe=lambda step, shards: log.append(("five.gradient_probe", step)),
                           clock=None)  # an object written for the first five points only
    composed = compose(None, five, TrainHooks())
    assert composed.gradient_probe is five.gradient_probe  # one member at a point: called as it is
    assert all(getattr(composed, p) is None for p in POINTS if p != "gradient_probe")
    assert compose() == TrainHooks()
    both = compose(Recorder("a", log), five)
    both.gradient_probe(3, {"w": SimpleNamespace(tensor=torch.zeros(1))})
    assert log == [("a.gradient_probe", 3), ("five.gradient_probe", 3)]
    probe = compose(TrainerProbe(step=1))  # chapter 12's measurement has the first five
    assert probe.around_step is not None and probe.clock is not None and probe.before_step is None


# ---------------------------------------------------------------- the points of the trainer's steps


class RecordingHeartbeat:
    def __init__(self, log: list) -> None:
        self.log = log

    def beat(self, step: int, phase_index: int, phase: str) -> None:
        self.log.append((f"heartbeat {phase_index} {phase}", step))

    def explain(self) -> str:
        return "positions: (recorded)\n  -> rank 0 stopped behind the others: stalled or dead there"


class RecordingFaults:
    def __init__(self, log: list) -> None:
        self.log = log

    def before_step(self, step: int, **where) -> None:
        assert where["rank"] == 0 and where["world_size"] == 1 and Path(where["out"]).name == "run"
        self.log.append(("faults.before_step", step))

    def mid_step(self, step: int, **where) -> None:
        self.log.append(("faults.mid_step", step))


def expected_step(step: int, *, save: bool) -> list:
    """One step's points with the run's probes (the order the trainer had before they were hooks: the
    heartbeat's "forward" and a preemption first, the kill or hang and "backward ..." after the first
    forward, "optimizer step" after the caller's gradient_probe, "checkpoint" before the save)."""
    return [("heartbeat 0 forward", step), ("faults.before_step", step), ("caller.before_step", step),
            ("caller.around_step enter", step),
            ("faults.mid_step", step), ("heartbeat 1 backward and gradient reduction", step),
            ("caller.after_first_forward", step),
            ("caller.after_first_loss", step),  # once: the first of the 2 micro-batches only
            ("caller.before_optimizer_step", step), ("caller.gradient_probe", step),
            ("heartbeat 2 optimizer step", step), ("caller.after_gradient_probe", step),
            ("caller.around_step exit", step),
            *([("heartbeat 3 checkpoint", step), ("caller.before_checkpoint", step)] if save else [])]


def _recorded_run(corpus, out: Path, monkeypatch) -> list:
    log: list = []
    monkeypatch.setattr(elastic, "Heartbeat", lambda rank, world_size: RecordingHeartbeat(log))
    config, options = _options(corpus, out, "--steps", "3", "--checkpoint-every", "2",
                               "--test-sleep-in-step", "0.01")
    records = _train(config, dataclasses.replace(options, faults=RecordingFaults(log)),
                     hooks=Recorder("caller", log))
    assert [r["step"] for r in records] == [0, 1, 2]
    return log


def test_the_points_of_a_step_come_in_the_documented_order(corpus, tmp_path, monkeypatch, capfd):
    log = _recorded_run(corpus, tmp_path / "a" / "run", monkeypatch)
    # saves after steps 2 (every 2 steps: after step index 1) and 3 (the end: after step index 2)
    expected = [*expected_step(0, save=False), *expected_step(1, save=True), *expected_step(2, save=True)]
    assert first_difference(log, expected) is None, log
    err = capfd.readouterr().err
    # the test sleep, once a step as before (its lines may follow the progress bar's on the same line)
    assert re.findall(r"\[test\] step \d+ sleeps [0-9.]+ s", err) == \
        [f"[test] step {s} sleeps 0.01 s" for s in range(3)]


def test_a_reordered_composition_is_caught(corpus, tmp_path, monkeypatch):
    """Negative control: the trainer composing the caller's hooks before its own probes."""
    monkeypatch.setattr(train_loop, "compose", lambda *hooks: compose(*reversed(hooks)))
    log = _recorded_run(corpus, tmp_path / "b" / "run", monkeypatch)
    expected = [*expected_step(0, save=False), *expected_step(1, save=True), *expected_step(2, save=True)]
    assert first_difference(log, expected) == \
        "entry 0: ('caller.before_step', 0) where ('heartbeat 0 forward', 0) was expected"


def test_a_failure_reaches_on_failure_then_propagates(corpus, tmp_path):
    log: list = []

    def fail_at_step_1(step, setup, loss):
        if step == 1:
            raise RuntimeError("the first loss of step 1 is refused")

    caller = compose(Recorder("caller", log), TrainHooks(after_first_loss=fail_at_step_1))
    config, options = _options(corpus, tmp_path / "run", "--steps", "3")
    with pytest.raises(RuntimeError, match="refused"):
        _train(config, options, hooks=caller)
    assert [e for e in log if e[0].startswith("caller.on_failure")] == [("caller.on_failure RuntimeError", 1)]
    assert log[-2:] == [("caller.around_step exit", 1), ("caller.on_failure RuntimeError", 1)]


# ---------------------------------------------------------------- the run's probes


def test_a_planned_preemption_fires_through_the_run_probes(corpus, tmp_path, capfd):
    # the SIGTERM this sends is caught by the save schedule's handler, installed from the main thread only
    assert threading.current_thread() is threading.main_thread()
    out = tmp_path / "run"
    log: list = []
    config, options = _options(corpus, out, "--steps", "4", "--checkpoint-every", "0",
                               "--preempt-at-step", "1")
    with pytest.raises(Preempted) as stopped:
        _train(config, options, hooks=Recorder("caller", log))
    assert stopped.value.step == 2  # step 1 ran to its end, then the save and the stop
    failures = elastic.read_failures(out)
    assert [(f["kind"], f["step"], f["rank"], f["attempt"]) for f in failures] == [("preempt", 1, 0, 0)]
    assert "[rank 0] step 1: injected preemption: SIGTERM to this rank (attempt 0)" in capfd.readouterr().err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert not [e for e in log if "on_failure" in e[0]]  # a preemption is a stop, not a failure


def test_the_failure_report_names_the_heartbeat_in_a_larger_world(tmp_path, monkeypatch, capfd):
    log: list = []
    monkeypatch.setattr(elastic, "Heartbeat", lambda rank, world_size: RecordingHeartbeat(log))
    ctx = dataclasses.replace(WORLD_OF_ONE, rank=1, world_size=2, local_rank=1)
    options = options_from_args(build_parser().parse_args(["--out", str(tmp_path)]))
    probes = RunProbes(options, ctx, tmp_path)
    for users in (ConfigError("bad flag"), DataError("no corpus")):  # the user's errors: no report
        probes.on_failure(4, None, users)
    assert elastic.read_failures(tmp_path) == [] and capfd.readouterr().err == ""
    probes.on_failure(4, None, RuntimeError("collective timed out\nsecond line"))
    err = capfd.readouterr().err
    assert err.startswith("[rank 1] step 4 failed: RuntimeError: collective timed out\n  positions:")
    assert "second line" not in err  # the error's first line only
    assert [(f["kind"], f["step"], f["rank"], f["message"]) for f in elastic.read_failures(tmp_path)] == \
        [("error", 4, 1, "RuntimeError (-> rank 0 stopped behind the others: stalled or dead there)")]
    # negative control: in a world of one there is no heartbeat to report
    alone = RunProbes(options, WORLD_OF_ONE, tmp_path / "alone")
    alone.on_failure(4, None, RuntimeError("boom"))
    assert elastic.read_failures(tmp_path / "alone") == [] and capfd.readouterr().err == ""


def test_trainer_probe_still_measures_through_the_composed_hooks(corpus, tmp_path):
    probe = TrainerProbe(step=1)
    config, options = _options(corpus, tmp_path / "run", "--steps", "2")
    _train(config, options, hooks=probe)
    assert probe.measured is not None
    assert probe.measured.activations > 0 and all(b > 0 for b in probe.measured.state[:2])
