"""Which device a rank takes, and what the preflight refuses on a GPU, without a GPU.

``torch.cuda``'s answers are faked (monkeypatched ``is_available``, ``device_count``, ``mem_get_info``,
``get_device_name``, ``get_device_capability``), so every rule is checked on a CPU machine and in one
process:

* ``refimpl.distributed.choose_device``: an explicit backend decides (gloo -> CPU on a GPU box, nccl ->
  a GPU, an error without CUDA); a GPU per local rank -> ``cuda:LOCAL_RANK``; one visible GPU per process
  -> ``cuda:0``; too few GPUs -> a RuntimeError naming the counts and the fix, never a silent CPU run;
  ``refimpl.distributed.init_distributed`` follows it (``backend="gloo"`` on a GPU box is the CPU);
* the memory preflight on a GPU: the plan against ``0.9 x free - 1 GiB``, the rule printed in the refusal,
  and a run between that and the free memory refused (without the headroom it would pass);
* ``--precision fp8`` below compute capability 8.9 refused by the preflight, exit status 2 from the
  command line, before any process group exists; the self-launcher refuses 2 ranks on 1 GPU;
* the dense peak table: the longest name fragment wins ("NVIDIA H100 NVL" is not the SXM card).
"""

from __future__ import annotations

import pytest
import torch

from refimpl.config import ConfigError
from refimpl.distributed import choose_device, init_distributed
from refimpl.measure import peak_flops
from refimpl.measure.peak import peak_reserved_bytes, reset_peak_memory
from refimpl.train import build_parser, config_from_args, options_from_args
from refimpl.train.layout import resolve
from refimpl.train.preflight import (
    CUDA_ALLOWANCE_BYTES,
    MEMORY_ENV,
    check_fp8_device,
    preflight_memory,
    usable_cuda_bytes,
)

CPU, GIB = torch.device("cpu"), 2**30
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", MEMORY_ENV)


@pytest.fixture
def gpus(monkeypatch):
    """``fake(n, free=..., capability=..., name=...)``: torch.cuda answers as on a box with ``n`` GPUs
    (0: no CUDA); the rank environment (RANK, LOCAL_WORLD_SIZE, ...) removed."""
    for var in RANK_ENV:
        monkeypatch.delenv(var, raising=False)

    def fake(n: int, *, free: int = 80 * GIB, capability: tuple[int, int] = (9, 0),
             name: str = "NVIDIA H100 80GB HBM3") -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return fake


# ---------------------------------------------------------------- choose_device and init_distributed

def test_no_cuda_is_cpu_and_gloo(gpus):
    gpus(0)
    assert choose_device(0, 4) == (CPU, "gloo")
    assert choose_device(3, 4, backend="gloo") == (CPU, "gloo")
    with pytest.raises(RuntimeError, match="backend nccl needs CUDA"):
        choose_device(0, 1, backend="nccl")


def test_a_gpu_per_local_rank_is_cuda_local_rank(gpus):
    gpus(8)
    assert choose_device(0, 8) == (torch.device("cuda", 0), "nccl")
    assert choose_device(5, 8) == (torch.device("cuda", 5), "nccl")
    assert choose_device(1, 2, backend="nccl") == (torch.device("cuda", 1), "nccl")
    assert choose_device(1, 2, shared_view=True) == (torch.device("cuda", 1), "nccl")


def test_one_visible_gpu_per_process_is_cuda_0(gpus):
    """Slurm's --gpus-per-task, one GPU per Kubernetes container: each rank of 4 sees one GPU, its own.
    It used to be CPU + gloo, silently, on a GPU job."""
    gpus(1)
    for rank in range(4):
        assert choose_device(rank, 4) == (torch.device("cuda", 0), "nccl")
    assert choose_device(3, 4, backend="nccl") == (torch.device("cuda", 0), "nccl")


def test_too_few_gpus_is_a_loud_error_naming_the_counts_and_the_fix(gpus):
    gpus(2)
    for backend in (None, "nccl"):
        with pytest.raises(RuntimeError) as refused:
            choose_device(0, 4, backend=backend)
        for words in ("4 ranks on this node but 2 visible GPU(s)", "--backend gloo",
                      'CUDA_VISIBLE_DEVICES=""'):
            assert words in str(refused.value), str(refused.value)
    gpus(1)  # one GPU that every rank sees (the self-launcher's view): a shortage, not one each
    with pytest.raises(RuntimeError, match="2 ranks on this node but 1 visible GPU"):
        choose_device(0, 2, shared_view=True)


def test_an_explicit_gloo_is_the_cpu_on_a_gpu_box(gpus):
    gpus(2)
    assert choose_device(1, 4, backend="gloo") == (CPU, "gloo")  # even where cuda would be refused
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        choose_device(0, 1, backend="mpi")


def test_choose_device_reads_local_world_size(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert choose_device(1) == (torch.device("cuda", 1), "nccl")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(RuntimeError, match="3 ranks on this node but 2"):
        choose_device(0)


def test_init_distributed_takes_the_backends_device(gpus, monkeypatch):
    """One process (no process group): ``backend="gloo"`` on a GPU box is the CPU with one thread; no
    backend there is ``cuda:0``, made the current device."""
    gpus(2)
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    threads = torch.get_num_threads()
    try:
        ctx = init_distributed(backend="gloo", watch_parent=False)
        assert (ctx.device, ctx.backend, ctx.world_size) == (CPU, "gloo", 1) and chosen == []
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    ctx = init_distributed(watch_parent=False)
    assert (ctx.device, ctx.backend) == (torch.device("cuda", 0), "nccl") and chosen == [ctx.device]


# ---------------------------------------------------------------- the memory preflight on a GPU

def _run(*flags: str):
    args = build_parser().parse_args(list(flags))
    return config_from_args(args), options_from_args(args)


def test_usable_gpu_memory_is_nine_tenths_of_free_less_a_fixed_allowance():
    assert CUDA_ALLOWANCE_BYTES == GIB
    assert usable_cuda_bytes(80 * GIB) == int(0.9 * 80 * GIB) - GIB
    assert usable_cuda_bytes(GIB) == 0  # 0.9 GiB free: nothing left once the allowance is taken


def test_the_preflight_keeps_the_headroom_and_says_so(gpus):
    """A run that fits the free memory but not ``0.9 x free - 1 GiB`` is refused, the rule in the
    refusal; with free memory to spare for the headroom it passes. (Negative control: the same run against
    the bare free memory, as before, would pass.)"""
    config, options = _run("--seq-len", "4096", "--batch-size", "8")
    gpus(1, free=80 * GIB)
    need = preflight_memory(config, resolve(config, options, 1), ranks_per_node=1).total
    free = need + GIB // 2  # the plan fits this, not the headroom rule
    assert usable_cuda_bytes(free) < need < free
    gpus(1, free=free)
    with pytest.raises(ConfigError) as refused:
        preflight_memory(config, resolve(config, options, 1), ranks_per_node=1)
    message = str(refused.value)
    for words in ("the run needs about", "usable: 0.9 x", "free memory of the NVIDIA H100 80GB HBM3",
                  "- 1.0 GiB for the CUDA context, NCCL and cuBLAS"):
        assert words in message, message
    roomy = int((need + GIB) / 0.9) + 1
    gpus(1, free=roomy)
    assert usable_cuda_bytes(roomy) >= need
    assert preflight_memory(config, resolve(config, options, 1), ranks_per_node=1).total == need


def test_the_preflight_refuses_too_few_gpus_as_a_config_error(gpus):
    config, options = _run()
    gpus(2)
    with pytest.raises(ConfigError, match="4 ranks on this node but 2 visible GPU"):
        preflight_memory(config, resolve(config, options, 4), ranks_per_node=4)
    gpus(1)  # the self-launcher: its 2 ranks would both see this one GPU
    with pytest.raises(ConfigError, match="2 ranks on this node but 1 visible GPU"):
        preflight_memory(config, resolve(config, options, 2), ranks_per_node=2, launching=True)
    assert preflight_memory(config, resolve(config, options, 2), ranks_per_node=2, backend="gloo") is not None


# ---------------------------------------------------------------- fp8 below sm89

@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (7, 5)])
def test_fp8_below_sm89_is_refused_by_the_preflight(gpus, capability):
    gpus(1, capability=capability, name="NVIDIA A100-SXM4-80GB")
    config, options = _run("--precision", "fp8")
    with pytest.raises(ConfigError) as refused:
        # force: memory only
        preflight_memory(config, resolve(config, options, 1), ranks_per_node=1, force=True)
    major, minor = capability
    for words in ("--precision fp8 needs a GPU of compute capability 8.9", "NVIDIA A100-SXM4-80GB",
                  f"compute capability {major}.{minor}", "--precision bf16"):
        assert words in str(refused.value), str(refused.value)


def test_fp8_on_sm89_and_later_and_on_the_cpu_passes(gpus):
    for capability in ((8, 9), (9, 0), (10, 0)):
        gpus(1, capability=capability)
        check_fp8_device("fp8", torch.device("cuda", 0))
    gpus(1, capability=(8, 0))
    check_fp8_device("bf16", torch.device("cuda", 0))  # only fp8 needs fp8 tensor cores
    check_fp8_device("fp8", CPU)  # the CPU dequantizes


def test_the_command_line_refuses_fp8_on_an_a100_with_status_2(gpus, tmp_path, capsys, monkeypatch):
    """Before any process group, model or data: one ``error:`` line, exit status 2; the self-launcher
    refuses it before it launches any rank, and 2 ranks on 1 GPU too (were the launch reached, the test
    fails there instead of starting ranks)."""
    from refimpl.train import cli

    def launched(*args, **kwargs):
        raise AssertionError("the preflight let the run through")

    for step in ("check_fits", "init_distributed"):  # what follows the preflight (launcher, rank)
        monkeypatch.setattr(cli, step, launched)
    main = cli.main
    gpus(1, capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
    out = tmp_path / "run"
    assert main(["--precision", "fp8", "--steps", "1", "--out", str(out)]) == 2
    assert main(["--precision", "fp8", "--nproc-per-node", "1", "--out", str(out)]) == 2
    gpus(1)
    assert main(["--nproc-per-node", "2", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    assert "compute capability 8.0" in lines[0] and "compute capability 8.0" in lines[1], lines
    assert "2 ranks on this node but 1 visible GPU" in lines[2], lines
    assert not out.exists()


# ---------------------------------------------------------------- peaks

def test_the_longest_name_fragment_wins():
    assert peak_flops("NVIDIA H100 NVL", "bf16") == 835.5e12  # not the SXM's 989
    assert peak_flops("NVIDIA H100 NVL", "tf32") == 417.5e12
    assert peak_flops("NVIDIA H100 NVL", "fp32") == 60e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("nvidia h100 nvl", "fp16") == 835.5e12  # case-insensitive
    assert peak_flops("NVIDIA L4", "bf16") is None


def test_the_order_of_the_table_does_not_decide(monkeypatch):
    """Negative control for the rule: with "H100" listed before "H100 NVL", a first-match lookup would give
    the NVL the SXM's peak; the longest match still does not."""
    from refimpl.measure import peaks

    table = dict(peaks.PEAK_FLOPS)
    reordered = {"H100": table["H100"], **{k: v for k, v in table.items() if k != "H100"}}
    monkeypatch.setattr(peaks, "PEAK_FLOPS", reordered)
    assert next(iter(peaks.PEAK_FLOPS)) == "H100"
    assert peaks.peak_flops("NVIDIA H100 NVL", "bf16") == 835.5e12


def test_reserved_peak_is_none_and_the_reset_a_no_op_on_the_cpu():
    reset_peak_memory(CPU)
    assert peak_reserved_bytes(CPU) is None
