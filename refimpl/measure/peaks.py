"""Dense peak FLOP/s of the devices, by the dtype their matrix multiplies compute in (chapters 00, 01, 10).

The one table of device peaks in refimpl: ``refimpl.measure.throughput.model_flops_utilization`` (MFU)
divides by it and ``refimpl.planner`` re-exports it for what-if arithmetic (chapter 00 checks a
published claim with it). Dense, never the 2:4-sparse figures (docs/ARCHITECTURE.md, "Performance").
"""

from __future__ import annotations

__all__ = ["PEAK_DTYPES", "PEAK_FLOPS", "peak_flops"]

# Dense (not 2:4 sparse) peak throughput in FLOP/s, by device name fragment and the dtype the matrix
# multiplies compute in. Sources: NVIDIA's H100 Tensor Core GPU architecture white paper (SXM5: BF16/FP16
# 989 dense, TF32 494.7 dense, FP32 67 on the CUDA cores; the H200 has the same SMs and clocks) and the
# A100 data sheet (BF16/FP16 312, TF32 156, FP32 19.5). The H100 PCIe card is slower (H100 data sheet:
# BF16 756, TF32 378, FP32 51), and so is the H100 NVL (the H100 data sheet's NVL column, per GPU: BF16/FP16
# 1,671 and TF32 835 TFLOP/s "with sparsity", so 835.5 and 417.5 dense; FP32 60). The longest fragment in
# the device's name wins (``peak_flops``): "NVIDIA H100 NVL" is an NVL, not an SXM.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIE": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}
PEAK_DTYPES: tuple[str, ...] = ("bf16", "fp16", "tf32", "fp32")


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a device for the dtype its matrix multiplies compute in (``PEAK_FLOPS``).

    ``dtype`` is one of ``PEAK_DTYPES`` and has no default: the MFU of an fp32 run divided by the
    bf16 peak would be 989 / 67 = 14.8 times too small on an H100. ``"fp32"`` is the peak of true float32
    arithmetic on the CUDA cores (67 TFLOP/s on an H100), because that is what PyTorch computes by default
    (``torch.get_float32_matmul_precision() == "highest"``: no TF32). ``"tf32"`` is the tensor-core peak
    that a float32 run reaches only after opting in to TF32 (precision ``"high"`` or ``"medium"``);
    ``refimpl.measure.throughput.peak_dtype`` picks between the two. Returns None for a device not in
    the table (a CPU, an unknown GPU): no made-up peak. An unknown ``dtype`` is a ValueError, not a silent
    None. Of the fragments found in ``device_name`` (case-insensitive) the longest wins, whatever the
    table's order: "NVIDIA H100 NVL" holds both "H100" and "H100 NVL", and is the NVL card.
    """
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"unknown compute dtype {dtype!r} for a peak; expected one of {PEAK_DTYPES}")
    found = [fragment for fragment in PEAK_FLOPS if fragment in device_name.upper()]
    return PEAK_FLOPS[max(found, key=len)][dtype] if found else None
