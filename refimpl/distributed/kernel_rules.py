"""What CUDA's fp8 and grouped GEMMs refuse, checked on any tensor (chapters 09 and 10).

A CPU runs ``torch._scaled_mm`` and ``torch._grouped_mm`` in any layout and dtype; a GPU does not. These
rules, read from torch's CUDA kernels (``aten/src/ATen/native/cuda/ScaledBlas.cpp``,
``GroupMMCommon.cuh``) and the meta kernels that mirror them, are what the device lint
(``refimpl.distributed.device_lint``) checks where the calls run, and what chapter 10's grader holds a
learner's ``scaled_mm`` to.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_dtype", "grouped_mm_problems", "scaled_mm_problems"]


def scaled_mm_problems(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
                       ) -> list[str]:
    """What sm90's ``torch._scaled_mm`` would refuse in ``a @ b`` (empty: nothing). Also the chapter 10
    grader's layout check (a CPU ``_scaled_mm`` takes every layout). Not checked: the output dtype of
    rowwise scaling (bf16 or fp16 but on sm90 with cuBLAS 12.9 or later), which
    ``refimpl.precision.fp8.float8_linear.scaled_mm`` chooses by device itself."""
    problems = []
    M, K = a.shape
    N = b.shape[1]
    if not (a.stride(1) == 1 and a.stride(0) >= max(K, 1)):
        problems.append(f"a must be row-major, got strides {a.stride()}")
    if not (b.stride(0) == 1 and b.stride(1) >= max(K, 1)):
        problems.append(f"b must be column-major (a transposed row-major weight), got strides {b.stride()}")
    if K % 16 or N % 16:
        problems.append(f"K={K} and N={N} must be multiples of 16")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        problems.append("e5m2 x e5m2 has no kernel")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        problems.append(f"scales must be float32, got {scale_a.dtype} and {scale_b.dtype}")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = (tuple(scale_a.shape) == (M, 1) and tuple(scale_b.shape) == (1, N)
               and scale_a.is_contiguous() and scale_b.is_contiguous())
    if not (tensorwise or rowwise):
        problems.append(f"scales must be both one element (tensorwise) or [M, 1] and [1, N] contiguous "
                        f"(rowwise), got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    return problems


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes in on ``t``'s device, None when autocast is off."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def grouped_mm_problems(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, *,
                        autocast: torch.dtype | None = None) -> list[str]:
    """What CUDA's ``torch._grouped_mm`` would refuse or run off its fast path (empty: nothing): under
    autocast (``autocast``: its dtype) operands of another dtype (autocast does not cast ``_grouped_mm``:
    a bf16 run would compute its experts in fp32, on the per-group fallback), operands of two dtypes,
    misaligned data, offsets other than int32. fp32 outside autocast runs (CUDA's fallback)."""
    problems = []
    if autocast is not None and (a.dtype != autocast or b.dtype != autocast):
        problems.append(f"operands {a.dtype} and {b.dtype} under {autocast} autocast (autocast does not cast "
                        "_grouped_mm: cast them first)")
    elif a.dtype != b.dtype:
        problems.append(f"operands of two dtypes, {a.dtype} and {b.dtype}")
    for label, t in (("a", a), ("b", b)):
        size = t.element_size()
        if t.data_ptr() % 16 or any(s * size % 16 for s in t.stride() if s != 1):
            problems.append(f"{label} must be 16-byte aligned (pointer and strides), strides {t.stride()}")
    if offs is not None and offs.dtype != torch.int32:
        problems.append(f"offsets must be int32, got {offs.dtype}")
    return problems
