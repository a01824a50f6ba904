"""What a training step delivers: tokens/s and MFU, and a progress bar (chapters 00, 01 and 10).

MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM appendix B) = tokens/s x FLOPs per token /
(devices x dense peak), where the peak is that of the dtype the run's matrix multiplies compute in
(``peak_dtype``: an fp32 run is measured against the fp32 peak, a bf16 run against the bf16 peak;
docs/ARCHITECTURE.md, "Performance"). It is reported only where a peak is known (a GPU of
``refimpl.measure.peaks.PEAK_FLOPS``); on a CPU it is "n/a", never a made-up number. The FLOPs per
token come from the planner (``refimpl.planner.flops_per_token``); the peak bytes of a step are in
``refimpl.measure.peak``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm  # tqdm.std's text bar, in a notebook too: progress()

from refimpl.measure.peaks import PEAK_DTYPES, peak_flops

__all__ = ["Throughput", "device_peak_flops", "format_mfu", "model_flops_utilization", "peak_dtype",
           "progress"]

_PEAK_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def model_flops_utilization(
    tokens_per_s: float, flops_per_tok: float, num_devices: int, peak_flops_per_device: float
) -> float:
    """MFU = tokens/s x FLOPs per token / (devices x peak) (PaLM appendix B)."""
    return tokens_per_s * flops_per_tok / (num_devices * peak_flops_per_device)


def peak_dtype(compute_dtype: torch.dtype) -> str:
    """The ``refimpl.measure.peaks.PEAK_FLOPS`` key of a run whose matmuls compute in ``compute_dtype``.

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
    """Dense peak FLOP/s of ``device`` for the compute ``dtype`` (a
    ``refimpl.measure.peaks.PEAK_DTYPES`` key, see ``peak_dtype``), or None on a CPU or an unknown
    GPU."""
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"unknown compute dtype {dtype!r} for a peak; expected one of {PEAK_DTYPES}")
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), dtype)


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


@dataclass(kw_only=True)
class Throughput:
    """Tokens per second over the steps since the last ``step``, and MFU where a peak is known.

    ``tokens_per_step`` counts the global batch (all ranks); MFU divides by ``num_devices``. ``dtype`` is
    required (keyword-only, like every field): the ``refimpl.measure.peaks.PEAK_DTYPES`` key of the
    dtype the run computes in, usually ``peak_dtype(policy.compute_dtype)``; there is no default, because a
    bf16 peak silently applied to an fp32 run under-reports its MFU 14.8 times on an H100.
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
    """A tqdm progress bar shown on rank 0 only (pass ``enabled=ctx.is_main``).

    Always tqdm's text bar, never ``tqdm.auto``'s notebook widget, which a kernel or an ipyparallel engine
    would pick: a widget's saved output is its text when created, "train: 0%", what an executed notebook
    keeps (nbval, ``make book``'s pages), and a widget is displayed past ``contextlib.redirect_stderr``
    (chapters 09 and 12 hide the trainer's log that way). The text bar goes where ``sys.stderr`` points when
    it is created (a redirect's buffer, a cell's stderr), redraws its line in place ("\\r", which a cell
    shows in place) and ends at 100%.
    """
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True,
                leave=True, file=sys.stderr)
