"""The experts of a mixture-of-experts layer: one module each, or all in 3-D weights (chapter 09).

An expert is an MLP ``[n, h] -> [n, h]``:

* ``swiglu`` (Shazeer 2020, "GLU Variants Improve Transformer"; Mixtral, DeepSeek-V3):
  ``E(x) = (silu(x W1) * (x W3)) W2`` with ``W1, W3: [h, f]`` and ``W2: [f, h]``;
* ``gelu`` (Switch Transformer, GShard): ``E(x) = gelu(x W1) W2``.

The layer hands its local experts their tokens **sorted by expert**: ``x [R, h]`` whose first ``counts[0]``
rows are expert 0's, the next ``counts[1]`` expert 1's, and so on. Two ways to run them:

* :class:`LoopedExperts`: any modules, one call each on its block of rows (the general path, and the
  readable one); :class:`ExpertMLP` is the module this course uses;
* :class:`GroupedExperts`: the ``L`` local experts' weights stacked into 3-D tensors ``w1, w3: [L, h, f]``,
  ``w2: [L, f, h]``, and one ``torch._grouped_mm`` per projection over all blocks at once (the efficient
  path; torchtitan's and Megatron-LM's "grouped GEMM"). ``torch._grouped_mm(x, w, offs=offs)`` with ``x
  [R, h]``, ``w [L, h, f]`` and ``offs`` the int32 **cumulative end rows** ``offs[i] = sum_{j<=i}
  counts[j]`` multiplies rows ``[offs[i-1], offs[i])`` by ``w[i]`` (an expert with zero rows repeats the
  previous offset and gets a zero gradient); rows past ``offs[-1]`` are left uninitialised, so ``offs[-1]``
  must be ``R``. Measured on torch 2.13 CPU: it takes fp32 / bf16 / fp16 only, needs strides that are a
  multiple of 16 bytes (``h`` and ``f`` multiples of 4 in fp32, of 8 in bf16), and its backward fails on a
  stride-0 incoming gradient (``y.sum().backward()``): :func:`contiguous_grad` makes it contiguous. With
  AVX-512 kernels one expert's result can depend, in the last bit, on the other experts in the same call
  (an expert-parallel rank's 2-expert call against one device's 8-expert call). Where
  ``_grouped_mm`` does not apply (fp64, odd widths) :class:`GroupedExperts` runs its own per-expert loop,
  :meth:`GroupedExperts.forward_loop`, which is also the reference the tests compare it with.
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

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
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
    ``forward(x, counts)``: one ``_grouped_mm`` per projection; :meth:`forward_loop`: the same maths expert
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
        """The given :class:`ExpertMLP` s (experts ``first, first+1, ...``) stacked:
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

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` runs ``_grouped_mm`` for ``x``: a dtype it takes and 16-byte strides."""
        size = x.element_size()
        return (x.dtype in _GROUPED_MM_DTYPES and self.w1.dtype == x.dtype
                and (self.dim * size) % 16 == 0 and (self.hidden * size) % 16 == 0)

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        _check_counts(x, counts, self.num_local)
        if not self.uses_grouped_mm(x):
            return self.forward_loop(x, counts)
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        x = x.contiguous()

        def mm(a, w):
            return contiguous_grad(torch._grouped_mm(a, w, offs=offs))

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
                h = F.silu(rows @ self.w1[e]) * (rows @ self.w3[e])
            else:
                h = F.gelu(rows @ self.w1[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs)

    def extra_repr(self) -> str:
        last = self.first + self.num_local
        return (f"dim={self.dim}, hidden={self.hidden}, experts [{self.first}, {last}) of "
                f"{self.num_experts}, activation={self.activation}")


__all__ = ["ACTIVATIONS", "ExpertMLP", "GroupedExperts", "LoopedExperts", "contiguous_grad"]
