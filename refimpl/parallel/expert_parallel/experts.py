"""The experts of a mixture-of-experts layer: one module each, or all in 3-D weights (chapter 09).

An expert is an MLP ``[n, h] -> [n, h]``:

* ``swiglu`` (Shazeer 2020, "GLU Variants Improve Transformer"; Mixtral, DeepSeek-V3):
  ``E(x) = (silu(x W1) * (x W3)) W2`` with ``W1, W3: [h, f]`` and ``W2: [f, h]``;
* ``gelu`` (Switch Transformer, GShard): ``E(x) = gelu(x W1) W2``.

The layer hands its local experts their tokens **sorted by expert**: ``x [R, h]`` whose first ``counts[0]``
rows are expert 0's, the next ``counts[1]`` expert 1's, and so on. Two ways to run them:

* ``LoopedExperts``: any modules, one call each on its block of rows (the general path, and the
  readable one); ``ExpertMLP`` is the module this course uses;
* ``GroupedExperts``: the ``L`` local experts' weights stacked into 3-D tensors ``w1, w3: [L, h, f]``,
  ``w2: [L, f, h]``, and one ``torch._grouped_mm`` per projection over all blocks at once (the efficient
  path; torchtitan's and Megatron-LM's "grouped GEMM"). ``torch._grouped_mm(x, w, offs=offs)`` with ``x
  [R, h]``, ``w [L, h, f]`` and ``offs`` the int32 **cumulative end rows** ``offs[i] = sum_{j<=i}
  counts[j]`` multiplies rows ``[offs[i-1], offs[i])`` by ``w[i]`` (an expert with zero rows repeats the
  previous offset and gets a zero gradient); rows past ``offs[-1]`` are left uninitialised, so ``offs[-1]``
  must be ``R``. Measured on torch 2.13 CPU: it takes fp32 / bf16 / fp16 only, needs strides that are a
  multiple of 16 bytes (``h`` and ``f`` multiples of 4 in fp32, of 8 in bf16), and its backward fails on a
  stride-0 incoming gradient (``y.sum().backward()``): ``contiguous_grad`` makes it contiguous. With
  AVX-512 kernels one expert's result can depend, in the last bit, on the other experts in the same call
  (an expert-parallel rank's 2-expert call against one device's 8-expert call). Where
  ``_grouped_mm`` does not apply (fp64, odd widths), or would not run its fused kernel on CUDA (below),
  ``GroupedExperts`` runs its own per-expert loop, ``GroupedExperts.forward_loop``, which is also
  the reference the tests compare it with.

**Autocast does not cast ``torch._grouped_mm``** (it is on none of autocast's op lists): under
``torch.autocast(dtype=torch.bfloat16)`` the fp32 LayerNorm output and the fp32 weights would reach it as
they are, and every expert GEMM of a "bf16" run would compute in fp32. On CUDA that is the slow path:
``_grouped_mm_cuda`` runs its fused CUTLASS kernel (sm90 / sm100) only for bf16 operands and output, and
otherwise ``_grouped_mm_fallback``, one matmul per expert after ``offs.cpu()`` (a host sync). So, as
torchtitan's ``_run_experts_grouped_mm`` does (``x.bfloat16()``, ``w.bfloat16()``; torchtitan
``torchtitan/models/moe/moe.py``), ``GroupedExperts.forward`` casts the rows (once, shared by ``w1``
and ``w3``) and the weights to ``torch.get_autocast_dtype(device)`` itself when autocast is on, and the
result comes out in that dtype, as a linear's would; outside autocast nothing is cast (the fp32 path is
unchanged, bit for bit). The per-expert loop needs no such care: its ``@`` is on autocast's list. Where
CUDA would take the fallback anyway (fp32 or fp16 operands, a GPU other than sm90 / sm100, ROCm) the
layer runs its per-expert loop instead: the same matmuls, without the fallback's ``offs.cpu()`` per call
(nine per SwiGLU layer and micro-batch, forward and backward), since the loop's counts are host ints
already (``grouped_mm_runs_fused``). On CPU ``_grouped_mm`` runs whatever the dtype.

The kernel's other rules (``aten/src/ATen/native/cuda/GroupMMCommon.cuh``, the checks of
``torch/_meta_registrations.py``): ``offs`` int32 (a cumulative sum on the device, no host copy), operand
strides a multiple of 16 bytes (the width check above, in the compute dtype), and no per-expert row
padding for this layout: the 16-byte rule on a group's *row count* applies only where the groups run
along a row-major operand's contiguous dimension, and neither the forward (``x [R, h]`` by ``w [L, h,
f]``, groups along ``x``'s rows) nor the weight gradient (``x^T`` column-major by ``dy`` row-major, groups
along ``K``, zero-row groups allowed) is such a case. torchtitan padded each expert's rows to a multiple
of 8 / 16 until it found the bf16 kernel does not need it (pytorch/torchtitan#2774 "remove unnecessary
padding in MoE"; the padding stays for fp8 / MXFP8 grouped GEMMs, which this course does not run on
experts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("swiglu", "gelu")
"""Expert MLPs: SwiGLU (three matrices) or GELU (two)."""

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype where it is on for ``x``'s device and casts ``x`` (floats but fp64), else None."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind) or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(kind)


def grouped_mm_runs_fused(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` on ``device`` in ``dtype`` runs without a host sync (module docstring):
    always on CPU; on CUDA only the fused kernel, bf16 on sm90 / sm100 (``_grouped_mm_cuda``'s
    ``use_fast_path``, torch 2.13; ROCm, whose fast path depends on the build: treated as never), not
    ``_grouped_mm_fallback``'s ``offs.cpu()``."""
    if device.type != "cuda":
        return True
    if torch.version.hip or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def _check_counts(x: torch.Tensor, counts: Sequence[int], num_local: int) -> None:
    if len(counts) != num_local or sum(counts) != x.shape[0]:
        raise ValueError(f"{x.shape[0]} rows for {num_local} experts do not match the counts {list(counts)}")


class ExpertMLP(nn.Module):
    """One expert, ``[n, h] -> [n, h]``: ``w2(silu(w1 x) * w3 x)`` (swiglu) or ``w2(gelu(w1 x))`` (gelu),
    bias-free ``nn.Linear`` s."""

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu", *, device=None, dtype=None) -> None:
        super().__init__()
        _check_activation(activation)
        kw = dict(bias=False, device=device, dtype=dtype)
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden, **kw)
        self.w3 = nn.Linear(dim, hidden, **kw) if activation == "swiglu" else None
        self.w2 = nn.Linear(hidden, dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            assert self.w3 is not None  # made for swiglu
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class LoopedExperts(nn.ModuleDict):
    """Given expert modules run one by one, each on its block of the expert-sorted rows. Keyed by the
    **global** expert index (``"2"``, ``"3"`` on the rank that owns experts 2 and 3), so parameter names say
    which expert they are on every rank. Every expert is called, with zero rows too (its gradient is then
    zero, as on one device)."""

    def __init__(self, experts: Sequence[nn.Module], first: int = 0) -> None:
        super().__init__({str(first + i): m for i, m in enumerate(experts)})
        self.first = first

    def forward(self, x: torch.Tensor, counts: Sequence[int],
                device_counts: torch.Tensor | None = None) -> torch.Tensor:
        """``device_counts`` (the counts on the device) is accepted for ``GroupedExperts``' signature;
        the loop needs the host ints only."""
        _check_counts(x, counts, len(self))
        outs = [expert(rows) for expert, rows in zip(self.values(), x.split(list(counts)), strict=True)]
        return torch.cat(outs) if outs else x[:0]


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; backward makes the incoming gradient contiguous (``_grouped_mm``'s backward refuses
    a stride-0 gradient such as ``sum()``'s on torch 2.13 CPU)."""
    return _ContiguousGrad.apply(x)


def _uniform(shape: tuple[int, ...], fan_in: int, generator: torch.Generator | None) -> torch.Tensor:
    """``nn.Linear``'s default init ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


class GroupedExperts(nn.Module):
    """The local experts ``[first, first + num_local)`` of ``num_experts`` as 3-D weights (module docstring):
    ``w1 [L, h, f]``, ``w3 [L, h, f]`` (swiglu only), ``w2 [L, f, h]``, each expert's ``x @ w[e]``.

    The full ``[E, ...]`` tensors are drawn from ``generator`` (``nn.Linear``'s init, fan-in ``h`` and
    ``f``) and sliced, so every expert-parallel layout holds the same experts as one device.
    ``forward(x, counts)``: one ``_grouped_mm`` per projection; ``forward_loop``: the same maths expert
    by expert."""

    def __init__(self, *, dim: int, hidden: int, num_experts: int, activation: str = "swiglu", first: int = 0,
                 num_local: int | None = None, generator: torch.Generator | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        _check_activation(activation)
        num_local = num_experts - first if num_local is None else num_local
        if not (0 <= first and num_local >= 1 and first + num_local <= num_experts):
            raise ValueError(f"local experts [{first}, {first + num_local}) outside [0, {num_experts})")
        self.dim, self.hidden, self.num_experts, self.activation = dim, hidden, num_experts, activation
        self.first, self.num_local = first, num_local
        local = slice(first, first + num_local)

        def param(shape, fan_in):
            w = _uniform((num_experts, *shape), fan_in, generator)[local]
            w = w.to(device=device, dtype=dtype or torch.get_default_dtype())
            # a copy of the rows: the slice (a view) would keep all E experts' storage alive on every rank
            return nn.Parameter(w.clone(memory_format=torch.contiguous_format))

        self.w1 = param((dim, hidden), dim)
        self.w3 = param((dim, hidden), dim) if activation == "swiglu" else None
        self.w2 = param((hidden, dim), hidden)

    @classmethod
    def from_modules(cls, experts: Sequence[ExpertMLP], *, first: int = 0,
                     num_experts: int | None = None) -> GroupedExperts:
        """The given ``ExpertMLP`` s (experts ``first, first+1, ...``) stacked:
        ``w[e] = linear.weight.T``."""
        e0 = experts[0]
        layer = cls(dim=e0.w1.in_features, hidden=e0.w1.out_features, activation=e0.activation,
                    num_experts=num_experts or first + len(experts), first=first, num_local=len(experts),
                    generator=torch.Generator(), device=e0.w1.weight.device, dtype=e0.w1.weight.dtype)
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                if getattr(layer, name) is not None:
                    getattr(layer, name).copy_(torch.stack([getattr(m, name).weight.t() for m in experts]))
        return layer

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the experts compute ``x`` in: autocast's (``torch.get_autocast_dtype``) where it is on
        for ``x``'s device and would cast ``x`` (a float, not fp64), else ``x.dtype``."""
        return _autocast_dtype(x) or x.dtype

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` runs ``_grouped_mm`` for ``x``: a dtype it takes (``compute_dtype``; the
        weights' too, outside autocast), 16-byte strides in it, and no host sync for it on ``x``'s device
        (``grouped_mm_runs_fused``)."""
        dtype = self.compute_dtype(x)
        size = dtype.itemsize
        same = _autocast_dtype(x) is not None or self.w1.dtype == x.dtype
        return (dtype in _GROUPED_MM_DTYPES and same and grouped_mm_runs_fused(x.device, dtype)
                and (self.dim * size) % 16 == 0 and (self.hidden * size) % 16 == 0)

    def forward(self, x: torch.Tensor, counts: Sequence[int],
                device_counts: torch.Tensor | None = None) -> torch.Tensor:
        """``x [R, h]`` sorted by expert, ``counts`` its rows per local expert (host ints, checked);
        ``device_counts``: the same on ``x``'s device, whose cumulative sum are the offsets (without it
        they are copied from the host, a blocking copy on a GPU). Under autocast the rows and the weights
        are cast to its dtype first (module docstring); the result is in that dtype, as a linear's."""
        _check_counts(x, counts, self.num_local)
        if not self.uses_grouped_mm(x):
            return self.forward_loop(x, counts)
        if device_counts is None:
            device_counts = torch.tensor(counts, device=x.device)
        offs = device_counts.cumsum(0, dtype=torch.int32)
        dtype = self.compute_dtype(x)
        x = x.to(dtype).contiguous()

        def mm(a, w):
            return contiguous_grad(torch._grouped_mm(a, w.to(dtype), offs=offs))

        if self.activation == "swiglu":
            h = F.silu(mm(x, self.w1)) * mm(x, self.w3)
        else:
            h = F.gelu(mm(x, self.w1))
        return mm(h, self.w2)

    def forward_loop(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """The reference: expert ``e`` computes its block of rows with plain matmuls."""
        _check_counts(x, counts, self.num_local)
        outs = []
        for e, rows in enumerate(x.split(list(counts))):
            if self.activation == "swiglu":
                assert self.w3 is not None  # made for swiglu
                h = F.silu(rows @ self.w1[e]) * (rows @ self.w3[e])
            else:
                h = F.gelu(rows @ self.w1[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs)

    def extra_repr(self) -> str:
        last = self.first + self.num_local
        return (f"dim={self.dim}, hidden={self.hidden}, experts [{self.first}, {last}) of "
                f"{self.num_experts}, activation={self.activation}")


__all__ = ["ACTIVATIONS", "ExpertMLP", "GroupedExperts", "LoopedExperts", "contiguous_grad",
           "grouped_mm_runs_fused"]
