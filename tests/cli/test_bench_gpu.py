"""bench/gpu/check.py, the prepared one-GPU check, on the CPU: ``--smoke`` runs every part's code at tiny
sizes (gloo at world size 1, the fp8 and grouped GEMMs against float64, the trainer in bf16 and fp8, the
gpu-marked tests collected) and writes ``gpu_check.json`` and ``gpu_check.md`` into ``$OUT``; a bad flag is
refused with exit status 2, also through bench/gpu/run.sh.

The smoke run hides tqdm and matplotlib from the check's process (a finder that refuses them, installed
before the script runs): a bare GPU image may lack both, and the check must then stand in for the progress
bar and skip the trainer's report, and say so. Its child processes (pytest) see the environment as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "gpu" / "check.py"
SMOKE_TIMEOUT_S = 600  # about 30 s of CPU; two loaded lanes on two cores stretch it, never its verdict

# Runs check.py as __main__ in a process where tqdm and matplotlib cannot be imported (a bare image's).
BARE_IMAGE = """
import runpy, sys
from importlib.abc import MetaPathFinder

class Hide(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("tqdm", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: a bare image)", name=name)
        return None

sys.meta_path.insert(0, Hide())
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([sys.executable, "-c", BARE_IMAGE, str(CHECK), "--smoke"], cwd=ROOT,
                          env={**os.environ, "OUT": str(out)}, capture_output=True, text=True,
                          timeout=SMOKE_TIMEOUT_S)
    return {"proc": proc, "out": out}


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_the_smoke_run_passes_and_writes_the_json_and_the_markdown(smoke):
    proc, out = smoke["proc"], smoke["out"]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["mode"] == "smoke" and result["ok"] is True
    assert {"process_group", "scaled_mm", "async_timing", "trainer", "grouped_mm", "pytest_gpu"} <= set(
        result["checks"])
    env = result["environment"]
    assert {"torch", "cuda", "nccl", "python", "modules", "torch_is_suite_version"} <= set(env)
    assert env["modules"]["tqdm"] is None and env["modules"]["matplotlib"] is None  # hidden, and seen so
    stand_ins = " ".join(result["stand_ins"])
    assert "tqdm" in stand_ins and "matplotlib" in stand_ins


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_each_check_holds_its_figures(smoke):
    checks = json.loads((smoke["out"] / "gpu_check.json").read_text())["checks"]
    group = checks["process_group"]
    assert group["backend"] == "gloo" and group["group_device"] == "cpu" and group["collectives_ok"]
    fp8 = checks["scaled_mm"]["cases"]
    assert {(c["gemm"], c["scaling"]) for c in fp8} >= {("forward", "tensorwise"), ("grad_weight", "rowwise")}
    assert all(c["error_ratio"] <= 1.0 < c["control_ratio"] for c in fp8)  # the bound passes, x 2 does not
    grouped = checks["grouped_mm"]["cases"]
    assert grouped[-1]["empty_groups_zero_grad"] is True and all(c["ok"] for c in grouped)
    timing = checks["async_timing"]
    assert timing["status"] == "skip" and timing["cpu_clock_synced_s"] >= timing["cpu_clock_no_sync_s"]
    rows = checks["trainer"]["rows"]
    assert [r["precision"] for r in rows] == ["bf16", "fp8"] and all(r["status"] == "pass" for r in rows)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["planned_bytes"] > 0 and r["mfu"] is None  # no CPU peak: no MFU
    assert checks["pytest_gpu"]["status"] in ("pass", "skip")


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_the_markdown_holds_the_tables(smoke):
    text = (smoke["out"] / "gpu_check.md").read_text()
    assert text.startswith("# GPU check (bench/gpu/check.py --smoke)")
    assert "| check | status | detail |" in text and "| fp8 GEMM (torch._scaled_mm) | pass |" in text
    assert "| model | precision | steps (timed) | tokens/s (median) | MFU (dense bf16 peak) |" in text
    assert "all checks passed" in text


def test_the_gpu_rows_parse_and_the_planner_fits_them_on_an_h100(tmp_path):
    """The GPU rows run only on a GPU: here the trainer's own parser takes their flags in both precisions,
    and the planner puts every row well inside an H100's 80 GB (one rank, the whole batch one micro-batch)."""
    from bench.gpu.trainer_rows import GPU_ROWS, PRECISIONS, _parse
    from refimpl.planner import run_memory_of

    for spec in GPU_ROWS:
        for precision in PRECISIONS:
            config, options = _parse(spec, precision, "nccl", tmp_path)
            assert options.parallel.precision == precision and options.checkpoint is None
            plan = run_memory_of(config.model, options.parallel, world_size=1, seq_len=config.data.seq_len,
                                 micro_batch=config.data.global_batch_size, num_microbatches=1)
            assert plan.total < 40 * 2**30, (spec.name, precision, plan.describe())


def test_without_a_gpu_and_without_smoke_it_refuses_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible (REFIMPL_TEST_GPU=1): the check would run")
    proc = subprocess.run([sys.executable, str(CHECK)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr.startswith("error: no CUDA device visible"), proc.stderr
    assert not any(tmp_path.iterdir())


def test_a_failed_check_exits_1_and_says_which(tmp_path):
    """Negative control: a budget too short for any part fails every check (not run), and the run says so
    in its exit status, its JSON and its markdown."""
    proc = subprocess.run([sys.executable, str(CHECK), "--smoke", "--budget-s", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["ok"] is False and result["checks"]["scaled_mm"]["status"] == "fail"
    assert "not run" in result["checks"]["scaled_mm"]["detail"]
    assert "SOME CHECK FAILED" in (tmp_path / "gpu_check.md").read_text()


def test_a_bad_flag_exits_2_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, str(CHECK), "--no-such-flag"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_run_sh_is_a_thin_wrapper_that_passes_flags_and_out(tmp_path):
    """bench/gpu/run.sh: bash accepts it, it runs check.py with .venv's Python if there is one (else
    python3, or ``$PY``) and hands it its flags: a bad one comes back as check.py's usage and status 2."""
    path = ROOT / "bench" / "gpu" / "run.sh"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    assert ".venv/bin/python" in text and "python3" in text and 'export OUT="${OUT:-bench/out/gpu}"' in text
    proc = subprocess.run(["bash", str(path), "--no-such-flag"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PY": sys.executable, "OUT": str(tmp_path)})
    assert proc.returncode == 2 and "usage: bench/gpu/check.py" in proc.stderr, proc.stderr
