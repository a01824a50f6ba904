"""The trainer's command line: bad input is refused cleanly; a tiny run writes its outputs, reproduces, and a
2-rank data-parallel run matches the single-process run of the same global batch.

Equivalence (docs/ARCHITECTURE.md, "Correctness and numerics"): a 2-rank run is, in floating point, the
single-process run with its global batch cut into 2 micro-batches (each rank's mean over its half, divided
by W = 2 exactly, then one addition; one process: two micro-batch losses divided by 2, added in ``.grad``),
so those two agree **bit for bit**. Against the single process with one micro-batch the tolerance is
``FACTOR x`` the distance between the two single-process runs (1 vs 2 micro-batches), measured in the same
test session. The gradients are compared before the first optimizer step as well: AdamW is nearly
scale-invariant and hides a gradient twice too large, a gradient comparison does not (an error of 1.0).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from refimpl import precision
from refimpl.data import make_corpus_file
from refimpl.distributed import DistributedContext
from refimpl.launch import run_ranks
from refimpl.train import RunOptions, build_parser, config_from_args, train
from refimpl.train.layout import resolve

ROOT = Path(__file__).resolve().parents[4]
CLI_TIMEOUT_S = 120
# A self-launched multi-rank run (torchrun, W fresh interpreters importing torch, 6 tiny steps) took 15 s at
# 2 ranks and 24 s at 4 at load average 4.5 on 2 cores, 56 s and 45 s at load 12-15 (pytest --durations),
# against a former bound of 120 s. The bounds are 5x the loaded figure, so that load slows such a run
# without failing it: LAUNCH_TIMEOUT_S for the command, LAUNCH_COLLECTIVE_S for its process group (a rank
# still importing torch while its peers wait at the rendezvous must not time them out). A hang still ends
# within them, as a failure.
LAUNCH_TIMEOUT_S = 300
LAUNCH_COLLECTIVE_S = "180"
FACTOR = 4  # x the single-process summation-order spread (the module docstring)


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    pythonpath = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return dict(env, PYTHONPATH=pythonpath, REFIMPL_CACHE=str(cache), MPLBACKEND="Agg", OMP_NUM_THREADS="1")


def _cli(args: list[str], cwd: Path, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refimpl.train", *args], cwd=cwd, env=_env(cwd / "cache"),
                          capture_output=True, text=True, timeout=timeout)


def _cli_in_process(args: list[str], cwd: Path, env: dict[str, str] | None = None
                    ) -> subprocess.CompletedProcess:
    """``python -m refimpl.train args`` as ``refimpl.train.cli.main`` in this process (``env``: extra
    variables), for refusals: they end before any process group, thread or seed is touched, and a fresh
    interpreter per case would cost seconds of torch import each. One case per path still runs as a real
    command (``IN_A_CHILD``), so the two are checked to agree."""
    import contextlib
    import io

    from refimpl.train.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved, here = dict(os.environ), os.getcwd()
    os.environ.update(_env(cwd / "cache") | (env or {}))
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exc:  # argparse's refusals and --help
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["refimpl.train", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus: dict) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    empty = root / "empty.txt"
    empty.write_text("")
    return {
        "root": root,
        "corpus": corpus["corpus"],  # the shared corpus (tests/conftest.py); its token cache is the module's
        "small": make_corpus_file(root / "small.txt", num_bytes=200),  # 6 windows of 33 tokens
        "empty": empty,
    }


TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "32"]

# The refusals that run as real commands (a fresh interpreter, the self-launch and the rank's environment);
# the others call the same main() in this process (_cli_in_process).
IN_A_CHILD = {"unknown-flag", "help", "nproc-not-dividing-batch", "pp2-zero3-reshard-zbh1"}

# name -> (arguments, whether argparse itself refuses them). {corpus} etc. are filled in from `files`.
BAD_INPUT = {
    "unknown-flag": (["--bogus-flag", "1"], True),
    "missing-data": (["--data", "{root}/no/such/file.txt", *TINY], False),
    "empty-corpus": (["--data", "{empty}", *TINY], False),
    "heads-not-dividing": (["--data", "{corpus}", "--hidden-size", "32", "--num-heads", "3"], False),
    "nproc-not-dividing-batch": (["--data", "{corpus}", *TINY, "--batch-size", "16", "--nproc-per-node", "3"],
                                 False),
    "corpus-too-small": (["--data", "{small}", *TINY, "--batch-size", "16"], False),
}


@pytest.fixture(scope="module")
def cli_runs(files) -> dict[str, subprocess.CompletedProcess]:
    """Every bad command line, and ``--help``, four at a time: each is a fresh interpreter importing torch
    (seconds of CPU), so they overlap instead of queueing, without starving each other on a small machine."""
    commands = {name: args for name, (args, _) in BAD_INPUT.items()} | {"help": ["--help"]}

    def run(name: str) -> subprocess.CompletedProcess:
        cwd = files["root"] / name
        cwd.mkdir()
        args = [a.format(**files) for a in commands[name]] + ["--out", str(cwd / "run")]
        return _cli(args, cwd) if name in IN_A_CHILD else _cli_in_process(args, cwd)

    # in this process first (it changes os.environ and the working directory), then the children together
    here = {name: run(name) for name in commands if name not in IN_A_CHILD}
    with ThreadPoolExecutor(max_workers=4) as pool:
        children = {name: pool.submit(run, name) for name in commands if name in IN_A_CHILD}
        return {name: children[name].result() if name in children else here[name] for name in commands}


@pytest.mark.timeout(2 * CLI_TIMEOUT_S + 60)  # the first one waits for the fixture: two waves of four
@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_error_line(name, cli_runs, files):
    proc = cli_runs[name]
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, report
    assert "Traceback" not in proc.stderr + proc.stdout, report
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, report
    if not BAD_INPUT[name][1]:  # our own refusal: that one line is all of stderr
        assert proc.stderr.strip().splitlines() == error_lines, report
        assert error_lines[0].startswith("error: "), report
        assert "launching" not in proc.stdout, report  # refused before torchrun started
    assert not (files["root"] / name / "run").exists(), "a refused run must not create its run folder"


def test_bad_input_messages_say_what_is_wrong(cli_runs):
    expect = {
        "unknown-flag": "--bogus-flag",
        "missing-data": "does not exist",
        "empty-corpus": "empty",
        "heads-not-dividing": "num_attention_heads=3",
        "nproc-not-dividing-batch": "3 data-parallel ranks",
        "corpus-too-small": "--batch-size",
    }
    for name, fragment in expect.items():
        assert fragment in cli_runs[name].stderr, (name, cli_runs[name].stderr)


@pytest.mark.timeout(2 * CLI_TIMEOUT_S + 60)
def test_help_lists_the_main_flags(cli_runs, files):
    proc = cli_runs["help"]
    assert proc.returncode == 0, proc.stderr
    for flag in ["--steps", "--batch-size", "--seq-len", "--lr", "--seed", "--data", "--out"]:
        assert flag in proc.stdout, flag
    assert not (files["root"] / "help" / "run").exists()


def _help_entries(text: str) -> dict[str, str]:
    """``--help`` cut into one entry per flag (its first option name -> its lines, whitespace joined)."""
    entries: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = [line]
        elif current is not None and line.startswith("    "):
            entries[current].append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}


def test_help_shows_each_default_once(tmp_path):
    """A help text that gives its default in words ("default: <out>/checkpoints") got argparse's
    "(default: None)" after it as well. One default per flag, the words where there are words."""
    proc = _cli_in_process(["--help"], tmp_path, env={"COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    entries = _help_entries(proc.stdout)
    assert len(entries) > 50 and "--steps" in entries and "--fail-rank" in entries, sorted(entries)
    twice = {flag: text for flag, text in entries.items() if text.count("default:") > 1}
    assert not twice, twice
    in_words = {"--data": "(default: Python's standard library source)", "--backend": "(default: nccl",
                "--demo-fault": "(default: only when no other flag", "--dp": "(default: world size",
                "--microbatches": "(default: per-rank batch", "--checkpoint-dir": "default: <out>/",
                "--fail-rank": "(default: the last rank)", "--steps": "(default: 200)",
                "--out": "(default: runs/default)"}
    for flag, words in in_words.items():
        assert words in entries[flag] and "(default: None)" not in entries[flag], (flag, entries[flag])
    assert "default:" not in entries["--fail-at-step"]  # no fault: nothing to show, not "()"


def test_the_readme_examples_of_make_train_name_their_own_run_folder():
    """`make train` writes runs/default; an example with other flags run after it in the same
    folder is refused (another run's checkpoints), so each example of ARGS names its own --out."""
    import re

    examples = re.findall(r'make train ARGS="([^"]*)"', (ROOT / "README.md").read_text())
    assert examples
    for flags in examples:
        assert "--out " in flags, flags


# ---------------------------------------------------------------- real runs

RUN_FLAGS = [*TINY, "--steps", "6", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2",
             "--log-every", "1"]


@pytest.fixture
def keep_global_rng():
    """train() seeds Python, NumPy and torch; give the rest of the session its random state back."""
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    yield
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.random.set_rng_state(state[2])


def _train_in_process(files, out: Path, *extra: str, ctx: DistributedContext | None = None) -> list[dict]:
    """What ``python -m refimpl.train <flags>`` does in one process (``ctx``: a rank of a process group)."""
    args = build_parser().parse_args([*RUN_FLAGS, "--data", str(files["corpus"]), "--cache-dir",
                                      str(files["root"] / "cache"), "--out", str(out), *extra])
    if ctx is None:
        ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                                 backend="gloo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as init_distributed does on a CPU (and tiny matmuls are faster so)
    try:
        return train(config_from_args(args), ctx, RunOptions(report="--no-report" not in extra))
    finally:
        torch.set_num_threads(threads)


def _read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single_run(files, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("single") / "run"
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        records = _train_in_process(files, out)
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])
    return out, records


def test_tiny_run_writes_its_outputs(single_run):
    out, records = single_run
    lines = _read_metrics(out)
    assert len(lines) == 6
    for step, line in enumerate(lines):
        assert line["step"] == step
        assert isinstance(line["loss"], float) and np.isfinite(line["loss"])
        assert line["tokens_per_s"] > 0
        assert line["mfu"] is None  # no made-up MFU on a CPU
    assert [r["loss"] for r in records] == [line["loss"] for line in lines]
    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == 6 and config["model"]["hidden_size"] == 32 and config["data"]["seq_len"] == 32
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "sample.txt").read_text().startswith("def ")


def test_tiny_run_is_reproducible(single_run, files, tmp_path, keep_global_rng):
    _, first = single_run
    again = _train_in_process(files, tmp_path / "again", "--no-report")
    assert [r["loss"] for r in again] == [r["loss"] for r in first]  # bitwise
    # --no-report: the same run, its metrics and config, and none of the end's report (the first run's)
    again_out = tmp_path / "again"
    assert len(_read_metrics(again_out)) == len(first) and (again_out / "config.json").exists()
    assert not any((again_out / f).exists() for f in ("loss.png", "sample.txt", "summary.json"))
    # Negative control: another seed (other weights, other batches) gives other losses.
    other = _train_in_process(files, tmp_path / "other", "--seed", "1")
    assert [r["loss"] for r in other] != [r["loss"] for r in first]


@pytest.mark.numerics
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_two_rank_run_matches_the_single_process_run(single_run, split_run, files, tmp_path):
    _, single = single_run
    out = tmp_path / "ddp"
    args = [*RUN_FLAGS, "--data", str(files["corpus"]), "--cache-dir", str(files["root"] / "cache"),
            "--out", str(out), "--nproc-per-node", "2", "--timeout", LAUNCH_COLLECTIVE_S]
    proc = _cli(args, tmp_path, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "world size 2" in proc.stdout + proc.stderr
    lines = _read_metrics(out)
    assert [line["step"] for line in lines] == list(range(6))  # rank 0 alone writes the log
    ddp = np.array([line["loss"] for line in lines])
    ref = np.array([r["loss"] for r in single])
    # Same global batch, same weights, gradients averaged by the data-parallel all-reduce: bit for bit the
    # single process with 2 micro-batches, through 6 AdamW steps (the module docstring) ...
    assert ddp.tolist() == [r["loss"] for r in split_run]
    # ... and against one micro-batch within FACTOR x the distance of those two single-process runs
    spread = max(abs(a["loss"] - b["loss"]) for a, b in zip(split_run, single, strict=True))
    np.testing.assert_allclose(ddp, ref, rtol=0, atol=FACTOR * spread)
    assert ddp[-1] < ddp[0] - 0.1, ddp  # and it learns
    assert (out / "loss.png").exists() and (out / "config.json").exists()


@pytest.fixture(scope="module")
def split_run(files, tmp_path_factory) -> list[dict]:
    """The single process again, its global batch of 4 in 2 micro-batches: the summation-order yardstick."""
    out = tmp_path_factory.mktemp("split") / "run"
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        return _train_in_process(files, out, "--micro-batch-size", "2")
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])


def _first_step_gradients(files, out: Path, *extra: str, ctx: DistributedContext | None = None):
    """The gradients the trainer hands to its optimizer step (``MixedPrecision.step``) at step 0."""
    seen: list[list[torch.Tensor]] = []
    original = precision.MixedPrecision.step

    def recording(self, optimizer, **kwargs):
        params = kwargs.get("params") or [p for g in optimizer.param_groups for p in g["params"]]
        seen.append([p.grad.detach().clone() for p in params])
        return original(self, optimizer, **kwargs)

    precision.MixedPrecision.step = recording
    try:
        _train_in_process(files, out, "--steps", "1", *extra, ctx=ctx)
    finally:
        precision.MixedPrecision.step = original
    return seen[0]


def _gradients_on_rank(ctx, files, out: str) -> list[np.ndarray]:
    # numpy arrays travel by value; torch tensors would be shared through the exiting rank's descriptors
    return [g.numpy() for g in _first_step_gradients(files, Path(out), ctx=ctx)]


def _grel(grads, ref) -> float:
    """||g - g_ref|| / ||g_ref|| over all gradients."""
    num = sum(((x - y).double() ** 2).sum() for x, y in zip(grads, ref, strict=True)).sqrt()
    return (num / sum((y.double() ** 2).sum() for y in ref).sqrt()).item()


@pytest.mark.numerics
@pytest.mark.timeout(CLI_TIMEOUT_S + 60)
def test_two_rank_gradients_before_the_step_equal_one_device(files, tmp_path, keep_global_rng):
    one = _first_step_gradients(files, tmp_path / "one")
    split = _first_step_gradients(files, tmp_path / "split", "--micro-batch-size", "2")
    ranks = run_ranks(_gradients_on_rank, 2, files, str(tmp_path / "two"), timeout_s=CLI_TIMEOUT_S)
    two = [[torch.from_numpy(g) for g in grads] for grads in ranks]
    spread = _grel(split, one)
    assert spread > 0, "1 and 2 micro-batches agree bit for bit: no yardstick"
    for rank, grads in enumerate(two):
        # what the trainer's sync hands to the optimizer: bit for bit one process's 2-micro-batch gradient
        assert all(torch.equal(a, b) for a, b in zip(grads, split, strict=True)), rank
        assert _grel(grads, one) <= FACTOR * spread, (rank, _grel(grads, one), spread)
    # the yardstick is tiny: a gradient off by the world size (x 2) would be an error of 1.0. (The loss
    # curve cannot see that bug: gradient clipping and AdamW both undo a constant factor.)
    assert FACTOR * spread < 1e-3, spread



# ---------------------------------------------------------------- the layout flags (--dp --tp --pp --cp)

# The losses of `RUN_FLAGS --nproc-per-node 4` (world size 4, 1 sequence per rank) as float.hex, per
# ATEN_CPU_CAPABILITY (the kernels' rounding differs: the last step does). First recorded at commit 3f4492e,
# before the trainer knew ParallelDims; re-recorded at 928b1d3, where the fused qkv rows moved to Megatron's
# per-head order (another model function by design; nothing else in the arithmetic changed). MKL and oneDNN
# pick their own kernels by CPU, so the run pins them to AVX2 too.
HEAD_WORLD4_LOSSES = {
    "avx2": ["0x1.609b140000000p+2", "0x1.4d29740000000p+2", "0x1.31450a0000000p+2", "0x1.13f0f80000000p+2",
             "0x1.f8c1f00000000p+1", "0x1.dd394a0000000p+1"],
    "default": ["0x1.609b140000000p+2", "0x1.4d29740000000p+2", "0x1.31450a0000000p+2",
                "0x1.13f0f80000000p+2", "0x1.f8c1f00000000p+1", "0x1.dd39480000000p+1"],
}


def _recorded_capability() -> str:
    """The recorded capability this session's kernels match: ``default`` when asked for, else ``avx2``
    (every AVX-512 CPU also runs the AVX2 kernels)."""
    import platform

    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default":
        return "default"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the recorded losses are x86 figures (AVX2 / default kernels)")
    return "avx2"


@pytest.mark.numerics
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_dp4_gives_the_losses_recorded_before_parallel_dims(files, tmp_path):
    cap = _recorded_capability()
    out = tmp_path / "dp4"
    args = [*RUN_FLAGS, "--data", str(files["corpus"]), "--cache-dir", str(files["root"] / "cache"),
            "--out", str(out), "--nproc-per-node", "4", "--dp", "4", "--timeout", LAUNCH_COLLECTIVE_S]
    env = dict(_env(tmp_path / "cache"), ATEN_CPU_CAPABILITY=cap, MKL_ENABLE_INSTRUCTIONS="AVX2",
               ONEDNN_MAX_CPU_ISA="AVX2")
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "world size 4" in proc.stdout and "dp 4 x cp 1 x tp 1 x pp 1" in proc.stdout, proc.stdout
    losses = [float.hex(line["loss"]) for line in _read_metrics(out)]
    assert losses == HEAD_WORLD4_LOSSES[cap]  # bitwise: the same arithmetic as before
    # Negative control: the other capability's record differs, so this comparison can fail.
    assert HEAD_WORLD4_LOSSES["avx2"] != HEAD_WORLD4_LOSSES["default"]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_tp2_with_sequence_parallelism_runs_from_the_command_line(files, tmp_path):
    out = tmp_path / "tp2"
    args = [*RUN_FLAGS, "--data", str(files["corpus"]), "--cache-dir", str(files["root"] / "cache"),
            "--out", str(out), "--nproc-per-node", "2", "--tp", "2", "--sequence-parallel",
            "--timeout", LAUNCH_COLLECTIVE_S]
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", *args], cwd=tmp_path,
                          env=_env(tmp_path / "c"), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "dp 1 x cp 1 x tp 2 x pp 1 with sequence parallelism" in proc.stdout, proc.stdout
    losses = [line["loss"] for line in _read_metrics(out)]
    assert len(losses) == len(set(losses)) > 1 and all(math.isfinite(v) for v in losses)
    assert (out / "sample.txt").read_text().startswith("def ")  # sampled from the gathered shards


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_cp2_ring_attention_runs_from_the_command_line(files, tmp_path):
    out = tmp_path / "cp2"
    args = [*RUN_FLAGS, "--data", str(files["corpus"]), "--cache-dir", str(files["root"] / "cache"),
            "--out", str(out), "--nproc-per-node", "2", "--cp", "2", "--timeout", LAUNCH_COLLECTIVE_S]
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", *args], cwd=tmp_path,
                          env=_env(tmp_path / "c"), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "dp 1 x cp 2 x tp 1 x pp 1 | context parallel: ring attention" in proc.stdout, proc.stdout
    losses = [line["loss"] for line in _read_metrics(out)]
    assert len(losses) == len(set(losses)) > 1 and all(math.isfinite(v) for v in losses)
    assert (out / "sample.txt").read_text().startswith("def ")  # sampled from a plain copy on rank 0


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_pp2_one_f_one_b_runs_from_the_command_line(files, tmp_path):
    out = tmp_path / "pp2"
    args = [*RUN_FLAGS, "--num-layers", "2", "--data", str(files["corpus"]), "--cache-dir",
            str(files["root"] / "cache"), "--out", str(out), "--nproc-per-node", "2", "--pp", "2",
            "--microbatches", "4", "--timeout", LAUNCH_COLLECTIVE_S]
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", *args], cwd=tmp_path,
                          env=_env(tmp_path / "c"), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "dp 1 x cp 1 x tp 1 x pp 2 | pipeline: 1f1b, 4 micro-batches" in proc.stdout, proc.stdout
    losses = [line["loss"] for line in _read_metrics(out)]
    assert len(losses) == len(set(losses)) > 1 and all(math.isfinite(v) for v in losses)
    assert (out / "sample.txt").read_text().startswith("def ")  # sampled from the gathered stages


def test_pipeline_micro_batches_are_checked_before_anything_starts():
    from refimpl.config import ConfigError, ParallelConfig
    from refimpl.train import RunOptions
    from refimpl.train.layout import pipeline_microbatches

    def layout(**fields) -> RunOptions:
        return RunOptions(parallel=ParallelConfig(**fields))

    config = config_from_args(build_parser().parse_args([*TINY, "--num-layers", "4", "--batch-size", "8"]))
    assert pipeline_microbatches(config, layout(pp=2), 2) == 2  # the default: pp micro-batches
    assert pipeline_microbatches(config, layout(pp=2, microbatches=4), 2) == 4
    with_micro = config_from_args(build_parser().parse_args([*TINY, "--num-layers", "4", "--batch-size", "8",
                                                             "--micro-batch-size", "1"]))
    assert pipeline_microbatches(with_micro, layout(pp=2), 2) == 4  # per-rank batch / micro-batch
    for options, dp, match in ((layout(pp=2, microbatches=3), 2, "does not split into 3"),
                               (layout(pp=2, microbatches=2), 2, None),
                               (layout(pp=8), 1, "cannot fill 8 pipeline stages")):
        if match is None:
            with pytest.raises(ConfigError, match="is not the per-rank batch"):
                pipeline_microbatches(with_micro, options, dp)  # 2 x 1 != 4: the two flags disagree
        else:
            with pytest.raises(ConfigError, match=match):
                pipeline_microbatches(config, options, dp)
    for bad, match in ((dict(pp=2, zero_stage=3, pp_schedule="zbh1", zero3_reshard_per_microbatch=True),
                        "use ZeRO-3's default under pp"),
                       (dict(microbatches=2), "need pp > 1"),
                       (dict(pp=2, virtual_stages=2), "without the interleaved schedule")):
        with pytest.raises(ConfigError, match=match):
            layout(**bad)
    layout(pp=2, tp=2, pp_schedule="zbh1")  # built: the tensor-parallel layers defer their dW too
    layout(pp=2, zero_stage=2, pp_schedule="zbh1")  # built: ZeRO-2 reduce-scatters after each W action
    layout(pp=2, zero_stage=3, pp_schedule="zbh1")  # built: the stage is reduced after the last W


def test_context_parallel_sizes_are_checked_before_anything_starts():
    from refimpl.config import ConfigError, ParallelConfig
    from refimpl.train import check_shapes

    config = config_from_args(build_parser().parse_args([*TINY, "--seq-len", "18", "--num-heads", "4"]))

    def check(cp: int, method: str, tp: int = 1, sp: bool = False) -> None:
        check_shapes(config, ParallelConfig(cp=cp, cp_method=method, tp=tp, sequence_parallel=sp))

    check(1, "ring")  # cp 1: nothing to check
    check(2, "ulysses")  # 18 = 2 x 9 tokens, 2 heads per rank
    with pytest.raises(ConfigError, match="--seq-len 18 does not divide by 4"):
        check(2, "ring")  # zig-zag: 2 cp chunks
    check(2, "ulysses", tp=2)  # 2 heads per tp rank: 1 per cp rank
    with pytest.raises(ConfigError, match=r"\(4 / --tp 4 = 1\) do not divide by 2"):
        check(2, "ulysses", tp=4)
    with pytest.raises(ConfigError, match="each context-parallel rank's 9 tokens"):  # not over tp 2
        check(2, "ulysses", tp=2, sp=True)


LAYOUT_REFUSALS = {  # name -> (flags, what the one error line must say)
    "pp2-zero3-reshard-zbh1": (["--pp", "2", "--zero-stage", "3", "--pp-schedule", "zbh1",
                                "--zero3-reshard-per-microbatch"],
                               "--zero3-reshard-per-microbatch with the zbh1 schedule"),
    "tp4-heads": (["--tp", "4"], "--tp 4 does not divide the 2 attention heads"),
    "sp-without-tp": (["--sequence-parallel"], "needs tp > 1"),
    # the cp and pp sizes take the same path (preflight, exit 2 before launch); their other cases are
    # checked in process (test_context_parallel_sizes..., test_pipeline_micro_batches...)
    "cp4-ring-seq": (["--cp", "4", "--seq-len", "20"], "--seq-len 20 does not divide by 8"),
    "pp4-layers": (["--pp", "4"], "--num-layers 1 cannot fill 4 pipeline stages"),
    "dp-not-world": (["--dp", "3"], "does not match the world size 4"),
    "dp-zero": (["--dp", "0"], "positive integer"),
}


@pytest.fixture(scope="module")
def layout_refusals(files) -> dict[str, tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]]:
    """Each refusal twice: through the self-launch (--nproc-per-node 4) and as a rank under torchrun's
    environment (RANK/WORLD_SIZE set, no MASTER_ADDR: the refusal must come before init_process_group)."""

    def run(job: tuple[str, bool]) -> subprocess.CompletedProcess:
        name, as_rank = job
        cwd = files["root"] / f"layout-{name}-{'rank' if as_rank else 'launch'}"
        cwd.mkdir()
        args = [*TINY, "--batch-size", "4", "--data", str(files["corpus"]), *LAYOUT_REFUSALS[name][0],
                "--out", str(cwd / "run")]
        env = {}
        if as_rank:
            env.update(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4")
        else:
            args += ["--nproc-per-node", "4"]
        if name not in IN_A_CHILD:
            return _cli_in_process(args, cwd, env)
        return subprocess.run([sys.executable, "-m", "refimpl.train", *args], cwd=cwd,
                              env=_env(cwd / "cache") | env, capture_output=True, text=True,
                              timeout=CLI_TIMEOUT_S)

    jobs = [(name, as_rank) for name in LAYOUT_REFUSALS for as_rank in (False, True)]
    # in this process first (it changes os.environ and the working directory), then the children together
    done = {job: run(job) for job in jobs if job[0] not in IN_A_CHILD}
    with ThreadPoolExecutor(max_workers=4) as pool:
        children = {job: pool.submit(run, job) for job in jobs if job[0] in IN_A_CHILD}
        done |= {job: future.result() for job, future in children.items()}
    return {name: (done[(name, False)], done[(name, True)]) for name in LAYOUT_REFUSALS}


@pytest.mark.timeout(3 * CLI_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(LAYOUT_REFUSALS))
def test_unbuilt_or_wrong_layout_is_refused_in_one_line(name, layout_refusals, files):
    for proc in layout_refusals[name]:
        report = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        assert proc.returncode == 2, report
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], report  # one line
        assert proc.stderr.startswith("error: ") and LAYOUT_REFUSALS[name][1] in proc.stderr, report
        assert "launching" not in proc.stdout and "Traceback" not in proc.stderr, report
    for where in ("launch", "rank"):
        assert not (files["root"] / f"layout-{name}-{where}" / "run").exists(), (name, where)


def test_layout_flags_default_dp_to_the_world_over_the_other_axes():
    from refimpl.distributed import ParallelDims
    from refimpl.train import options_from_args

    args = build_parser().parse_args([*TINY])
    assert options_from_args(args).parallel_dims(4) == ParallelDims(dp=4)
    args = build_parser().parse_args([*TINY, "--dp", "2"])
    with pytest.raises(ValueError, match="does not match the world size 4"):
        options_from_args(args).parallel_dims(4)


def test_the_layout_flags_are_parallel_configs_fields():
    """The "parallelism and precision" flags are ``ParallelConfig``'s fields that declare one, in its order,
    each defaulting to the field's; ``options_from_args`` gives them to ``ParallelConfig`` and config.json's
    "run" is its ``dataclasses.asdict`` (``pp_balance`` too, which the hand-written dict dropped)."""
    import dataclasses

    from refimpl.config import ParallelConfig, flag_of
    from refimpl.train import options_from_args

    parser = build_parser()
    group = next(g for g in parser._action_groups if g.title == "parallelism and precision")
    flagged = [f.name for f in dataclasses.fields(ParallelConfig) if "flag" in f.metadata]
    assert [a.option_strings for a in group._group_actions] == [[flag_of(name)] for name in flagged]
    assert options_from_args(parser.parse_args([])).parallel == ParallelConfig()
    options = options_from_args(parser.parse_args([
        "--tp", "2", "--sequence-parallel", "--pp", "2", "--pp-balance", "parameters", "--zero-stage", "1",
        "--precision", "bf16", "--microbatches", "4", "--activation-checkpointing"]))
    want = ParallelConfig(tp=2, sequence_parallel=True, pp=2, pp_balance="parameters", zero_stage=1,
                          precision="bf16", microbatches=4, activation_checkpointing="all")
    assert options.parallel == want and options.to_dict() == dataclasses.asdict(want)
    assert options.to_dict()["pp_balance"] == "parameters"


# ---------------------------------------------------------------- memory preflight and SIGTERM

GIB = 2**30


def _run_cli(args: list[str], cwd: Path, *, memory: int | None = None,
             timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """The CLI with this node's memory injected (``REFIMPL_MEMORY_BYTES``), so that the verdict does not
    depend on the machine the test runs on."""
    env = _env(cwd / "cache") | ({"REFIMPL_MEMORY_BYTES": str(memory)} if memory is not None else {})
    return subprocess.run([sys.executable, "-m", "refimpl.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(2 * CLI_TIMEOUT_S)
@pytest.mark.parametrize("launch", [[], ["--nproc-per-node", "2"]], ids=["plain", "self-launch"])
def test_a_run_too_large_for_the_memory_is_refused_fast(launch, files, tmp_path):
    """A run too large for the machine (--seq-len 100000) on a node of 16 GiB: one error line with the
    estimate broken down and the memory per rank, exit status 2, in seconds, and (self-launch) before
    torchrun starts."""
    import time

    begin = time.monotonic()
    r = _run_cli(["--seq-len", "100000", "--steps", "2", "--data", str(files["corpus"]),
                  "--out", str(tmp_path / "run"), *launch], tmp_path, memory=16 * GIB)
    elapsed = time.monotonic() - begin
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the run needs about "), r.stderr
    # two self-launched ranks share the node and each gets half the batch (micro-batch 8 instead of 16)
    need, blocks, have = ("55.4", "50,195.3", "16.0") if not launch else ("27.8", "25,097.7", "8.0")
    for figure in (f"{need} GiB per rank", f"block activations {blocks}",
                   f"this machine has {have} GiB per rank", "--force"):
        assert figure in lines[0], lines[0]
    assert "launching:" not in r.stdout and not (tmp_path / "run").exists()
    assert elapsed < 30, f"refusing took {elapsed:.1f} s"


def test_the_default_config_is_not_refused_on_this_machine():
    """The defaults (one process, and `make train`'s two self-launched CPU ranks) fit this machine's real
    memory; the run refused above does not fit a 16 GiB node, but its estimate is the same."""
    from refimpl.train import machine_memory_per_rank, options_from_args, preflight_memory

    args = build_parser().parse_args([])
    config, options = config_from_args(args), options_from_args(args)
    for ranks in (1, 2):
        need = preflight_memory(config, resolve(config, options, ranks), ranks_per_node=ranks)
        have, _ = machine_memory_per_rank(ranks)
        assert need.total < min(have, GIB), (need.describe(), have)
    big = build_parser().parse_args(["--seq-len", "100000"])
    config = config_from_args(big)
    need = preflight_memory(config, resolve(config, options_from_args(big), 1), ranks_per_node=1, force=True)
    assert 55 * GIB < need.total < 56 * GIB


@pytest.mark.timeout(2 * CLI_TIMEOUT_S + 60)
def test_force_gets_past_the_memory_check(files, tmp_path):
    """A node of 1000 bytes (injected) refuses even the tiny run; --force warns (the numbers) and trains."""
    flags = [*TINY, "--steps", "2", "--batch-size", "2", "--data", str(files["corpus"])]
    refused = _run_cli([*flags, "--out", str(tmp_path / "refused")], tmp_path, memory=1000)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("error: the run needs about "), refused.stderr
    forced = _run_cli([*flags, "--out", str(tmp_path / "forced"), "--force"], tmp_path, memory=1000)
    assert forced.returncode == 0, forced.stderr
    assert "warning: the run needs about " in forced.stderr and "(--force)" in forced.stderr
    assert len(_read_metrics(tmp_path / "forced")) == 2


def _start_sleeping_run(files, out: Path, *extra: str) -> tuple[subprocess.Popen, list[str]]:
    """A tiny run whose step 0 sleeps (--test-sleep-in-step); returns once the sleep has begun."""
    cmd = [sys.executable, "-m", "refimpl.train", *TINY, "--steps", "3", "--batch-size", "2",
           "--data", str(files["corpus"]), "--out", str(out), "--checkpoint-every", "1", *extra]
    proc = subprocess.Popen(cmd, cwd=out.parent, env=_env(out.parent / "cache"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "[test] step 0 sleeps" in line:
            return proc, seen
    proc.wait()
    raise AssertionError(f"the run ended before its step slept: {''.join(seen)}")


def _sigterm_and_wait(proc: subprocess.Popen, timeout: float, *, second_after: float | None = None):
    import signal
    import time

    begin = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    if second_after is not None:
        time.sleep(second_after)
        assert proc.poll() is None, "the first SIGTERM alone must not end a step at once"  # control
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return time.monotonic() - begin, err


@pytest.mark.timeout(CLI_TIMEOUT_S + 60)
def test_sigterm_in_a_step_that_never_ends_exits_after_the_grace(files, tmp_path):
    grace = 4
    proc, _ = _start_sleeping_run(files, tmp_path / "run", "--test-sleep-in-step", "600",
                                  "--sigterm-grace", str(grace))
    elapsed, err = _sigterm_and_wait(proc, grace + 30)
    assert proc.returncode == 143, err
    assert f"did not end within the grace of {grace} s (--sigterm-grace)" in err, err
    assert "exiting at once with status 143" in err
    assert grace - 0.5 <= elapsed <= grace + 5, elapsed  # it waited for the step, then no longer
    assert not list((tmp_path / "run" / "checkpoints").glob("step*")), "nothing saved"


@pytest.mark.timeout(CLI_TIMEOUT_S + 60)
def test_two_sigterms_exit_at_once(files, tmp_path):
    proc, _ = _start_sleeping_run(files, tmp_path / "run", "--test-sleep-in-step", "600")  # grace 60 s
    elapsed, err = _sigterm_and_wait(proc, 30, second_after=1.0)
    assert proc.returncode == 143, err
    assert "error: SIGTERM: a second SIGTERM; exiting at once" in err, err
    assert elapsed < 1.0 + 5, elapsed


@pytest.mark.timeout(CLI_TIMEOUT_S + 60)
def test_sigterm_within_the_grace_still_saves_and_stops(files, tmp_path):
    """The first SIGTERM's behaviour is kept when the step ends in time: save after the step, exit 143."""
    proc, _ = _start_sleeping_run(files, tmp_path / "run", "--test-sleep-in-step", "2")
    elapsed, err = _sigterm_and_wait(proc, 60)
    assert proc.returncode == 143, err
    assert "stopped on SIGTERM after saving step 1" in err and "run the same command again" in err, err
    assert "exiting at once" not in err
