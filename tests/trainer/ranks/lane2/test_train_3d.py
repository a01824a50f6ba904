"""The 3D trainer (chapter 12): dp x tp x pp (x cp) at 8 ranks trains like one device, and its checkpoints
move between layouts.

* **Equivalence.** One spawn of 8 ranks runs ``refimpl.train.train`` in process at ``2 x 2 x 2``
  (fp32; ZeRO-1 + bf16; ZeRO-2 + sequence parallelism + the interleaved schedule; ZeRO-3, fp32 and bf16:
  each stage's TP blocks sharded again over dp, gathered once per step; ZeRO-3 on the Llama form, GQA
  with 2 key/value heads, against its own one-device runs) and at
  ``dp 2 x cp 2 x pp 2`` (ZeRO-2 + fp16 + activation checkpointing); each against one device in this
  process within tests/support/one_device.py's rule (``FACTOR x`` the spread of two one-device summation
  orders): the losses, and the first step's gradients before the optimizer, every rank's boxes of them.
* **Checkpoints across layouts** ("universal" checkpoints). The ``2 x 2 x 2`` ZeRO-1 bf16 checkpoint of
  step ``STEPS`` is loaded at ``2 x 2 x 2``, at ``dp 1 x tp 2 x pp 2`` (4 ranks), at ``tp 4`` and on one
  rank, and saved again there: every tensor of the weights and of the AdamW state, reassembled from the
  boxes, equals the original bit for bit (a negative control: the fresh optimizer state of an untrained
  run differs). Resumed at each layout the run continues the losses (within the bf16 tolerance), and at
  the same layout bitwise.
* **Refused before any process starts**: layouts that do not divide the world, the heads, the layers or
  the vocabulary (the CLI returns 2 and never launches).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from refimpl.checkpoint import (
    Checkpointer,
    CheckpointReader,
    load_training_state,
    read_manifest,
    save_training_state,
)
from refimpl.checkpoint.checkpointer import CheckpointConfig
from refimpl.config import ParallelConfig, TrainConfig
from refimpl.distributed import DistributedContext
from refimpl.launch import run_ranks
from refimpl.model_config import LLAMA
from refimpl.train import RunOptions, build_setup, main
from refimpl.train.layout import resolve
from tests.support import timeouts
from tests.support.one_device import (
    PRECISIONS,
    assert_gradients_like_one_device,
    assert_trains_like_one_device,
    first_step_gradients,
    one_device_losses,
    tolerance,
)
from tests.support.trainer_runs import Case, run_case, tiny

# the one spawn timeout x 2: 8 ranks then 4 train, save and resume the GPT; it was 420 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4  # the checkpoint's step; the runs go 2 steps further
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "8", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "100",
        "--steps", str(STEPS + 2), "--checkpoint-every", "0", "--no-report"]  # the refusals' command line


def _cube(**options) -> ParallelConfig:
    """dp 2 x tp 2 x pp 2, two micro-batches, and ``options``."""
    return ParallelConfig(dp=2, tp=2, pp=2, microbatches=2, **options)


SAVED = "2x2x2-zero1-bf16"  # the checkpoint moved between layouts
LLAMA_LAYOUT = "2x2x2-zero3-llama"  # the Llama form (GQA 4/2), against its own one-device runs
LAYOUTS = {  # at world size 8
    "2x2x2": Case(parallel=_cube(), checkpoint_every=STEPS),
    SAVED: Case(parallel=_cube(zero_stage=1, precision="bf16"), checkpoint_every=STEPS),
    "2x2x2-zero2-sp-interleaved": Case(parallel=_cube(zero_stage=2, sequence_parallel=True,
                                                      pp_schedule="interleaved", virtual_stages=2)),
    "dp2-cp2-pp2-zero2-fp16-actckpt": Case(parallel=ParallelConfig(
        dp=2, cp=2, pp=2, microbatches=2, zero_stage=2, precision="fp16", activation_checkpointing="all")),
    "2x2x2-zero3": Case(parallel=_cube(zero_stage=3)),  # ZeRO-3 over the TP blocks of each stage
    "2x2x2-zero3-bf16": Case(parallel=_cube(zero_stage=3, precision="bf16")),
    LLAMA_LAYOUT: Case(parallel=_cube(zero_stage=3)),  # RMSNorm, RoPE, GQA 4/2, SwiGLU
}
# the layouts the checkpoint of SAVED moves to, in bf16: name -> (world size, layout)
TARGETS = {
    "2x2x2": (8, _cube(zero_stage=1, precision="bf16")),
    "1x2x2": (4, ParallelConfig(dp=1, tp=2, pp=2, microbatches=2, zero_stage=1, precision="bf16")),
    "tp4": (4, ParallelConfig(dp=1, tp=4, precision="bf16")),
    "one rank": (1, ParallelConfig(precision="bf16")),
}


def _base(files: dict, *, llama: bool = False) -> TrainConfig:
    """4 blocks, 8 sequences a step, STEPS + 2 steps; the Llama form with 2 key/value heads."""
    model = {**LLAMA, "num_key_value_heads": 2} if llama else {}
    return tiny(files, num_layers=4, batch_size=8, steps=STEPS + 2, **model)


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus: dict) -> dict:
    """The shared corpus and its token cache (tests/conftest.py), and this module's folder for its runs."""
    return {"root": tmp_path_factory.mktemp("train_3d"), **corpus}


def _resave(ctx, files: dict, name: str, parallel: ParallelConfig) -> None:
    """Load the SAVED checkpoint of step STEPS at the layout ``parallel`` and save it again (a collective)."""
    root = Path(files["root"])
    config = dataclasses.replace(_base(files), out=str(root / "unused"))
    setup = build_setup(config, ctx, resolve(config, RunOptions(parallel=parallel), ctx.world_size))
    source = Checkpointer(CheckpointConfig(folder=str(root / "saved-checkpoint")))
    load_training_state(source, source.find_latest_valid(), model=setup.state_module,
                        optimizer=setup.optimizer, restore_rng=False)
    with Checkpointer(CheckpointConfig(folder=str(root / f"resaved-{name}"))) as target:
        save_training_state(target, STEPS, model=setup.state_module, optimizer=setup.optimizer)


def _resume(ctx, files: dict, name: str, parallel: ParallelConfig) -> list[float]:
    """Copy the SAVED checkpoint of step STEPS and resume the run from it at the layout ``parallel``."""
    root = Path(files["root"])
    folder = root / f"resumed-{name}" / "ckpt"
    if ctx.rank == 0:
        shutil.copytree(root / "saved-checkpoint", folder)
    if ctx.world_size > 1:
        dist.barrier()
    records = run_case(ctx, _base(files), Case(parallel=parallel), root / f"resumed-{name}",
                       checkpoint_dir=folder)
    return [r["loss"] for r in records]


def _move(ctx, files: dict, world: int) -> dict:
    out = {}
    for name, (size, parallel) in TARGETS.items():
        if size == world:
            _resave(ctx, files, name, parallel)
            out[name] = _resume(ctx, files, name, parallel)
    return out


def _worker8(ctx, files: dict) -> dict:
    root = Path(files["root"])
    out = {}
    for name, case in LAYOUTS.items():
        grads: dict = {}
        records = run_case(ctx, _base(files, llama=name == LLAMA_LAYOUT), case, root / name,
                           checkpoint_dir=root / name / "ckpt", probe=first_step_gradients(grads))
        out[name] = [r["loss"] for r in records]
        out[name, "grads"] = grads
    if ctx.rank == 0:  # the SAVED run's checkpoint of step STEPS alone
        shutil.copytree(root / SAVED / "ckpt", root / "saved-checkpoint")
        shutil.rmtree(root / "saved-checkpoint" / f"step_{STEPS + 2:08d}")
    dist.barrier()
    out["moved"] = _move(ctx, files, 8)
    return out


def _worker4(ctx, files: dict) -> dict:
    return _move(ctx, files, 4)


@pytest.fixture(scope="module")
def runs(files) -> dict:
    """The 8-rank runs, then the checkpoint moved to the 4-rank layouts and to one rank (in this process)."""
    eight = run_ranks(_worker8, 8, files, timeout_s=SPAWN_TIMEOUT_S)
    four = run_ranks(_worker4, 4, files, timeout_s=SPAWN_TIMEOUT_S)
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        one = _move(ctx, files, 1)
    finally:
        torch.set_num_threads(threads)
    return {"eight": eight, "moved": eight[0]["moved"] | four[0] | one}


def _references(config: TrainConfig, root: Path, parallel: ParallelConfig | None = None,
                precisions=PRECISIONS) -> dict:
    """tests/support/one_device.py's references of ``config`` at ``parallel`` (at a world of one)."""
    return one_device_losses(config, root, steps=STEPS + 2, parallel=parallel, precisions=precisions)


@pytest.fixture(scope="module")
def one_device(files, tmp_path_factory) -> dict:
    return _references(_base(files), tmp_path_factory.mktemp("one_device"))


@pytest.fixture(scope="module")
def one_device_zero3(files, tmp_path_factory) -> dict:
    """One device with ``--zero-stage 3`` (a world of one: nothing sharded): in 16 bits FSDP2's arithmetic,
    16-bit weights and activations throughout (no autocast, fp32 master weights), the reference a 16-bit
    ZeRO-3 layout computes like; in fp32 the plain model's."""
    return _references(_base(files), tmp_path_factory.mktemp("one_device_zero3"),
                       ParallelConfig(zero_stage=3))


@pytest.fixture(scope="module")
def one_device_llama(files, tmp_path_factory) -> dict:
    """One device training the Llama form, fp32."""
    return _references(_base(files, llama=True), tmp_path_factory.mktemp("one_device_llama"),
                       precisions=("fp32",))


def _reference(name: str, one_device: dict, one_device_zero3: dict, one_device_llama: dict) -> dict:
    """The one-device runs layout ``name`` is held to: ZeRO-3 in 16 bits computes in 16-bit weights and
    activations (FSDP2's mixed precision), the others under autocast over fp32 weights (measured: the
    2x2x2 ZeRO-3 bf16 losses lie 2.8e-3 from the autocast bf16 run, 1.8x that rule's tolerance); the Llama
    form its own."""
    if name == LLAMA_LAYOUT:
        return one_device_llama
    parallel = LAYOUTS[name].parallel
    return one_device_zero3 if parallel.zero_stage == 3 and parallel.precision != "fp32" else one_device


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint in ``folder``, whole (reassembled from the saved boxes)."""
    step = sorted(p for p in folder.iterdir() if p.name.startswith("step_"))[-1]
    manifest = read_manifest(step)
    reader = CheckpointReader(step, manifest)
    try:
        return {name: reader.read(name) for name in manifest["entries"]}
    finally:
        reader.close()


@pytest.mark.numerics
@pytest.mark.timeout(3 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_3d_layouts_at_8_ranks_train_like_one_device(runs, one_device, one_device_zero3, one_device_llama,
                                                     name):
    assert_trains_like_one_device([out[name] for out in runs["eight"]],
                                  _reference(name, one_device, one_device_zero3, one_device_llama),
                                  LAYOUTS[name].precision, factor=FACTOR, name=name)


@pytest.mark.numerics
@pytest.mark.timeout(3 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_3d_layouts_hand_the_optimizer_one_devices_gradients(runs, one_device, one_device_zero3,
                                                             one_device_llama, name):
    """The first step's gradients before clipping and AdamW, every rank's boxes (tp blocks, ZeRO-2 row
    shards of them, the tied embedding on both pipeline ends) against one device's
    (tests/support/one_device.py); negative control: the same gradients x m (a pipeline loss not divided by
    its m micro-batches) fail."""
    m = LAYOUTS[name].parallel.microbatches
    assert m is not None
    worst = assert_gradients_like_one_device([out[name, "grads"] for out in runs["eight"]],
                                             _reference(name, one_device, one_device_zero3, one_device_llama),
                                             LAYOUTS[name].precision,
                                             factor=FACTOR, name=name, control=float(m))
    print(f"{name}: worst gradient difference {worst:.3f} x its tolerance")


@pytest.mark.timeout(3 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(TARGETS))
def test_the_2x2x2_checkpoint_reassembles_bitwise_at_another_layout(runs, files, name):
    root = Path(files["root"])
    saved, again = _read_all(root / "saved-checkpoint"), _read_all(root / f"resaved-{name}")
    assert sorted(again) == sorted(saved)
    assert any("exp_avg" in k for k in saved) and any("exp_avg_sq" in k for k in saved)
    for k, v in saved.items():
        assert again[k].dtype == v.dtype and torch.equal(again[k], v), k
    # negative control: another run's checkpoint (fp32, two steps later) fails the same comparison
    other = _read_all(root / "2x2x2" / "ckpt")
    assert sorted(other) == sorted(saved) and not any(torch.equal(other[k], v) for k, v in saved.items()
                                                      if v.numel() > 1)


@pytest.mark.numerics
@pytest.mark.timeout(3 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(TARGETS))
def test_the_run_resumed_at_another_layout_continues_the_losses(runs, one_device, name):
    resumed, uninterrupted = runs["moved"][name], runs["eight"][0][SAVED][STEPS:]
    assert len(resumed) == 2  # a fresh --out: the two steps after the resume
    if name == "2x2x2":  # the same layout: the same arithmetic
        assert resumed == uninterrupted
    tol = tolerance(one_device, "bf16", factor=FACTOR)
    assert float(np.abs(np.array(resumed) - np.array(uninterrupted)).max()) <= tol, (resumed, uninterrupted)


@pytest.mark.parametrize("flags, says", [
    (["--nproc-per-node", "8", "--dp", "2", "--tp", "2", "--pp", "3"], "does not match the world size 8"),
    (["--nproc-per-node", "8", "--tp", "8"], "--tp 8 does not divide the 4 attention heads"),
    (["--nproc-per-node", "6", "--tp", "3", "--num-heads", "6", "--hidden-size", "96"],
     "--tp 3 does not divide the 256 vocabulary entries"),
    (["--nproc-per-node", "8", "--tp", "2", "--pp", "4", "--num-layers", "3"],
     "--num-layers 3 cannot fill 4 pipeline stages"),
])
def test_a_layout_that_does_not_divide_is_refused_before_any_process_starts(files, tmp_path, capsys, flags,
                                                                              says):
    argv = [*TINY, "--data", str(files["corpus"]), "--cache-dir", str(files["cache"]), "--out",
            str(tmp_path / "run"), *flags]
    assert main(argv) == 2
    printed = capsys.readouterr()
    assert says in printed.err and "launching:" not in printed.out, printed
    assert not (tmp_path / "run").exists()  # nothing written: no rank ever started
