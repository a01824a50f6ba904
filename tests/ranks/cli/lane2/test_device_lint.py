"""The device lint (refimpl/distributed/device_lint.py): what CUDA and NCCL would refuse, found on CPU.

- its rules, one by one, each with a call that breaks it and the nearest one that does not (the planted
  controls: a host tensor into a collective, a non-contiguous tensor, a float8 sum, fp8 and grouped GEMMs
  that sm90 refuses);
- the trainer under it at one layout of every family at 4 ranks (dp; ZeRO-1/2/3; HSDP; tp with SP and
  cp ring and Ulysses, each x dp 2; pp 2 x dp 2 with each schedule; ep, also with a shared expert beside
  the posted dispatch; fp16; bf16; fp8 tensorwise and
  rowwise): zero violations, and a budget of host syncs per step;
- ``REFIMPL_DEVICE_LINT=1`` on the command line (a pp 2 run: its idle-share all-reduce was a CPU tensor,
  which NCCL refuses).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from refimpl.distributed.device_lint import DeviceLint, DeviceLintError, origin_of, private_group
from refimpl.distributed.kernel_rules import grouped_mm_problems, scaled_mm_problems
from refimpl.launch import run_ranks
from tests.support.timeouts import SPAWN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[4]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# ----------------------------------------------------------------------------------------- host tensors


def test_tensors_made_without_a_device_or_moved_to_the_cpu_are_tagged_and_results_follow():
    device = torch.device("cpu")  # the run's device, as ctx.device gives it
    with DeviceLint():
        bare = torch.zeros(2)
        named = torch.zeros(2, device="cpu")
        placed = torch.zeros(2, device=device)
        moved = torch.ones(2).to(device)
        back = placed.cpu()
        doubled = bare * 2            # host in, host out
        mixed = bare + placed         # a device input: on the device
        like = torch.zeros_like(bare)
        like_placed = torch.zeros_like(bare, device=device)
    assert "test_device_lint.py" in origin_of(bare)
    assert origin_of(named) and origin_of(back) and origin_of(doubled) and origin_of(like)
    for t in (placed, moved, mixed, like_placed):
        assert origin_of(t) is None


def test_host_syncs_are_counted_on_device_tensors_only():
    device = torch.device("cpu")
    with DeviceLint() as lint:
        x = torch.arange(4.0, device=device)
        x.sum().item()
        x.tolist()
        bool(x.any())
        x[x > 1]                       # a boolean mask: the result's size is data
        torch.tensor(3.0).item()      # a host tensor: no device to wait for
    assert lint.syncs == 4, lint.sync_sites


# ------------------------------------------------------------------------------------------- fp8 GEMMs


def _fp8(rows: int, cols: int, dtype=E4M3) -> torch.Tensor:
    return torch.randn(rows, cols).to(dtype)


def test_scaled_mm_rules_are_sm90s():
    a, w = _fp8(32, 64), _fp8(48, 64)  # x [M, K], weight [N, K]
    one = torch.tensor(1.0)
    assert scaled_mm_problems(a, w.t(), one, one) == []  # b = W^T: column-major
    rowwise = (torch.ones(32, 1), torch.ones(1, 48))
    assert scaled_mm_problems(a, w.t(), *rowwise) == []
    broken = {
        "row-major": scaled_mm_problems(a.t().contiguous().t(), w.t(), one, one),
        "column-major": scaled_mm_problems(a, w.t().contiguous(), one, one),
        "multiples of 16": scaled_mm_problems(_fp8(32, 24), _fp8(48, 24).t(), one, one),
        "e5m2 x e5m2": scaled_mm_problems(_fp8(32, 64, E5M2), _fp8(48, 64, E5M2).t(), one, one),
        "float32": scaled_mm_problems(a, w.t(), one.bfloat16(), one),
        "rowwise": scaled_mm_problems(a, w.t(), torch.ones(32, 1), one),
    }
    for rule, problems in broken.items():
        assert len(problems) == 1 and rule in problems[0], (rule, problems)


def test_scaled_mm_calls_are_checked_when_they_run():
    a, w = _fp8(32, 64), _fp8(48, 64)
    one = torch.tensor(1.0)
    with DeviceLint():
        torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        with pytest.raises(DeviceLintError, match="column-major"):
            torch._scaled_mm(a, w.t().contiguous(), scale_a=one, scale_b=one, out_dtype=torch.float32)


def test_grouped_mm_rules_are_cudas():
    x = torch.randn(10, 32, dtype=torch.bfloat16)
    w = torch.randn(2, 32, 16, dtype=torch.bfloat16)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    assert grouped_mm_problems(x, w, offs) == []
    assert grouped_mm_problems(x.float(), w.float(), offs) == []  # fp32 outside autocast: the fallback
    assert "autocast" in grouped_mm_problems(x.float(), w.float(), offs, autocast=torch.bfloat16)[0]
    assert "int32" in grouped_mm_problems(x, w, offs.long())[0]
    odd = torch.randn(10, 7, dtype=torch.bfloat16)  # rows of 14 bytes
    assert "16-byte" in grouped_mm_problems(odd, torch.randn(2, 7, 16, dtype=torch.bfloat16), offs)[0]


def test_grouped_mm_under_autocast_must_be_cast_first():
    x, w = torch.randn(10, 32), torch.randn(2, 32, 16)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    with DeviceLint(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs)
        with pytest.raises(DeviceLintError, match="autocast"):
            torch._grouped_mm(x, w, offs=offs)


# ----------------------------------------------------------------------------------------- collectives


def _functional_all_reduce(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))


def _collectives(ctx) -> dict:
    """Each rule on a 2-rank gloo group: the planted call fails, its neighbour passes."""
    device = ctx.device
    control = private_group()
    out = {}
    with DeviceLint() as lint:
        dist.all_reduce(torch.ones(2, device=device))
        dist.all_reduce(torch.ones(2), group=control)  # a private gloo group takes host tensors
        dist.all_gather_object([None, None], {"rank": ctx.rank})
        # torch's own code makes its host tensors below the dispatch mode (DDP's parameter-shape check)
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        planted = {
            "host": lambda: dist.all_reduce(torch.tensor(1.0)),
            "moved": lambda: dist.broadcast(torch.ones(3, device=device).cpu(), src=0),
            "contiguous": lambda: dist.all_reduce(torch.ones(4, 4, device=device).t()),
            "float8": lambda: dist.all_reduce(torch.zeros(4, device=device, dtype=E4M3)),
            "functional": lambda: _functional_all_reduce(torch.ones(2)),
        }
        for name, call in planted.items():
            try:
                call()
                out[name] = None
            except DeviceLintError as exc:
                out[name] = str(exc)
    out["violations"] = len(lint.violations)
    return out


def test_each_collective_rule_fails_its_planted_call():
    out = run_ranks(_collectives, 2, timeout_s=SPAWN_TIMEOUT_S)[0]
    assert "host-tensor" in out["host"] and "test_device_lint.py" in out["host"]
    assert "host-tensor" in out["moved"]
    assert "contiguity" in out["contiguous"]
    assert "float8-reduction" in out["float8"]
    assert "host-tensor" in out["functional"]
    assert out["violations"] == 5


# ------------------------------------------------------------------------------------ the trainer under it

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "8", "--lr", "1e-2", "--warmup-steps", "1", "--log-every", "100", "--steps", "3",
        "--checkpoint-every", "0"]
PP = ["--pp", "2", "--microbatches", "2"]
MOE = ["--moe-experts", "4", "--ep", "2"]
FP8 = ["--precision", "fp8"]
# one layout of every family, at 4 ranks
LAYOUTS = {
    "dp4": [], "dp4-zero1": ["--zero-stage", "1"], "dp4-zero2": ["--zero-stage", "2"],
    "dp4-zero3": ["--zero-stage", "3"], "hsdp": ["--zero-stage", "3", "--dp-replicate", "2"],
    "tp2-sp": ["--tp", "2", "--sequence-parallel"], "cp2-ring": ["--cp", "2"],
    "cp2-ulysses": ["--cp", "2", "--cp-method", "ulysses"],
    "pp2-1f1b": PP, "pp2-gpipe": [*PP, "--pp-schedule", "gpipe"],
    "pp2-interleaved": [*PP, "--pp-schedule", "interleaved", "--virtual-stages", "2"],
    "pp2-zbh1": [*PP, "--pp-schedule", "zbh1"],
    "pp2-zbv": [*PP, "--pp-schedule", "zbv", "--virtual-stages", "2"],
    "ep2": MOE, "ep2-bf16": [*MOE, "--precision", "bf16"],
    "ep2-shared": [*MOE, "--moe-shared-experts", "1"],  # the shared expert beside the posted dispatch
    "fp16": ["--precision", "fp16"], "bf16": ["--precision", "bf16"],
    "fp8-tensorwise": FP8, "fp8-rowwise": [*FP8, "--fp8-scaling", "rowwise"],
}
# Host syncs per step, at most (what these layouts measured): the loss's .item() and the save
# schedule's one read of its flags; under pp also the read of the measured pipeline idle share (its
# all-reduce over the pp group); under fp16 the loss scaler's read of its overflow flag (GradScaler's too);
# with experts the step's one read of the MoE figures and, per MoE block and micro-batch, the one read of
# the exchanged counts that sizes the uneven all-to-all (TINY's 4 blocks, every one MoE, 1 micro-batch).
SYNC_BUDGET = 2
# The end's report (a full model gathered on rank 0 to sample from: collective) at one layout of each way
# it is gathered (refimpl/train/setup.py, _sampling_model): a plain model, ZeRO-3's shards, tensor-parallel
# shards, a copy beside context-parallel attention, pipeline stages' and experts' boxes. Elsewhere
# --no-report: about 1 s of rank 0 per layout (pyplot, a PNG, 120 sampled tokens under the lint).
REPORTED = {"dp4", "dp4-zero3", "tp2-sp", "cp2-ring", "pp2-1f1b", "ep2"}
MOE_BLOCKS = 4
EXTRA_SYNCS = {"pp": 1, "fp16": 1, "ep": 1 + MOE_BLOCKS}


def _trainer_under_lint(ctx, root: Path, corpus: dict) -> dict:
    from refimpl.train import build_parser, config_from_args, options_from_args, train

    out = {}
    for name, flags in LAYOUTS.items():
        report = [] if name in REPORTED else ["--no-report"]
        args = build_parser().parse_args([*TINY, *flags, *report, "--data", str(corpus["corpus"]),
                                          "--cache-dir", str(corpus["cache"]), "--out", str(root / name)])
        with DeviceLint(raise_at_once=False) as lint:
            train(config_from_args(args), ctx, options_from_args(args), hooks=lint)
        out[name] = {"violations": [str(v) for v in lint.violations], "steps": lint.steps_syncs,
                     "sites": dict(lint.sync_sites)}
    return out


@pytest.fixture(scope="module")
def linted(tmp_path_factory, corpus) -> list[dict]:
    root = tmp_path_factory.mktemp("lint")
    # the one spawn timeout x 2: 4 ranks train under the lint at each layout; it was 600 s
    return run_ranks(_trainer_under_lint, 4, root, corpus, timeout_s=2 * SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_trainer_makes_no_call_a_gpu_would_refuse(linted, layout):
    for rank, out in enumerate(linted):
        assert out[layout]["violations"] == [], (rank, out[layout]["violations"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_trainer_stays_within_its_host_sync_budget(linted, layout):
    for rank, out in enumerate(linted):
        steps = out[layout]["steps"][:-1]  # the last step also saves the final checkpoint and samples
        budget = SYNC_BUDGET + sum(n for prefix, n in EXTRA_SYNCS.items() if layout.startswith(prefix))
        assert len(steps) == 2 and max(steps) <= budget, (rank, steps, out[layout]["sites"])


def test_the_command_line_runs_under_the_lint(corpus, tmp_path):
    """``REFIMPL_DEVICE_LINT=1`` on a self-launched pp 2 run: clean, and rank 0 prints the syncs."""
    env = {**os.environ, "REFIMPL_DEVICE_LINT": "1", "PYTHONPATH": str(ROOT)}
    args = [*TINY, *PP, "--data", str(corpus["corpus"]), "--cache-dir", str(corpus["cache"]),
            "--out", str(tmp_path / "run"), "--nproc-per-node", "2", "--timeout", "60", "--no-demo-fault"]
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "device lint: 0 violation(s)" in proc.stdout, proc.stdout[-2000:]


# ------------------------------------------------------------------------------------------ notebooks


def _host_all_reduce() -> None:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.tensor(1.0))  # the bug chapter 12's first %%px cell had


def test_notebook_engines_run_every_cell_under_the_lint(monkeypatch):
    """With ``REFIMPL_DEVICE_LINT=1`` (tests/course/chapters/test_chapters.py sets it for every chapter) an
    engine refuses a host tensor in a collective, as NCCL would."""
    import ipyparallel as ipp

    from refimpl.launch import RankError, start_ranks

    monkeypatch.setenv("REFIMPL_DEVICE_LINT", "1")
    with start_ranks(2, timeout_s=30, stream=False) as ranks:
        with pytest.raises(RankError, match="host-tensor"):
            ranks.run(ipp.interactive(_host_all_reduce))
