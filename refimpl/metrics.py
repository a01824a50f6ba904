"""What a training step costs and delivers: tokens/s, MFU, memory, and a progress bar (chapters 00-01).

MFU (model FLOPs utilisation, PaLM appendix B) = tokens/s x FLOPs per token / (devices x dense peak),
where the peak is that of the dtype the run's matrix multiplies compute in (:func:`peak_dtype`: an fp32
run is measured against the fp32 peak, a bf16 run against the bf16 peak; docs/ARCHITECTURE.md,
"Performance"). It is reported only where a peak is known (a GPU of :data:`refimpl.planner.PEAK_FLOPS`);
on a CPU it is "n/a", never a made-up number. Memory is the allocator's peak on a GPU and the process's
peak resident set on a CPU (which also counts the Python interpreter and libraries).
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from refimpl.planner import PEAK_DTYPES, model_flops_utilization, peak_flops

_PEAK_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def peak_dtype(compute_dtype: torch.dtype) -> str:
    """The :data:`refimpl.planner.PEAK_FLOPS` key of a run whose matmuls compute in ``compute_dtype``.

    bfloat16 -> ``"bf16"``, float16 -> ``"fp16"``. float32 -> ``"fp32"`` (the CUDA-core peak) under
    PyTorch's default ``torch.get_float32_matmul_precision() == "highest"``, and ``"tf32"`` (the
    tensor-core peak) when the run opted in to TF32 with ``"high"`` or ``"medium"``: MFU divides by the
    peak of the arithmetic that actually runs.
    """
    if compute_dtype == torch.float32:
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    if compute_dtype not in _PEAK_NAMES:
        raise ValueError(f"no peak for compute dtype {compute_dtype}; expected float32, bfloat16 or float16")
    return _PEAK_NAMES[compute_dtype]


def device_peak_flops(device: torch.device, *, dtype: str) -> float | None:
    """Dense peak FLOP/s of ``device`` for the compute ``dtype`` (a :data:`refimpl.planner.PEAK_DTYPES`
    key, see :func:`peak_dtype`), or None on a CPU or an unknown GPU."""
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"unknown compute dtype {dtype!r} for a peak; expected one of {PEAK_DTYPES}")
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), dtype)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; peak resident set size of this process on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


@dataclass(kw_only=True)
class Throughput:
    """Tokens per second over the steps since the last :meth:`step`, and MFU where a peak is known.

    ``tokens_per_step`` counts the global batch (all ranks); MFU divides by ``num_devices``. ``dtype`` is
    required (keyword-only, like every field): the :data:`refimpl.planner.PEAK_DTYPES` key of the dtype the
    run computes in, usually ``peak_dtype(policy.compute_dtype)``; there is no default, because a bf16 peak
    silently applied to an fp32 run under-reports its MFU 14.8 times on an H100.
    """

    tokens_per_step: int
    flops_per_token: float
    num_devices: int
    device: torch.device
    dtype: str
    _last: float = field(default_factory=time.perf_counter, init=False)

    def __post_init__(self) -> None:
        if self.dtype not in PEAK_DTYPES:
            raise ValueError(f"Throughput(dtype={self.dtype!r}): expected one of {PEAK_DTYPES}")

    def step(self, num_steps: int = 1) -> tuple[float, float | None]:
        """Return ``(tokens_per_s, mfu)`` since the previous call (synchronising the GPU first)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self._last = max(now - self._last, 1e-12), now
        tokens_per_s = self.tokens_per_step * num_steps / elapsed
        peak = device_peak_flops(self.device, dtype=self.dtype)
        mfu = None if peak is None else model_flops_utilization(
            tokens_per_s, self.flops_per_token, self.num_devices, peak
        )
        return tokens_per_s, mfu


def progress(total: int, *, enabled: bool = True, desc: str = "train", initial: int = 0) -> tqdm:
    """A tqdm progress bar shown on rank 0 only (pass ``enabled=ctx.is_main``)."""
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True,
                leave=True, file=sys.stderr)
