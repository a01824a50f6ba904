"""What the GPU check runs on, and what it runs with (bench/gpu/check.py).

The check starts on a bare image: ``python3`` with whatever (CUDA) build of torch it has, not the course's
``.venv``. So it records what a reader needs to compare two runs (GPU, compute capability, SM clocks, the
driver, torch, CUDA, cuDNN and NCCL versions) and which of the packages refimpl imports are there:

* ``numpy``: imported at module level by refimpl (seeding, the data, checkpoints, the planner's fits):
  without it refimpl cannot be imported, and the parts that need refimpl fail with that reason;
* ``tqdm``: the trainer's progress bar (refimpl/measure/throughput.py), nothing measured: without it a
  do-nothing stand-in is put in ``sys.modules`` (``stand_in_for_tqdm``), recorded under ``stand_ins``;
* ``matplotlib``: only the trainer's end-of-run report draws with it (loss.png): without it the report is
  skipped (bench/gpu/trainer_rows.py), recorded the same way;
* ``pytest``: runs the ``gpu``-marked tests if it is there (bench/gpu/gpu_tests.py).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import platform
import shutil
import subprocess
import sys
import types

import torch

SUITE_TORCH = "2.13.0"
"""The torch the test suite runs on CPU (Makefile ``TORCH_SPEC``): a GPU run on another version is recorded
as such, since a kernel or API may differ between the two."""

OPTIONAL = ("numpy", "tqdm", "matplotlib", "pytest")
SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
              "power.limit", "temperature.gpu", "memory.total")


def has_module(name: str) -> bool:
    """Whether ``import name`` would find the module (without importing it; a finder that refuses it, as
    tests/cli/test_bench_gpu.py's stand-in for a bare image does, counts as missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _version(name: str) -> str | None:
    if not has_module(name):
        return None
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - installed without metadata: present, version unknown
        return "present"


class _NoBar:
    """What refimpl's progress bar is asked for (``update``, ``set_postfix``, ``write``, ``close``), doing
    nothing but the ``write`` (the trainer's log lines)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.n = int(kwargs.get("initial", 0) or 0)

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, *args: object, **kwargs: object) -> None:
        pass

    @staticmethod
    def write(text: str, *args: object, **kwargs: object) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


def stand_in_for_tqdm() -> bool:
    """Put a do-nothing ``tqdm`` (and ``tqdm.auto``) in ``sys.modules`` when tqdm is not installed; True if
    it did. refimpl imports tqdm at module level for a progress bar only."""
    if has_module("tqdm"):
        return False
    tqdm, auto = types.ModuleType("tqdm"), types.ModuleType("tqdm.auto")
    for module in (tqdm, auto):  # a spec, no origin: importlib.util.find_spec works (torch._dynamo asks)
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    tqdm.tqdm = auto.tqdm = _NoBar
    tqdm.auto = auto
    sys.modules["tqdm"], sys.modules["tqdm.auto"] = tqdm, auto
    return True


def nvidia_smi() -> dict[str, str] | None:
    """The GPU as ``nvidia-smi`` reports it now (clocks are read at this moment: idle or under load), or
    None without the tool."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    return dict(zip(SMI_FIELDS, (v.strip() for v in first.split(",")), strict=False))


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL (CPU, ROCm without RCCL)
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _gpu(device: torch.device) -> dict[str, object]:
    """The properties of ``device`` that explain a throughput figure (what torch knows of it)."""
    props = torch.cuda.get_device_properties(device)
    fields = ("name", "total_memory", "multi_processor_count", "L2_cache_size", "clock_rate",
              "memory_clock_rate")
    info = {f: getattr(props, f) for f in fields if hasattr(props, f)}
    info["capability"] = f"{props.major}.{props.minor}"
    return info


def describe(device: torch.device) -> dict[str, object]:
    """Everything ``bench.gpu.environment`` records, as one JSON-ready dict."""
    cuda = torch.cuda.is_available()
    env: dict[str, object] = {
        "python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
        "torch": torch.__version__, "suite_torch": SUITE_TORCH,
        "torch_is_suite_version": torch.__version__.split("+")[0] == SUITE_TORCH,
        "cuda": torch.version.cuda, "cuda_available": cuda, "gpus": torch.cuda.device_count(),
        "cudnn": torch.backends.cudnn.version() if cuda else None, "nccl": _nccl_version() if cuda else None,
        "device": str(device), "modules": {name: _version(name) for name in OPTIONAL},
    }
    if device.type == "cuda":
        env["gpu"] = _gpu(device)
        env["nvidia_smi"] = nvidia_smi()
    return env
