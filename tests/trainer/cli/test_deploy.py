"""The cluster launchers in deploy/ (README "Running on GPUs"): every trainer flag they pass exists and
parses, and the layout multiplies out to the GPUs they ask for (Slurm: nodes x GPUs per node; Kubernetes:
every pod count the elastic policy allows, with dp following the world size). Negative controls: a flag the
trainer does not know, and the layout on the wrong number of GPUs, fail the same checks.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from refimpl.config import ConfigError
from refimpl.train import build_parser, check_shapes, config_from_args, options_from_args
from refimpl.train.layout import pipeline_microbatches

ROOT = Path(__file__).resolve().parents[3]


def _trainer_args(argv: list[str]) -> list[str]:
    """What follows ``-m refimpl.train`` in a command line."""
    i = argv.index("refimpl.train")
    assert argv[i - 1] == "-m", argv
    return argv[i + 1:]


def _slurm() -> tuple[dict[str, str], list[str], list[str]]:
    text = (ROOT / "deploy" / "slurm" / "train.sbatch").read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, flags=re.M))
    command = " ".join(line.rstrip("\\").strip() for line in text.split("srun", 1)[1].splitlines())
    argv = shlex.split(command.replace('"', ""))
    gpus = re.search(r"^GPUS_PER_NODE=(\d+)", text, flags=re.M).group(1)
    return sbatch | {"GPUS_PER_NODE": gpus}, argv, _trainer_args(argv)


def _kubernetes() -> tuple[dict, list[str]]:
    job = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "pytorchjob.yaml").read_text())
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    return job, container["command"]


def _world_layout(trainer_args: list[str], world: int):
    """The trainer's own parse of the flags and its layout at ``world`` ranks, through the checks it makes
    before any process starts (heads, widths and sequence against tp/cp, micro-batches and layers against
    pp); raises if it does not fit."""
    args = build_parser().parse_args(trainer_args)  # an unknown flag: SystemExit
    config, options = config_from_args(args), options_from_args(args)
    dims = options.parallel_dims(world)
    check_shapes(config, options.parallel)
    if dims.pp > 1:
        pipeline_microbatches(config, options, dims.dp)
    return dims


def test_slurm_runs_the_trainer_at_a_layout_of_its_gpus():
    sbatch, argv, trainer = _slurm()
    world = int(sbatch["nodes"]) * int(sbatch["GPUS_PER_NODE"])
    assert sbatch["gpus-per-node"] == sbatch["GPUS_PER_NODE"]
    assert "--nproc-per-node=$GPUS_PER_NODE" in " ".join(argv) and "--rdzv-backend=c10d" in argv
    dims = _world_layout(trainer, world)
    assert dims.dp * dims.tp * dims.pp * dims.cp == world and dims.tp > 1 and dims.pp > 1
    with pytest.raises(ConfigError, match="does not match the world size"):
        _world_layout(trainer, world // 2)  # negative control: the same flags on half the GPUs


def test_the_kubernetes_job_fits_every_pod_count_its_elastic_policy_allows():
    job, command = _kubernetes()
    assert job["kind"] == "PyTorchJob" and job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    per_pod = int(next(a for a in command if a.startswith("--nproc-per-node=")).split("=")[1])
    limits = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]
    assert int(limits["limits"]["nvidia.com/gpu"]) == per_pod
    policy = job["spec"]["elasticPolicy"]
    trainer = _trainer_args(command)
    for pods in range(policy["minReplicas"], policy["maxReplicas"] + 1):
        dims = _world_layout(trainer, pods * per_pod)  # dp follows the world size
        assert dims.world_size == pods * per_pod and dims.dp == pods, (pods, dims)


def test_negative_control_an_unknown_flag_fails_the_parse():
    _, _, trainer = _slurm()
    with pytest.raises(SystemExit):
        build_parser().parse_args([*trainer, "--tensor-parallel-size", "4"])
