"""``python -m refimpl.plan`` (chapter 10's planner for users): the layouts it prints multiply out to the
GPUs, fit the memory it states and come fastest first; a model no layout fits exits 1 and says what the
smallest layout needs; bad input is one line on stderr with exit status 2, before any estimate.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from refimpl.plan import GPUS, main, model_for, plan_layouts

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+) \|\s+([\d.]+)\s+([\d.]+) GB "
                 r".*\|\s+([\d.]+)\s+\d+%$")  # dp tp pp cp m | state activations GB ... | step s MFU


def test_the_printed_layouts_fit_multiply_out_and_come_fastest_first(capsys):
    assert main(["--params", "70e9", "--gpus", "512", "--gpu", "H100", "--seq-len", "4096",
                 "--global-batch", "1024"]) == 0
    out = capsys.readouterr().out
    rows = [ROW.match(line) for line in out.splitlines()]
    rows = [r for r in rows if r]
    assert len(rows) == 10, out
    limit = 0.9 * GPUS["H100"]["memory"] / 1e9
    steps = []
    for r in rows:
        dp, tp, pp, cp, m = (int(r.group(i)) for i in range(1, 6))
        assert dp * tp * pp * cp == 512 and m * dp == 1024, r.group(0)  # micro-batch 1
        assert float(r.group(6)) + float(r.group(7)) <= limit + 0.1, r.group(0)
        steps.append(float(r.group(8)))
    assert steps == sorted(steps)
    assert "assumptions:" in out and "data sheets" in out


def test_more_memory_saving_makes_more_layouts_fit():
    config = model_for(70e9, vocab_size=32000, seq_len=4096)
    kw = dict(gpus=64, gpu="H100", gpus_per_node=8, seq_len=4096, global_batch=256)
    plain = plan_layouts(config, **kw)
    recomputed = plan_layouts(config, **kw, recompute=True)
    fits = {(p.dp, p.tp, p.pp, p.cp) for p in plain if p.fits}
    fits_recomputed = {(p.dp, p.tp, p.pp, p.cp) for p in recomputed if p.fits}
    assert fits < fits_recomputed  # recomputation keeps every layout that fitted and admits more


def test_recomputation_without_flash_attention_keeps_the_recomputed_layers_scores():
    # the one layer being recomputed saves its s^2 attention scores unless flash attention drops them, so
    # --recompute --no-flash holds more than --recompute, on every layout (equal before the scores counted)
    config = model_for(70e9, vocab_size=32000, seq_len=4096)
    kw = dict(gpus=64, gpu="H100", gpus_per_node=8, seq_len=4096, global_batch=256, recompute=True)
    flash = {(p.dp, p.tp, p.pp, p.cp): p.activation_bytes for p in plan_layouts(config, **kw)}
    scores = {(p.dp, p.tp, p.pp, p.cp): p.activation_bytes for p in plan_layouts(config, **kw, flash=False)}
    assert flash.keys() == scores.keys()
    assert all(scores[k] > flash[k] for k in flash)


def test_a_model_that_fits_nowhere_exits_1_and_names_the_smallest_need(capsys):
    assert main(["--params", "1e12", "--gpus", "8", "--global-batch", "8"]) == 1
    out = capsys.readouterr().out
    assert "none fits: the smallest needs" in out and "GB per GPU" in out


@pytest.mark.parametrize("argv, message", [
    (["--params", "-1", "--gpus", "8", "--global-batch", "8"], "--params must be positive"),
    (["--gpus", "8", "--global-batch", "8"], "give --params, or all of"),
    (["--params", "7e9", "--num-layers", "32", "--gpus", "8", "--global-batch", "8"], "not both"),
    (["--params", "7e9", "--gpus", "0", "--global-batch", "8"], "--gpus must be >= 1"),
    (["--params", "7e9", "--gpus", "8", "--global-batch", "8", "--mfu", "1.5"], "--mfu is a fraction"),
    (["--num-layers", "30", "--hidden-size", "4096", "--num-heads", "32", "--gpus", "7",
      "--global-batch", "3"], "no layout of 7 GPUs"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_it_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "refimpl.plan", "--params", "7e9", "--gpus", "8",
                           "--global-batch", "64", "--top", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "layouts considered" in proc.stdout
