"""``python -m refimpl.plan`` (chapter 12's planner for users): the layouts it prints multiply out to the
GPUs, fit the memory it states and come fastest first; a model no layout fits exits 1 and says what the
smallest layout needs; bad input is one line on stderr with exit status 2, before any estimate. The search
over ZeRO stages 0-3, recomputation and HSDP keeps, per layout, the lowest stage that fits; ``--layout``
estimates one layout at every stage with the ZeRO paper's state figures (the seed: DP128 x TP8 x PP2 of a
1T model on 2048 H100 fits at ZeRO-3 only, chapter 12).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from refimpl.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from refimpl.plan import GPUS, evaluate_layout, main, model_for, plan_layouts
from refimpl.plan import _config as config_of
from refimpl.plan import build_parser as build_parser_plan
from refimpl.planner import STAGES, param_count, zero_memory_paper
from refimpl.support import check_supported
from refimpl.train import build_parser, options_from_args
from refimpl.train.layout import check_experts, check_shapes, forwards_per_step

# dp tp pp cp m hsdp | ZeRO recompute | state gathered activations GB | ... | step s MFU
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+) \|\s+(\d)m?\s+(none|every) \|"
                 r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) GB .*\|\s+([\d.]+)\s+\d+%$")


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
        assert sum(float(r.group(i)) for i in (9, 10, 11)) <= limit + 0.2, r.group(0)
        steps.append(float(r.group(12)))
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
    (["--gpus", "8", "--global-batch", "8"], "give --params, --model, or all of"),
    (["--params", "7e9", "--num-layers", "32", "--gpus", "8", "--global-batch", "8"],
     "not --params and the shape"),
    (["--model", "llama3-8b", "--params", "7e9", "--gpus", "8", "--global-batch", "8"],
     "not --params and --model"),
    (["--model", "llama3-8b", "--num-kv-heads", "4", "--gpus", "8", "--global-batch", "8"],
     "--num-kv-heads describe a shape"),
    (["--params", "7e9", "--arch", "llama", "--gpus", "8", "--global-batch", "8"], "not with --params"),
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


# the seed's claim as chapter 12 puts it through the planner: a 1T model (model_for(1e12)) on 2048 H100 in
# nodes of 8, 2048 tokens per sequence, 2048 sequences per step, one per micro-batch
SEED = ["--params", "1e12", "--gpus", "2048", "--gpu", "H100", "--seq-len", "2048", "--global-batch", "2048"]
SEED_KW = dict(gpu="H100", gpus_per_node=8, seq_len=2048, global_batch=2048)
# ZeRO recompute | weights grads optimizer gathered activations total GB | dp sent GB | step s | fits
STAGE_ROW = re.compile(r"^\s*(\d)m?\s+(none|every) \|" + r"\s+([\d.]+)" * 6 + r" GB \|\s+([\d.]+) GB \|"
                       r"\s+([\d.]+) \| (yes|no), ([\d.]+) GB (spare|over)$")


@pytest.fixture(scope="module")
def big():
    return model_for(1e12, vocab_size=32000, seq_len=2048)


def _stage_rows(out: str) -> dict[int, re.Match]:
    return {int(m.group(1)): m for m in map(STAGE_ROW.match, out.splitlines()) if m}


def test_the_seed_lists_fitting_layouts_with_the_chosen_stage_and_recomputation(capsys):
    assert main(SEED) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("dp"))
    assert "ZeRO" in head and "recompute" in head and "hsdp" in head, head
    rows = [r for r in map(ROW.match, out.splitlines()) if r]
    assert len(rows) == 10, out
    for r in rows:
        dp, tp, pp, cp, m, hsdp, zero = (int(r.group(i)) for i in range(1, 8))
        assert dp * tp * pp * cp == 2048 and m * dp == 2048 and dp % hsdp == 0, r.group(0)
        assert zero in STAGES and (zero >= 1 or hsdp == 1), r.group(0)
        assert sum(float(r.group(i)) for i in (9, 10, 11)) <= 72.0 + 0.2, r.group(0)
    assert {int(r.group(7)) for r in rows} & {2, 3}, out  # a trillion parameters need ZeRO-2/3 somewhere


def test_the_seed_layout_fits_at_zero_3_only_with_the_papers_state(capsys, big):
    assert main([*SEED, "--layout", "dp=128,tp=8,pp=2"]) == 0
    out = capsys.readouterr().out
    rows = _stage_rows(out)
    assert sorted(rows) == [0, 1, 2, 3], out
    psi = param_count(big).total / (8 * 2)  # a rank's parameters, N / (tp pp)
    for stage, r in rows.items():
        want = zero_memory_paper(psi, 128, stage)  # sharded over dp x cp = 128
        printed = [r.group(i) for i in (3, 4, 5)]
        assert printed == [f"{x / 1e9:.1f}" for x in (want.weights, want.grads, want.optimizer)], r.group(0)
        fits = r.group(11) == "yes"
        assert fits == (float(r.group(8)) <= 72.0) and fits == (stage == 3), r.group(0)
    assert "ZeRO stages that fit: 3 (of 0, 1, 2, 3)" in out
    # under pp the trainer keeps a ZeRO-3 stage gathered (bf16 weights and gradients, 4 N / (tp pp) bytes):
    # that does not fit here, so the stage is gathered per micro-batch ("3m"): m = 16 times the dp bytes
    assert re.search(r"^\s+3m\s", out, re.M), out
    assert float(rows[3].group(9)) == pytest.approx(16 * 1.5 * float(rows[1].group(9)), rel=1e-3)
    # chapter 12's figures: 261.6 GB of state under ZeRO-1, 8.0 GB under ZeRO-3
    assert round(sum(float(rows[1].group(i)) for i in (3, 4, 5)), 1) == 261.6
    assert round(sum(float(rows[3].group(i)) for i in (3, 4, 5)), 1) == 8.0


def test_evaluate_layout_is_the_papers_table_sharded_over_the_zero_group(big):
    psi = param_count(big).total / (8 * 2)
    for stage in STAGES:
        plan = evaluate_layout(big, dp=128, tp=8, pp=2, **SEED_KW, zero_stage=stage)
        assert plan.state == zero_memory_paper(psi, 128, stage)
        assert plan.fits == (stage == 3) and plan.limit_bytes == 0.9 * GPUS["H100"]["memory"]
    # HSDP of 4 replicas: ZeRO shards over dp / 4 = 32 ranks; context parallelism shards over cp as dp does
    assert evaluate_layout(big, dp=128, tp=8, pp=2, **SEED_KW, zero_stage=3, dp_replicate=4).state == (
        zero_memory_paper(psi, 32, 3))
    assert evaluate_layout(big, dp=64, tp=8, pp=2, cp=2, **SEED_KW, zero_stage=1).state == (
        zero_memory_paper(psi, 128, 1))
    # the paper's published example (Rajbhandari et al. 2020, figure 1): 7.5B parameters on 64 devices
    assert [round(zero_memory_paper(7.5e9, 64, s).total / 1e9, 1) for s in STAGES] == [120.0, 31.4, 16.6, 1.9]


def test_zero_3_sends_half_again_the_dp_bytes_and_recomputation_a_third_more_compute(big):
    one = evaluate_layout(big, dp=128, tp=8, pp=2, **SEED_KW, zero_stage=1)
    three = evaluate_layout(big, dp=128, tp=8, pp=2, **SEED_KW, zero_stage=3)
    again = evaluate_layout(big, dp=128, tp=8, pp=2, **SEED_KW, zero_stage=3, recompute=True)
    # under pp ZeRO-3 either keeps the stage gathered (1.5 x the dp bytes, once per step) or, when that does
    # not fit (here), gathers and reduces per micro-batch: m = 16 times that
    assert three.zero3_per_microbatch and three.microbatches == 16
    assert three.sent["dp"] == pytest.approx(16 * 1.5 * one.sent["dp"]) and three.comm_s > one.comm_s
    flat = [evaluate_layout(big, dp=512, tp=4, pp=1, **SEED_KW, zero_stage=z) for z in (1, 3)]  # no pp
    assert flat[1].sent["dp"] == pytest.approx(1.5 * flat[0].sent["dp"]) and not flat[1].zero3_per_microbatch
    assert [three.sent[k] for k in ("tp", "pp", "cp")] == [one.sent[k] for k in ("tp", "pp", "cp")]
    assert again.recompute_s == pytest.approx(again.compute_s / 3) and again.step_s > three.step_s
    assert again.activation_bytes < three.activation_bytes and three.gathered_bytes > 0 == one.gathered_bytes


def test_the_search_keeps_the_lowest_stage_that_fits_and_recomputes_only_when_needed(big):
    plain = plan_layouts(big, gpus=2048, **SEED_KW, zero_stages=STAGES)  # no recompute
    for p in plain:
        fitting = [s for s in STAGES if evaluate_layout(big, dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, **SEED_KW,
                                                        zero_stage=s).fits]
        assert p.zero_stage == (min(fitting) if fitting else 3), (p.dp, p.tp, p.pp, p.cp, fitting)
    searched = plan_layouts(big, gpus=2048, **SEED_KW, zero_stages=STAGES, recompute=None,
                            hsdp=True)
    without = {(p.dp, p.tp, p.pp, p.cp): p for p in plain}
    assert sum(p.fits for p in searched) > sum(p.fits for p in plain)
    for p in searched:  # recomputation is chosen only where it is the faster way to fit (e.g. against a
        # ZeRO-3 stage gathered per micro-batch under pp, which multiplies the dp bytes by m)
        plain_p = without[(p.dp, p.tp, p.pp, p.cp)]
        if p.recompute and plain_p.fits:
            assert p.step_s < plain_p.step_s and plain_p.zero3_per_microbatch, (p.dp, p.tp, p.pp, p.cp)


def test_zero_1_alone_does_not_fit_the_seed_layout(capsys):
    # the negative control: the search restricted to ZeRO-1 (the planner before) fails the same layout
    assert main([*SEED, "--layout", "dp=128,tp=8,pp=2", "--zero-stages", "1"]) == 1
    out = capsys.readouterr().out
    assert sorted(_stage_rows(out)) == [1] and "ZeRO stages that fit: none (of 1)" in out
    assert main([*SEED, "--layout", "dp=128,tp=8,pp=2,zero=1"]) == 1  # the given stage decides
    assert "ZeRO-1 (given): does not fit" in capsys.readouterr().out
    assert main([*SEED, "--layout", "dp=128,tp=8,pp=2,zero=3"]) == 0
    assert "ZeRO-3 (given): fits" in capsys.readouterr().out
    assert main([*SEED, "--zero-stages", "1", "--recompute", "none", "--no-hsdp"]) == 0
    rows = [r for r in map(ROW.match, capsys.readouterr().out.splitlines()) if r]
    assert rows and all(r.group(7) == "1" for r in rows)
    assert all((int(r.group(1)), int(r.group(2)), int(r.group(3))) != (128, 8, 2) for r in rows)


def _trainer_flags(p, *, seq_len: int, global_batch: int, micro_batch: int) -> list[str]:
    """The trainer's flags for one planned combination, written from the planner's fields (an independent
    statement of ``refimpl.planner.layout_plan.trainer_config``'s mapping): bf16, sequence parallelism
    at tp > 1, every block recomputed, ``m`` pipeline micro-batches under pp (without a pipeline they are
    gradient accumulation: the batch over --micro-batch-size)."""
    flags = ["--dp", str(p.dp), "--tp", str(p.tp), "--pp", str(p.pp), "--cp", str(p.cp), "--dp-replicate",
             str(p.dp_replicate), "--zero-stage", str(p.zero_stage), "--precision", "bf16", "--seq-len",
             str(seq_len), "--batch-size", str(global_batch), "--micro-batch-size", str(micro_batch)]
    flags += ["--sequence-parallel"] * (p.tp > 1) + ["--activation-checkpointing"] * p.recompute
    flags += ["--microbatches", str(p.microbatches)] * (p.pp > 1)
    return flags + ["--zero3-reshard-per-microbatch"] * p.zero3_per_microbatch


def _trainer_checks(model, flags: list[str], gpus: int) -> int:
    """What the trainer checks of a run before its first step, in its own code: the options from the flags
    (RunOptions: the support table), the layout of ``gpus`` ranks, tensor and context parallelism against
    the model and the sequence, experts, the batch split, the pipeline's micro-batches, and parallelize's
    check; the model is the planner's (the trainer's command line builds a byte-level one). Returns the
    forwards per step; a ConfigError when the trainer refuses the run."""
    args = build_parser().parse_args(flags)
    options = options_from_args(args)
    config = TrainConfig(model=model, data=DataConfig(seq_len=args.seq_len, global_batch_size=args.batch_size,
                                                      micro_batch_size=args.micro_batch_size))
    dims = options.parallel_dims(gpus)
    check_shapes(config, options.parallel)
    check_experts(config, options)
    config.data.accumulation_steps(dims.dp)
    forwards = forwards_per_step(config, options, dims.dp)
    check_supported(dims.config(**{k: v for k, v in vars(options.parallel).items()
                                   if k not in ("dp", "cp", "tp", "pp", "dp_replicate", "ep")}))
    return forwards


# (parameters, GPUs, sequence length, global batch, micro-batch): a 70B run on 64 H100s first (its top layout
# was dp 2 tp 4 pp 4 cp 2 with HSDP 2 at ZeRO-1, which the trainer refuses), then other sizes and clusters;
# 96 and 48 GPUs let tp take a factor 3 that a 32000-entry vocabulary does not split
TRAINER_CASES = [(70e9, 64, 8192, 128, 1), (70e9, 512, 4096, 1024, 1), (70e9, 96, 4096, 192, 1),
                 (13e9, 48, 4096, 96, 1), (7e9, 8, 4096, 64, 1), (175e9, 256, 2048, 512, 1),
                 (70e9, 64, 4096, 256, 2)]


@pytest.mark.parametrize("params, gpus, seq_len, global_batch, micro_batch", TRAINER_CASES)
def test_the_trainer_runs_every_layout_the_planner_ranks(params, gpus, seq_len, global_batch, micro_batch):
    config = model_for(params, vocab_size=32000, seq_len=seq_len)
    plans = plan_layouts(config, gpus=gpus, gpu="H100", gpus_per_node=8, seq_len=seq_len,
                         global_batch=global_batch, micro_batch=micro_batch, zero_stages=STAGES,
                         recompute=None, hsdp=True)  # the command line's search
    assert sum(p.fits for p in plans) >= 10
    for p in plans:  # the ranked ones that fit first, then the rest: every one the trainer's
        flags = _trainer_flags(p, seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch)
        assert options_from_args(build_parser().parse_args(flags)).parallel == p.parallel, flags
        assert _trainer_checks(config, flags, gpus) == p.microbatches, flags


def test_the_trainer_check_refuses_the_former_top_layout(capsys):
    # the negative control of the test above: the layout the planner ranked first before it read the support
    # table (dp 2 tp 4 pp 4 cp 2, HSDP 2, ZeRO-1) is refused by the same checks, in the table's words
    config = model_for(70e9, vocab_size=32000, seq_len=8192)
    former = evaluate_layout(config, dp=2, tp=4, pp=4, cp=2, seq_len=8192, global_batch=128, zero_stage=3,
                             dp_replicate=2)
    flags = _trainer_flags(former, seq_len=8192, global_batch=128, micro_batch=1)
    flags[flags.index("--zero-stage") + 1] = "1"
    with pytest.raises(ConfigError, match=r"HSDP \(dp_replicate > 1\) without ZeRO-3"):
        _trainer_checks(config, flags, 64)
    with pytest.raises(ConfigError, match=r"HSDP \(dp_replicate > 1\) without ZeRO-3"):  # the planner alike
        evaluate_layout(config, dp=2, tp=4, pp=4, cp=2, seq_len=8192, global_batch=128, zero_stage=1,
                        dp_replicate=2)
    # a tensor-parallel degree the vocabulary does not split: refused by both, never ranked
    tp3 = SimpleNamespace(dp=4, tp=3, pp=4, cp=2, dp_replicate=1, zero_stage=1, recompute=False,
                          microbatches=48, zero3_per_microbatch=False)
    flags = _trainer_flags(tp3, seq_len=4096, global_batch=192, micro_batch=1)
    with pytest.raises(ConfigError, match="does not divide by 3"):
        _trainer_checks(model_for(70e9, vocab_size=32000, seq_len=4096), flags, 96)
    with pytest.raises(ConfigError, match="does not divide the 32000 vocabulary"):
        evaluate_layout(model_for(70e9, vocab_size=32000, seq_len=4096), dp=4, tp=3, pp=4, cp=2, seq_len=4096,
                        global_batch=192)
    # and the 70B command on 64 GPUs ranks no HSDP below ZeRO-3 now
    assert main(["--params", "70e9", "--gpus", "64", "--gpu", "H100", "--seq-len", "8192",
                 "--global-batch", "128"]) == 0
    rows = [r for r in map(ROW.match, capsys.readouterr().out.splitlines()) if r]
    assert len(rows) == 10 and all(int(r.group(6)) == 1 or int(r.group(7)) == 3 for r in rows), rows
    assert [int(rows[0].group(i)) for i in range(1, 8)] == [1, 2, 8, 4, 128, 1, 1]


def test_a_layout_with_hsdp_shows_the_stages_the_trainer_takes(capsys):
    assert main([*SEED, "--layout", "dp=128,tp=8,pp=2,hsdp=4"]) == 0
    out = capsys.readouterr().out
    assert sorted(_stage_rows(out)) == [3], out  # HSDP is ZeRO-3's: stages 0-2 are named, not estimated
    assert "ZeRO-0, 1, 2 not shown: the trainer refuses them at this layout (HSDP (dp_replicate > 1) " in out


@pytest.mark.parametrize("layout, message", [
    ("dp=128,tp=8,pp=1", "dp x tp x pp x cp = 1024, not --gpus 2048"),
    ("dp=128,tp=8", "--layout needs pp="),
    ("dp=128,tp=8,pp=2,ep=2", "ep 2 splits the routed experts: the model has 0"),
    ("dp=128,tp=8,pp=2,ep=3", "ep 3 does not divide the 128 dp x cp ranks"),
    ("dp=128,tp=8,pp=2,cores=2", "unknown key 'cores'"),
    ("dp=128,tp=8,pp=2,dp=128", "repeated key 'dp'"),
    ("dp=128,tp=eight,pp=2", "tp='eight' is not an integer"),
    ("dp=64,tp=16,pp=2", "tp 16 does not divide the 168 heads"),
    ("dp=128,tp=8,pp=2,zero=4", "ZeRO stage must be one of"),
    ("dp=128,tp=8,pp=2,hsdp=3", "hsdp 3 does not divide the 128 dp ranks"),
    ("dp=128,tp=8,pp=2,hsdp=4,zero=1",
     "--layout zero=1: the trainer refuses it here: HSDP (dp_replicate > 1) without ZeRO-3"),
])
def test_a_bad_layout_is_one_line_and_exit_2(layout, message, capsys):
    assert main([*SEED, "--layout", layout]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and message in captured.err, captured.err
    assert captured.err.count("\n") == 1, captured.err


def test_bad_zero_stages_are_one_line_and_exit_2(capsys):
    for stages in ("1,4", "one"):
        assert main([*SEED, "--zero-stages", stages]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --zero-stages") and err.count("\n") == 1, err


def test_the_layout_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "refimpl.plan", *SEED, "--layout", "dp=128,tp=8,pp=2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ZeRO stages that fit: 3" in proc.stdout


@pytest.mark.parametrize("name, published", [("llama3-8b", "8.03"), ("llama3-70b", "70.6"),
                                             ("llama3-405b", "405.9")])
def test_a_preset_prints_its_published_size_and_our_count_agrees(name, published, capsys):
    """``--model`` plans a published model: the header names it with the model card's size, and our count
    of the Llama form, printed to two decimals, rounds to it (tests/planner/test_planner.py checks the
    count)."""
    assert main(["--model", name, "--gpus", "1024", "--seq-len", "8192", "--global-batch", "1024",
                 "--top", "1"]) in (0, 1)
    header = capsys.readouterr().out.splitlines()[0]
    match = re.search(rf"model: {name} \(published: {published}B\), ([\d.]+)B parameters \(Llama form, 8 "
                      r"key/value heads", header)
    assert match, header
    assert f"{float(match.group(1)):.{len(published.split('.')[1])}f}" == published, header


def test_the_llama_shape_flags_build_the_llama_form_and_its_activations():
    """``--arch llama --num-kv-heads --ffn-hidden-size`` is the Llama form; its activation estimate is the
    paper's count at its own sizes: fewer k/v bytes with fewer key/value heads, SwiGLU's third f-wide
    tensor, no dropout masks; GPT-2's form keeps the paper's ``34 sbh/t`` (negative control: the same shape
    as GPT-2 gives another figure)."""
    from refimpl.planner.activations import korthikanti_bytes_per_layer, paper_bytes_per_layer

    args = build_parser_plan().parse_args(["--num-layers", "2", "--hidden-size", "1024", "--num-heads", "8",
                                           "--arch", "llama", "--num-kv-heads", "2", "--ffn-hidden-size",
                                           "2816", "--gpus", "8", "--global-batch", "8"])
    llama = config_of(args)
    assert (llama.activation, llama.num_key_value_heads, llama.ffn_hidden_size) == ("swiglu", 2, 2816)
    s, b, h, d = 4096, 1, 1024, 128
    gpt = ModelConfig(num_layers=2, hidden_size=h, num_attention_heads=8, vocab_size=32000)
    for t in (1, 2, 4, 8):
        for flash in (True, False):
            paper = korthikanti_bytes_per_layer(seq_len=s, micro_batch=b, hidden_size=h, num_heads=8, tp=t,
                                                sequence_parallel=True)
            assert paper_bytes_per_layer(gpt, seq_len=s, micro_batch=b, tp=t, sequence_parallel=True,
                                         flash=flash) == paper - (5 * 8 // t * s * s * b if flash else 0)
        kw = dict(seq_len=s, micro_batch=b, tp=t, sequence_parallel=True, flash=True, dropout=False)
        ours = paper_bytes_per_layer(llama, **kw)
        mha = paper_bytes_per_layer(dataclasses.replace(llama, num_key_value_heads=8), **kw)
        assert mha - ours == 4 * s * b * d * (8 // t - max(2 // t, 1))  # K and V at 2 heads, not 8
        assert paper_bytes_per_layer(dataclasses.replace(llama, activation="gelu"), **kw) < ours  # SwiGLU


# DeepSeek-V3 on 2048 H100s at its pre-training sequence length (DeepSeek-AI 2024: 4096 tokens)
DEEPSEEK = ["--model", "deepseek-v3", "--gpus", "2048", "--seq-len", "4096", "--global-batch", "2048"]
# dp tp pp cp ep m hsdp | ZeRO recompute | ...
MOE_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+) \|"
                     r"\s+(\d)m?\s+(none|every) \|")


def test_an_moe_preset_plans_an_expert_axis_and_no_tensor_parallelism(capsys):
    """DeepSeek-V3 by name: the header gives the card's 671B total and 37B activated beside our 671.026B
    and the 36.6B a token multiplies; every layout printed splits the experts (ep > 1 within dp x cp) and
    none uses tensor parallelism, which the trainer refuses for multi-head latent attention (the support
    table's shape rules: the search asks them)."""
    assert main([*DEEPSEEK, "--gpus", "1952", "--global-batch", "1952", "--top", "5"]) == 0  # 61 x 32
    out = capsys.readouterr().out
    assert re.search(r"model: deepseek-v3 \(published: 671B\), 671\.026B parameters, 36\.6B multiplied per "
                     r"token \(published: 37B\) \(multi-head latent attention", out), out
    rows = [[int(r.group(i)) for i in range(1, 8)] for r in map(MOE_ROW.match, out.splitlines()) if r]
    assert len(rows) >= 2 and {r[2] for r in rows} == {1, 61}, out  # equal stages of 61 blocks: 1 or 61
    for dp, tp, pp, cp, ep, _, _ in rows:
        assert tp == cp == 1 and ep > 1 and dp % ep == 0 and 256 % ep == 0 and dp * pp == 1952, rows
    assert "MoE: the routed experts split over ep" in out


def test_the_trainer_takes_every_moe_layout_the_planner_ranks():
    """The planner's MoE layouts through the trainer's own checks (as for the dense ones above, with
    ``--ep``): the experts split, the shapes, the support table's MoE rows."""
    config = config_of(build_parser_plan().parse_args(DEEPSEEK))
    plans = plan_layouts(config, gpus=1952, gpu="H100", gpus_per_node=8, seq_len=4096, global_batch=1952,
                         zero_stages=STAGES, recompute=None, hsdp=True)
    assert sum(p.fits for p in plans) >= 2 and {p.ep for p in plans} != {1}
    for p in plans:
        flags = _trainer_flags(p, seq_len=4096, global_batch=1952, micro_batch=1) + ["--ep", str(p.ep)]
        assert options_from_args(build_parser().parse_args(flags)).parallel == p.parallel, flags
        assert _trainer_checks(config, flags, 1952) == p.microbatches, flags


def test_the_expert_axis_splits_the_experts_state_and_moves_their_tokens(capsys):
    """One layout at ZeRO-1, without and with expert parallelism: each GPU holds 1/ep of the experts' bf16
    weights and gradients, but the same optimizer state (ZeRO-1 already spread it over dp x cp; ep 64
    shards 1/64 of it over the 32 ranks that hold the same experts: a bug that shards the experts over
    dp x cp would show 1/64 of it); the all-to-all bytes appear; a degree that does not divide the experts
    or dp x cp is one line, exit 2."""
    config = config_of(build_parser_plan().parse_args(DEEPSEEK))
    experts = param_count(config).experts
    kw = dict(dp=2048, tp=1, pp=1, cp=1, gpu="H100", seq_len=4096, global_batch=2048, zero_stage=1)
    one, split = evaluate_layout(config, **kw, ep=1), evaluate_layout(config, **kw, ep=64)
    for term in ("weights", "grads"):
        saved = getattr(one.state, term) - getattr(split.state, term)
        assert saved == pytest.approx(2 * experts * (1 - 1 / 64)), term
    assert split.state.optimizer == pytest.approx(one.state.optimizer)
    assert one.sent["ep"] == 0 < split.sent["ep"]
    assert main([*DEEPSEEK, "--layout", "dp=2048,tp=1,pp=1,ep=3"]) == 2
    assert "ep 3 does not divide the 2048 dp x cp ranks" in capsys.readouterr().err
