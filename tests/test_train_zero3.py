"""The trainer with ``--zero-stage 3`` composed (chapter 04; issue "ZeRO-3 everywhere"): ZeRO-3 with
activation checkpointing trains like one device, and like ZeRO-3 without checkpointing bit for bit.

One spawn of 4 ranks runs each layout through :func:`refimpl.train.train`; the one-device references are
tests/conftest.py's (the same flags as test_train_tp and test_train_cp: computed once per session).

* **Like one device** (the numerics rule, tests/one_device.py): the losses, and the first step's gradients
  before clipping and AdamW, every rank's row shards of them, within ``FACTOR x`` the spread of two
  one-device summation orders; negative control: the same gradients x 4 (a sum over the replicas, not the
  mean) fail.
* **Checkpointing changes nothing but memory**: the recomputed forward of a checkpointed block runs on the
  weights the unit's pre-backward gather brought back (refimpl/parallel/zero/fully_sharded_data_parallel.py),
  the same products in the same order, so ``--activation-checkpointing`` gives the same losses and the
  same gradients, bit for bit, as the same ZeRO-3 run without it (fp32 and bf16). The wrapper-level proofs
  (against FSDP2 + torch checkpoint bitwise, peak gathered bytes during the recomputation, the negative
  control that recomputes on the shards) are tests/test_zero.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from refimpl.launch import run_ranks
from refimpl.train import build_parser, config_from_args, options_from_args, train
from tests.one_device import (
    assert_gradients_like_one_device,
    assert_trains_like_one_device,
    first_step_gradients,
    tolerance,
)

SPAWN_TIMEOUT_S = 300
FACTOR = 4.0
STEPS = 4
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "100",
        "--checkpoint-every", "0"]  # test_train_tp's and test_train_cp's: one set of one-device references
HSDP = "dp4-hsdp2-zero3"  # 2 replicas x 2-rank shard groups; its checkpoint moves across R
TP2 = "tp2-dp2-zero3"  # 2-D sharding: ZeRO-3 rows of the tensor-parallel blocks
# name -> (flags at world size 4, the one-device precision it is compared with)
LAYOUTS = {
    "dp4-zero3": (["--zero-stage", "3"], "fp32"),
    "dp4-zero3-actckpt": (["--zero-stage", "3", "--activation-checkpointing"], "fp32"),
    "dp4-zero3-bf16": (["--zero-stage", "3", "--precision", "bf16"], "bf16"),
    "dp4-zero3-bf16-actckpt-every2": (["--zero-stage", "3", "--precision", "bf16",
                                       "--activation-checkpointing", "every-2"], "bf16"),
    HSDP: (["--zero-stage", "3", "--dp-replicate", "2", "--checkpoint-every", str(STEPS)], "fp32"),
    "dp4-hsdp2-zero3-bf16-actckpt": (["--zero-stage", "3", "--dp-replicate", "2", "--precision", "bf16",
                                      "--activation-checkpointing"], "bf16"),
    TP2: (["--tp", "2", "--zero-stage", "3", "--checkpoint-every", str(STEPS)], "fp32"),
    "tp2-dp2-zero3-sp-actckpt": (["--tp", "2", "--zero-stage", "3", "--sequence-parallel",
                                  "--activation-checkpointing"], "fp32"),
    "tp2-dp2-zero3-bf16": (["--tp", "2", "--zero-stage", "3", "--precision", "bf16"], "bf16"),
}
RESUMED_AT = {"R1 (plain ZeRO-3)": ["--zero-stage", "3"],  # HSDP's checkpoint of step STEPS resumed there
              "R4 (shard groups of one)": ["--zero-stage", "3", "--dp-replicate", "4"]}
SAME_AS = {"dp4-zero3-actckpt": "dp4-zero3", "dp4-zero3-bf16-actckpt-every2": "dp4-zero3-bf16"}


def _args(files: dict, out: Path, *extra: str):
    return build_parser().parse_args([*TINY, "--steps", str(STEPS), "--data", str(files["corpus"]),
                                      "--cache-dir", str(files["cache"]), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("train_zero3"), **corpus}  # tests/conftest.py's corpus


def _worker(ctx, files: dict) -> dict:
    out = {}
    for name, (flags, _) in LAYOUTS.items():
        args = _args(files, Path(files["root"]) / name, *flags, "--steps", str(STEPS + 2))
        grads: dict = {}
        records = train(config_from_args(args), ctx, options_from_args(args),
                        gradient_probe=first_step_gradients(grads))
        out[name] = [r["loss"] for r in records]
        out[name, "grads"] = grads
        out[name, "bytes"] = [r["bytes_sent"] for r in records]
    root = Path(files["root"])
    for name, flags in RESUMED_AT.items():  # the HSDP checkpoint of step STEPS, resumed at another R
        folder = root / f"resumed {name}" / "ckpt"
        if ctx.rank == 0:
            shutil.copytree(root / HSDP / "checkpoints" / f"step_{STEPS:08d}", folder / f"step_{STEPS:08d}")
        dist.barrier()
        args = _args(files, root / f"resumed {name}", *flags, "--steps", str(STEPS + 2), "--checkpoint-dir",
                     str(folder))
        records = train(config_from_args(args), ctx, options_from_args(args))
        out["resumed", name] = [r["loss"] for r in records]
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, 4, files, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def one_device(one_device_references) -> dict:
    return one_device_references([*TINY, "--steps", str(STEPS)], steps=STEPS + 2)


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero3_layouts_train_like_one_device(runs, one_device, name):
    assert_trains_like_one_device([out[name] for out in runs], one_device, LAYOUTS[name][1], factor=FACTOR,
                                  name=name)


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero3_layouts_hand_the_optimizer_one_devices_gradients(runs, one_device, name):
    worst = assert_gradients_like_one_device([out[name, "grads"] for out in runs], one_device,
                                             LAYOUTS[name][1], factor=FACTOR, name=name, control=4.0)
    print(f"{name}: worst gradient difference {worst:.3f} x its tolerance")


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(SAME_AS))
def test_checkpointing_under_zero3_changes_no_bit(runs, name):
    """Losses and first-step gradient shards equal to the run without checkpointing, bit for bit."""
    plain = SAME_AS[name]
    for rank, out in enumerate(runs):
        assert out[name] == out[plain], (rank, out[name], out[plain])
        assert out[name, "grads"].keys() == out[plain, "grads"].keys()
        for param, (offsets, shape, got) in out[name, "grads"].items():
            want = out[plain, "grads"][param]
            assert (offsets, shape) == want[:2] and np.array_equal(got, want[2]), (rank, param)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(RESUMED_AT))
def test_the_hsdp_checkpoint_resumes_at_another_replica_count(runs, one_device, name):
    """Saved by 2 replicas of 2-rank shard groups (each box written once, the replicas split the writing),
    read at R = 1 (ZeRO-3 over all 4) and R = 4 (every rank whole): the resumed steps continue the HSDP
    run's losses within the tolerance (another summation order of the same gradients)."""
    tol = tolerance(one_device, "fp32", factor=FACTOR)
    for rank, out in enumerate(runs):
        got, want = np.array(out["resumed", name]), np.array(out[HSDP][STEPS:])
        assert len(got) == 2 and float(np.abs(got - want).max()) <= tol, (rank, name, got, want, tol)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_hsdp_bytes_per_group_equal_the_formula(runs):
    """What each rank sent per step over the replica group (metrics.jsonl's "dp_replicate") is the ring
    all-reduce of every unit's padded gradient shard: ``zero_collectives(..., replicas=2)`` over the shard
    group of 2, to the byte; the shard group ("dp_shard x cp") carries the all-gathers and reduce-scatters
    (ZeRO-3's, never the replicas' reduction)."""
    from refimpl.comm.tracer import wire_bytes
    from refimpl.model import GPT
    from refimpl.planner import zero_collectives

    config = config_from_args(_args({"corpus": "x", "cache": "x"}, Path("x"))).model
    units: list[list] = [[] for _ in range(1 + config.num_layers)]
    for name, p in GPT(config, seed=0).named_parameters():  # the wrapper's units: each block, the root
        units[1 + int(name.split(".")[1]) if name.startswith("layers.") else 0].append(tuple(p.shape))
    ops = zero_collectives(units, 2, 3, replicas=2)
    replicas = wire_bytes("all_reduce", ops["all_reduce"][1], 2)
    shard_group = wire_bytes("all_gather", ops["all_gather"][1], 2) + wire_bytes(
        "reduce_scatter", ops["reduce_scatter"][1], 2)
    for rank, out in enumerate(runs):
        for step in out[HSDP, "bytes"]:
            assert step["dp_replicate"] == replicas, (rank, step, replicas)
            assert step["dp_shard x cp"] >= shard_group, (rank, step, shard_group)  # + the norm's scalar
            assert step["dp_shard x cp"] - shard_group < 64, (rank, step, shard_group)
