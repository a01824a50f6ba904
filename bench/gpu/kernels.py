"""The kernel checks of bench/gpu/check.py: ``torch._scaled_mm`` (fp8), ``torch._grouped_mm`` (MoE experts),
and why a GPU is timed with CUDA events.

**The bound.** Each kernel's output is compared with a float64 product of the same (dequantized) operands,
element by element, within ``2 (2^-8 |ref| + A (|a| @ |b|))``: the output's rounding to bf16 (unit roundoff
``2^-8``) and the accumulation over the contraction length ``K`` (Higham: ``|error| <= k u sum |a_i b_i|``),
times a stated factor 2. ``A = K 2^-24`` where the kernel accumulates in float32 (every CPU kernel, and CUDA's
bf16 GEMMs); fp8 on CUDA adds ``min(K, 128) 2^-14``: Hopper's fp8 tensor cores keep about 14 bits while
they accumulate (DeepSeek-V3, section 3.3.2), and cuBLAS without fast accumulation moves the partial sum to
float32 every 128 terms (the same model as tests/ranks/test_gpu.py's). The figure recorded is the largest
``|out - ref| / bound``: at most 1 passes. A negative control keeps the bound honest: the output doubled
(a scale applied twice) must exceed it.

**fp8** (docs/ARCHITECTURE.md, "GPUs"; refimpl/precision/fp8): ``a`` row-major, ``b`` column-major, float32
inverse scales, 0-d (tensorwise) or ``[M, 1]`` / ``[1, N]`` (rowwise, bf16 out), at the shapes of the
trainer's MLP up-projection (``[tokens, h] x [h, 4h]``) and of its two backward GEMMs (the input's and the
weight's gradient), in torchao's two recipes: tensorwise with e5m2 gradients, rowwise all e4m3.

**Grouped GEMM**: bf16 ``x [R, K]`` against ``w [G, K, N]`` with int32 cumulative end rows, uneven group
sizes, forward and both gradients against a loop over the groups; then, alone (the last case, since a
device-side assert would end the CUDA context), a group with no rows, whose weight gradient must be zero.

**Async timing**: a chain of matrix products launched and timed with the CPU clock without a synchronize
(what ``time.perf_counter`` around GPU code measures: the launches), with one, and with CUDA events.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

FACTOR = 2.0  # stated: the bound's terms are worst cases already
BF16_U, FP32_U = 2.0**-8, 2.0**-24  # unit roundoffs: the output's, a float32 accumulator's
FP8_CUDA_U, FP8_CUDA_CHUNK = 2.0**-14, 128  # Hopper's fp8 accumulator, cuBLAS's promotion interval
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def bound(ref: torch.Tensor, abs_product: torch.Tensor, k: int, *, fp8_on_cuda: bool = False) -> torch.Tensor:
    """The allowed ``|out - ref|`` per element (module docstring); ``abs_product = |a| @ |b|``."""
    accumulation = k * FP32_U + (min(k, FP8_CUDA_CHUNK) * FP8_CUDA_U if fp8_on_cuda else 0.0)
    return FACTOR * (BF16_U * ref.abs() + accumulation * abs_product)


def error_ratio(out: torch.Tensor, ref: torch.Tensor, allowed: torch.Tensor) -> float:
    """The largest ``|out - ref| / allowed`` (inf for a non-finite output)."""
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.double() - ref).abs() / allowed.clamp_min(1e-300)).max().item()


# ---- fp8: torch._scaled_mm ---------------------------------------------------------------------------------

def quantize(x: torch.Tensor, fmt: torch.dtype, *, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in ``fmt`` and its float32 **inverse** scale (what ``_scaled_mm`` multiplies by): one amax for
    the tensor (``dim=None``), or one per slice along the contraction ``dim`` (``[M, 1]`` or ``[1, N]``)."""
    fmax = torch.finfo(fmt).max
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = fmax / amax.float().clamp_min(1e-12)
    q = (x.float() * scale).clamp(-fmax, fmax).to(fmt)
    return q, (1.0 / scale).float().contiguous()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def scaled_mm_case(a_hp: torch.Tensor, b_hp: torch.Tensor, fmts: tuple[torch.dtype, torch.dtype],
                   rowwise: bool) -> dict[str, object]:
    """``_scaled_mm`` of ``a_hp [M, K]`` and ``b_hp [K, N]`` cast to ``fmts`` against float64: the error
    ratio, the negative control's, and whether it passes."""
    qa, sa = quantize(a_hp, fmts[0], dim=1 if rowwise else None)
    qb, sb = quantize(b_hp, fmts[1], dim=0 if rowwise else None)
    qb = _column_major(qb)
    out = torch._scaled_mm(qa.contiguous(), qb, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    da, db = qa.double() * sa.double(), qb.double() * sb.double()
    ref = da @ db
    allowed = bound(ref, da.abs() @ db.abs(), a_hp.shape[1], fp8_on_cuda=qa.is_cuda)
    ratio, control = error_ratio(out, ref, allowed), error_ratio(2 * out.double(), ref, allowed)
    return {"shape": [*a_hp.shape, b_hp.shape[1]], "formats": [str(f).split(".")[-1] for f in fmts],
            "scaling": "rowwise" if rowwise else "tensorwise", "error_ratio": ratio,
            "control_ratio": control, "ok": ratio <= 1.0 < control}


def mlp_operands(tokens: int, hidden: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The MLP up-projection's tensors: input ``x [T, h]``, weight ``w [4h, h]``, output gradient ``dy``."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=g)
    w = torch.randn(4 * hidden, hidden, device=device, generator=g) / math.sqrt(hidden)
    dy = torch.randn(tokens, 4 * hidden, device=device, generator=g) * 1e-3
    return {"x": x, "w": w, "dy": dy}


def scaled_mm_width(tokens: int, hidden: int, device: torch.device) -> list[dict[str, object]]:
    """The three GEMMs of one fp8 linear (forward, input gradient, weight gradient) in both recipes."""
    t = mlp_operands(tokens, hidden, device, seed=hidden)
    gemms = {"forward": (t["x"], t["w"].t()), "grad_input": (t["dy"], t["w"]),
             "grad_weight": (t["dy"].t(), t["x"])}
    cases = []
    for rowwise in (False, True):
        for name, (a, b) in gemms.items():
            grad = E4M3 if rowwise or name == "forward" else E5M2  # tensorwise: e5m2 gradients
            case = scaled_mm_case(a, b, (grad, E4M3), rowwise)
            cases.append({"gemm": name, "hidden": hidden, **case})
    return cases


def scaled_mm_check(widths: list[tuple[int, int]], device: torch.device) -> dict[str, object]:
    """Every case of ``scaled_mm_width`` at each ``(tokens, hidden)``; passes when all do."""
    cases = [c for tokens, hidden in widths for c in scaled_mm_width(tokens, hidden, device)]
    worst = max(c["error_ratio"] for c in cases)
    return {"status": "pass" if all(c["ok"] for c in cases) else "fail", "cases": cases,
            "detail": f"{len(cases)} GEMMs, largest error / bound {worst:.3f} (<= 1 passes)"}


# ---- grouped GEMM: torch._grouped_mm -----------------------------------------------------------------------

def uneven_counts(rows: int, groups: int, *, empty: int | None = None) -> list[int]:
    """Group sizes summing to ``rows``, group ``g`` about ``(g + 1)`` shares (none aligned on purpose), and
    group ``empty`` with none."""
    weights = [0 if g == empty else g + 1 for g in range(groups)]
    counts = [rows * w // sum(weights) for w in weights]
    counts[-1 if empty != groups - 1 else 0] += rows - sum(counts)
    return counts


def _grouped_reference(x, w, dy, counts) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """Per group, float64: ``(ref, |.| @ |.|, K)`` of the output, the input gradient and the weight's."""
    out: dict[str, list] = {"y": [], "dx": [], "dw": []}
    for g, (xg, dyg) in enumerate(zip(x.double().split(counts), dy.double().split(counts), strict=True)):
        wg = w[g].double()
        out["y"].append((xg @ wg, xg.abs() @ wg.abs(), wg.shape[0]))
        out["dx"].append((dyg @ wg.t(), dyg.abs() @ wg.abs().t(), wg.shape[1]))
        out["dw"].append((xg.t() @ dyg, xg.abs().t() @ dyg.abs(), xg.shape[0]))
    return out


def _stacked(parts: list[tuple[torch.Tensor, torch.Tensor, int]], cat: Callable) -> tuple:
    return cat([r for r, _, _ in parts]), cat([bound(r, p, k) for r, p, k in parts])


def grouped_mm_case(rows: int, k: int, n: int, counts: list[int], device: torch.device) -> dict[str, object]:
    """Forward and backward of ``_grouped_mm(x, w, offs)`` (bf16, int32 offsets) against the group loop."""
    g = torch.Generator(device=device).manual_seed(rows + k)
    x = torch.randn(rows, k, device=device, generator=g).bfloat16().requires_grad_()
    w = torch.randn(len(counts), k, n, device=device, generator=g) / math.sqrt(k)
    w = w.bfloat16().requires_grad_()
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    y = torch._grouped_mm(x, w, offs=offs)
    dy = torch.randn(rows, n, device=device, generator=g).bfloat16()
    y.backward(dy)
    ref = _grouped_reference(x.detach(), w.detach(), dy, counts)
    got = {"y": y.detach(), "dx": x.grad, "dw": w.grad}
    ratios = {}
    for name, cat in (("y", torch.cat), ("dx", torch.cat), ("dw", torch.stack)):
        r, allowed = _stacked(ref[name], cat)
        ratios[name] = error_ratio(got[name], r, allowed)
    empty = [i for i, c in enumerate(counts) if c == 0]
    zero = all(torch.count_nonzero(w.grad[i]).item() == 0 for i in empty)
    return {"rows": rows, "k": k, "n": n, "counts": counts, "error_ratios": ratios,
            "empty_groups_zero_grad": zero if empty else None,
            "ok": max(ratios.values()) <= 1.0 and (zero or not empty)}


def fp32_accepted(device: torch.device) -> bool | str:
    """Whether ``_grouped_mm`` takes float32 operands here (refimpl's GroupedExperts assumes it does on the
    CPU; CUDA's kernel is bf16-only): recorded, not judged."""
    x, w = torch.ones(16, 8, device=device), torch.ones(2, 8, 8, device=device)
    try:
        torch._grouped_mm(x, w, offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as exc:
        return f"no: {str(exc).splitlines()[0][:160]}"
    return True


def grouped_mm_check(shapes: list[tuple[int, int, int, int]], device: torch.device) -> dict[str, object]:
    """Uneven groups at each ``(rows, k, n, groups)``, then the empty-group case at the first shape."""
    cases = [grouped_mm_case(r, k, n, uneven_counts(r, gr), device) for r, k, n, gr in shapes]
    r, k, n, gr = shapes[0]
    try:
        cases.append(grouped_mm_case(r, k, n, uneven_counts(r, gr, empty=1), device))
    except (RuntimeError, NotImplementedError) as exc:
        cases.append({"counts": uneven_counts(r, gr, empty=1), "ok": False,
                      "error": str(exc).splitlines()[0][:300]})
    worst = max((max(c["error_ratios"].values()) for c in cases if "error_ratios" in c), default=math.inf)
    return {"status": "pass" if all(c["ok"] for c in cases) else "fail", "cases": cases,
            "fp32_accepted": fp32_accepted(device),
            "detail": f"{len(cases)} cases (uneven groups, one empty), forward + both gradients, largest "
                      f"error / bound {worst:.3f}"}


# ---- why GPU code is timed with CUDA events ---------------------------------------------------------------

def _chain(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, n: int) -> None:
    for _ in range(n):
        torch.mm(a, b, out=out)


def async_timing(device: torch.device, *, size: int, chain: int) -> dict[str, object]:
    """``chain`` bf16 products ``[size, size]^2``: seconds by the CPU clock before and after a synchronize,
    and by CUDA events. On a GPU the first measures the launches only (a pass: under half the events'
    time); on a CPU every call returns when done, so there is nothing to show (a skip, the clocks kept)."""
    a, b = (torch.randn(size, size, device=device).bfloat16() for _ in range(2))
    out = torch.empty_like(a)
    _chain(a, b, out, 3)  # warm-up: cuBLAS's handle and heuristics
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
    t0 = time.perf_counter()
    if events:
        events[0].record()
    _chain(a, b, out, chain)
    if events:
        events[1].record()
    launched = time.perf_counter() - t0
    sync()
    synced = time.perf_counter() - t0
    rec = {"matrix": size, "chain": chain, "cpu_clock_no_sync_s": launched, "cpu_clock_synced_s": synced}
    if not events:
        return rec | {"status": "skip", "detail": "CPU: a call returns when done; no CUDA event to compare"}
    gpu = events[0].elapsed_time(events[1]) / 1e3
    tflops = 2 * size**3 * chain / gpu / 1e12
    ok = launched < 0.5 * gpu
    verdict = "the launches only" if ok else "more than the launches (CUDA_LAUNCH_BLOCKING set?)"
    return rec | {"cuda_events_s": gpu, "achieved_tflops": tflops, "status": "pass" if ok else "fail",
                  "detail": f"CPU clock without a synchronize {launched * 1e3:.2f} ms, with one "
                            f"{synced * 1e3:.2f} ms, CUDA events {gpu * 1e3:.2f} ms ({tflops:.0f} TFLOP/s "
                            f"bf16): the unsynchronised clock measured {verdict}"}
