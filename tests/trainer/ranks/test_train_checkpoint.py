"""The trainer's checkpoints (chapter 11): bitwise resume in every parallel and precision mode, SIGTERM,
``--resume never``, a checkpoint of another configuration refused, time-based saves, the restart decision.

The multi-rank cases run in one spawn of 2 ranks (``run_ranks``): per mode, an uninterrupted run, a run
that receives SIGTERM in step 2 (it saves after step 3 and stops) and a fresh run in the same folder that
resumes. The resumed losses must equal the uninterrupted ones bit for bit.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from refimpl import elastic
from refimpl.checkpoint import list_checkpoints, rank_file_name
from refimpl.config import ConfigError, ParallelConfig
from refimpl.distributed import DistributedContext
from refimpl.launch import run_ranks
from refimpl.train import (
    Preempted,
    RunOptions,
    build_parser,
    config_from_args,
    demo_fault_flags,
    main,
    options_from_args,
    preflight_resume,
    train,
)
from tests.support import timeouts

# the one spawn timeout x 2: the trainer saves, stops and resumes in each mode; it was 420 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "32",
        "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "100", "--steps", "6",
        "--checkpoint-every", "2"]
# (name, flags): each mode is resumed bitwise. Together: fp32/bf16/fp16, ZeRO stages 0-3, gradient
# accumulation, activation checkpointing, asynchronous saves.
MODES = [
    ("dp-fp32-async-accum", ["--async-checkpoint", "--micro-batch-size", "1"]),
    ("dp-bf16-actckpt", ["--precision", "bf16", "--activation-checkpointing"]),
    ("zero1-fp32", ["--zero-stage", "1"]),
    ("zero2-bf16-accum", ["--zero-stage", "2", "--precision", "bf16", "--micro-batch-size", "1"]),
    ("zero3-fp16", ["--zero-stage", "3", "--precision", "fp16"]),
    ("zero3-bf16", ["--zero-stage", "3", "--precision", "bf16"]),  # FSDP2-style bf16 over fp32 shards
]


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus: dict) -> dict[str, Path]:
    """The shared corpus and its token cache (tests/conftest.py), and this module's folder for its runs."""
    return {"root": tmp_path_factory.mktemp("train_ckpt"), **corpus}


def _args(files, out: Path, *extra: str):
    return build_parser().parse_args([*TINY, "--data", str(files["corpus"]), "--cache-dir",
                                      str(files["cache"]), "--out", str(out), *extra])


def _modes_worker(ctx, files: dict, root: str) -> dict:
    results = {}
    for name, flags in MODES:
        def run(out: str, *extra: str, checkpoints: bool = True, name=name, flags=flags):
            args = _args(files, Path(root) / name / out, *flags, *extra)
            options = options_from_args(args) if checkpoints else RunOptions(parallel=ParallelConfig(
                zero_stage=args.zero_stage, precision=args.precision,
                activation_checkpointing=args.activation_checkpointing))
            return train(config_from_args(args), ctx, options)

        clean = [r["loss"] for r in run("clean", checkpoints=False)]
        try:
            run("stopped", "--preempt-at-step", "2")
            stopped = None
        except Preempted as exc:
            stopped = exc.step
        resumed = run("stopped")
        results[name] = {"clean": clean, "stopped_at": stopped,
                         "resumed": [r["loss"] for r in resumed]}
    return results


@pytest.fixture(scope="module")
def modes(files, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("modes")
    return {"root": root, "ranks": run_ranks(_modes_worker, 2, files, str(root), timeout_s=SPAWN_TIMEOUT_S)}


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [name for name, _ in MODES])
def test_sigterm_saves_stops_and_the_resume_is_bitwise(modes, name):
    rank0 = modes["ranks"][0][name]
    assert rank0["stopped_at"] == 3  # SIGTERM in step 2 (on rank 1): both ranks save after step 3, stop
    assert len(set(rank0["clean"])) == 6
    assert rank0["resumed"] == rank0["clean"]  # rank 0 also reads back the steps before the stop
    assert modes["ranks"][1][name]["resumed"] == rank0["clean"][3:]  # the other ranks: the steps they ran
    out = modes["root"] / name / "stopped"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(6))
    failures = elastic.read_failures(out)
    assert [(f["rank"], f["step"], f["kind"]) for f in failures] == [(1, 2, "preempt")]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000006", "step_00000004",
                                                                       "step_00000003"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3 and summary["world_size"] == 2


# ------------------------------------------------------------------------------------ one process
@pytest.fixture
def one_rank():
    """A world of one in this process; the global RNGs and thread count are given back afterwards."""
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(1)
    yield DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.random.set_rng_state(state[2])
    torch.set_num_threads(state[3])


def _run_one(files, ctx, out: Path, *extra: str) -> list[dict]:
    args = _args(files, out, "--steps", "3", "--num-layers", "1", *extra)
    return train(config_from_args(args), ctx, options_from_args(args))


@pytest.mark.timeout(120)
def test_resume_never_and_another_configuration_are_refused(files, one_rank, tmp_path, capsys):
    out = tmp_path / "run"
    _run_one(files, one_rank, out)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000003", "step_00000002"]
    with pytest.raises(ConfigError, match=r"optim.lr: 0.01 in the checkpoint, 0.02 now"):
        _run_one(files, one_rank, out, "--lr", "2e-2")
    flags = [*TINY, "--data", str(files["corpus"]), "--cache-dir", str(files["cache"]), "--out", str(out),
             "--steps", "3", "--num-layers", "1", "--resume", "never"]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "already holds checkpoints" in err and "resume is 'never'" in err, err
    # a finished run pointed at again: nothing to train, the records come back from metrics.jsonl
    again = _run_one(files, one_rank, out)
    assert [r["step"] for r in again] == [0, 1, 2]
    assert "is complete (step 3 of 3)" in capsys.readouterr().out


def _launcher_flags(files, out: Path, *extra: str) -> list[str]:
    """``python -m refimpl.train --nproc-per-node 2`` on the 3-step run of ``_run_one``."""
    return [*TINY, "--data", str(files["corpus"]), "--cache-dir", str(files["cache"]), "--out", str(out),
            "--steps", "3", "--num-layers", "1", "--nproc-per-node", "2", *extra]


def _refused_before_torchrun(flags: list[str], capsys, monkeypatch) -> str:
    """The self-launch of ``flags`` (in this process): exit status 2 with one error line, and torchrun never
    started. Returns that line."""
    def no_torchrun(cmd, **kwargs):
        pytest.fail(f"torchrun was started: {cmd}")

    monkeypatch.setattr(subprocess, "call", no_torchrun)
    code = main(flags)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, captured)
    assert "launching" not in captured.out, captured.out
    return lines[0]


@pytest.mark.timeout(120)
def test_a_finished_run_is_not_extended_and_the_refusal_says_why(files, one_rank, tmp_path, capsys,
                                                                 monkeypatch):
    """`make train` then `make train ARGS="--steps 50 --data my.txt"` in the same folder. Refused
    before torchrun (status 2, one line) with what differs, why --steps cannot change (the schedule), and
    the fix; the ranks refuse it in the same words; another --out is a fresh start."""
    out = tmp_path / "run"
    _run_one(files, one_rank, out)  # finished: 3 of 3 steps
    capsys.readouterr()
    line = _refused_before_torchrun(_launcher_flags(files, out, "--steps", "5"), capsys, monkeypatch)
    assert "steps: 3 in the checkpoint, 5 now" in line, line
    assert "cannot be extended with more --steps" in line and "refimpl/optim.py lr_at" in line, line
    assert "--out runs/other" in line, line
    mine = tmp_path / "my.txt"
    mine.write_bytes(files["corpus"].read_bytes())
    line = _refused_before_torchrun(_launcher_flags(files, out, "--steps", "2", "--data", str(mine)), capsys,
                                    monkeypatch)
    assert f"data.data: {str(files['corpus'])!r} in the checkpoint, {str(mine)!r} now" in line, line
    assert "steps: 3 in the checkpoint, 2 now" in line and "--out runs/other" in line, line
    with pytest.raises(ConfigError, match="cannot be extended with more --steps"):  # a rank, same words
        _run_one(files, one_rank, out, "--steps", "5")
    args = _args(files, tmp_path / "other", "--steps", "2", "--num-layers", "1", "--data", str(mine))
    assert preflight_resume(config_from_args(args), options_from_args(args)) is None  # the fix: a fresh run


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.timeout(120)
def test_a_folder_of_damaged_checkpoints_is_refused_before_torchrun(files, one_rank, tmp_path, capsys,
                                                                    monkeypatch):
    """Every checkpoint damaged: the launcher refuses (status 2, one line naming the folder and each
    checkpoint's damage) instead of starting torchrun, whose ranks would refuse it once per restart. One
    damaged checkpoint of two is no refusal: the ranks resume from the older one."""
    out = tmp_path / "run"
    _run_one(files, one_rank, out)
    capsys.readouterr()
    folder = out / "checkpoints"
    newest, older = list_checkpoints(folder)
    args = _args(files, out, "--steps", "3", "--num-layers", "1")
    config, options = config_from_args(args), options_from_args(args)
    assert preflight_resume(config, options) == 3  # control: the run resumes at its end
    _flip_a_byte(newest / rank_file_name(0))
    assert preflight_resume(config, options) == 2
    _flip_a_byte(older / rank_file_name(0))
    files_before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    line = _refused_before_torchrun(_launcher_flags(files, out), capsys, monkeypatch)
    assert line.startswith(f"error: no valid checkpoint in {folder}, so the run cannot resume"), line
    for damaged in (newest, older):
        assert f"{damaged.name}/{rank_file_name(0)}: sha256 mismatch" in line, line
    assert f"mv {folder} {folder}.damaged" in line and "--out runs/other" in line, line
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == files_before  # nothing changed


@pytest.mark.timeout(120)
def test_the_launcher_announces_the_demo_and_marks_it_for_the_ranks(files, tmp_path, capsys, monkeypatch):
    """The self-launch's command (torchrun not started): the ranks get ``--demo-fault`` with the demo's
    fault only (it makes the fault read as planned), and the launcher says what will happen."""
    commands: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **kwargs: commands.append(cmd) or 0)
    base = [*TINY, "--data", str(files["corpus"]), "--cache-dir", str(files["cache"]), "--out",
            str(tmp_path / "demo"), "--nproc-per-node", "2"]
    assert main([*base, "--demo-fault"]) == 0
    assert commands[-1][-5:] == ["--demo-fault", "--fail-at-step", "3", "--fail-rank", "1"], commands[-1]
    assert commands[-1].count("--demo-fault") == 1
    printed = capsys.readouterr().out
    assert "demo: rank 1 will kill itself once, in step 3," in printed, printed
    assert "they resume from the checkpoint of step 2 and finish the run" in printed, printed
    for own in (["--no-demo-fault"], ["--demo-fault", "--fail-at-step", "2"]):  # no demo, or your own fault
        assert main([*base, *own]) == 0
        assert not [a for a in commands[-1] if a.endswith("demo-fault")], commands[-1]
        assert "demo:" not in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_checkpoint_minutes_saves_by_the_clock(files, one_rank, tmp_path):
    out = tmp_path / "clock"
    _run_one(files, one_rank, out, "--checkpoint-every", "0", "--checkpoint-minutes", "1e-9",
             "--keep-last", "5")
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000003", "step_00000002",
                                                                       "step_00000001"]
    out = tmp_path / "end-only"
    _run_one(files, one_rank, out, "--checkpoint-every", "0")
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000003"]


@pytest.mark.timeout(120)
def test_resume_never_lets_the_same_job_continue_after_a_restart(files, one_rank, tmp_path, monkeypatch):
    """The restart decision reads the disk: checkpoints written by this job (its rendezvous id) are
    resumed even under --resume never; another job's, or an unknown one's, are refused."""
    out = tmp_path / "job"
    monkeypatch.setenv(elastic.RUN_ID_ENV, "job-a")
    _run_one(files, one_rank, out, "--resume", "never", "--steps", "2")
    folder = out / "checkpoints"
    assert elastic.resume_mode("never", folder, "job-a") == "auto"
    assert elastic.resume_mode("never", folder, "job-b") == "never"
    assert elastic.resume_mode("never", folder, None) == "never"
    assert elastic.resume_mode("auto", folder, "job-b") == "auto"
    assert elastic.resume_mode("never", tmp_path / "empty", "job-a") == "never"
    monkeypatch.setenv(elastic.RUN_ID_ENV, "job-b")
    with pytest.raises(Exception, match="already holds checkpoints"):
        _run_one(files, one_rank, out, "--resume", "never", "--steps", "2")


def test_activation_checkpointing_with_zero3_is_taken():
    """ZeRO-3 recomputes on the gathered weights now (tests/ranks/lane2/test_zero.py proves it), so the flags
    pass."""
    args = build_parser().parse_args(["--zero-stage", "3", "--activation-checkpointing"])
    options = options_from_args(args)
    assert (options.parallel.zero_stage, options.parallel.activation_checkpointing) == (3, "all")


def test_explain_positions_names_the_rank_behind():
    now = 100.0
    report = elastic.explain_positions({0: (3, 1, "backward", 90.0), 1: (3, 0, "forward", 85.0),
                                        2: (3, 1, "backward", 90.0)}, now)
    assert "rank 1 stopped behind the others" in report and "last heard 15.0 s ago" in report
    silent = elastic.explain_positions({0: (1, 0, "forward", 99.0), 3: None}, now)
    assert "rank 3: never reported" in silent and "rank 3 stopped behind" in silent
    same = elastic.explain_positions({0: (2, 1, "backward", 99.0), 1: (2, 1, "backward", 99.0)}, now)
    assert "no single rank is behind" in same


def test_the_demo_fault_only_in_the_default_self_launched_run():
    def demo(*flags):
        argv = ["--nproc-per-node", "2", *flags]
        return demo_fault_flags(build_parser().parse_args(argv), list(flags), 2)

    # `make train`: checkpoints every 50 of 200 steps; rank 1 dies in step 75, the run resumes from 50
    assert demo() == ["--fail-at-step", "75", "--fail-rank", "1"]
    assert demo("--steps", "60") == []  # a command line of your own: no fault unless asked
    assert demo("--steps", "6", "--checkpoint-every", "2", "--demo-fault")[:2] == ["--fail-at-step", "3"]
    assert demo("--steps", "6", "--demo-fault")[:2] == ["--fail-at-step", "3"]  # no checkpoint before it
    assert demo("--no-demo-fault") == []
    assert demo("--demo-fault", "--fail-at-step", "2") == []  # your own fault instead
    assert demo("--demo-fault", "--max-restarts", "0") == []  # no restart to show
    # `make train` again: a run that resumes at or past step 75 would never meet its fault
    args = build_parser().parse_args(["--nproc-per-node", "2"])
    assert demo_fault_flags(args, [], 2, start=50) == ["--fail-at-step", "75", "--fail-rank", "1"]
    assert demo_fault_flags(args, [], 2, start=75) == demo_fault_flags(args, [], 2, start=200) == []


def test_torchrun_commands_and_the_environment():
    cmd = elastic.torchrun_command(["--steps", "3"], nproc_per_node=2, max_restarts=1)
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
                       "--standalone", "-m", "refimpl.train", "--steps", "3"]
    agent = elastic.torchrun_command([], nproc_per_node=1, nnodes="1:2", rdzv_endpoint="10.0.0.1:29400",
                                     rdzv_id="job", rdzv_conf="last_call_timeout=5")
    assert "--rdzv-backend=c10d" in agent and "--nnodes=1:2" in agent and "--rdzv-id=job" in agent
    env = elastic.elastic_env({"RANK": "3", "PATH": "/bin"})
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and "RANK" not in env and env["PATH"] == "/bin"
