"""fp8 on the wire: ZeRO-3's weight all-gather in fp8, and why gradient reductions stay wider (chapter 10).

**fp8 all-gather** (torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` under FSDP2;
Rajbhandari et al. 2020 for ZeRO-3's gather, chapter 04). A tensorwise fp8 GEMM casts the *whole* weight
with one scale, so the cast can move before the gather: every rank casts its shard with the **same** scale
and the gather moves one byte per element instead of bf16's two::

    amax  = all_reduce_MAX(max |W[r]|)                 one fp32 scalar: the whole tensor's amax
    scale = fmax / max(amax, eps)                       the same on every rank
    W8[r] = saturate(W[r] * scale) in e4m3              each rank its own rows
    W8    = all_gather(W8[r])                           1 byte per element
    y     = scaled_mm(x8, W8^T, 1/sx, 1/scale)          the gathered bytes and the scale feed the GEMM

The bytes are exactly those of casting the unsharded ``W`` with its own amax (max over the shards' amaxes
is the amax), so nothing changes numerically (tests/ranks/test_fp8_communication.py checks it bitwise). gloo
refuses float8 dtypes in collectives (torch 2.13: "Invalid scalar type"), so the bytes travel as a
**uint8 view** of the fp8 tensor and are viewed back after the gather; NCCL would take them either way.
The shards follow ZeRO's cut (``refimpl.distributed.placement.chunk_range``: ``ceil(rows / N)`` rows
per rank, the last ones shorter or empty), padded to the chunk for the collective. The trainer's ZeRO-3
makes the same cast inside its units, all of a unit's parameters in one collective of bytes
(``refimpl.parallel.zero.fsdp_float8``, ``--precision fp8 --zero-stage 3``). Only tensorwise scaling
can do this: a rowwise weight scale (per row of ``W``, along ``K``) would work too, but torchao supports
only tensorwise, and a per-column scale would need the whole tensor.

**Gradients stay in bf16/fp32** (``gradient_all_reduce_errors``). A reduction adds N contributions:
casting each to fp8 before the sum costs 2^-4 (e4m3) or 2^-3 (e5m2) relative per element, against
bf16's 2^-9, and one scale shared by the group flushes the gradient's small entries to zero (gradients
span many decades). The function measures it against a float64 sum of the same gradients, as a lower
bound for fp8: each contribution is rounded once and the sum is fp32 (a ring that re-casts its partial
sums at every hop only adds error). Every collective goes through ``refimpl.comm.ops`` (the tracer
sees it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size
from refimpl.distributed.placement import chunk_range
from refimpl.precision.fp8.formats import E4M3, E5M2, Float8Format, format_of, quantize
from refimpl.precision.fp8.scaling import Float8Tensor, amax_to_scale, operand_amax

__all__ = ["GatherBytes", "GradientReductionErrors", "agreed_amax", "all_gather_float8",
           "float8_all_gather_bytes", "float8_tensor", "gradient_all_reduce_errors"]


def agreed_amax(shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``max |W|`` over the whole tensor: each rank's shard amax (0 for an empty shard), all-reduced with
    MAX over ``group``. A 0-d fp32 tensor, the same on every rank."""
    amax = operand_amax(shard, scaling="tensorwise", contraction_dim=0).to(torch.float32)  # 0 when empty
    if group_rank_size(group)[1] > 1:
        ops.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _gather_bytes(local: torch.Tensor, group: dist.ProcessGroup | None, rows: int,
                  row_numel: int) -> torch.Tensor:
    """All-gather this rank's rows (a uint8 or any-dtype ``[rows_r * row_numel]``), padded to the chunk,
    into ``[rows * row_numel]`` in rank order."""
    rank, n = group_rank_size(group)
    chunk = -(-rows // n) * row_numel
    packed = local.new_zeros(chunk)
    packed[: local.numel()] = local
    gathered = local.new_empty(n * chunk)
    if n > 1:
        ops.all_gather_into_tensor(gathered, packed, group=group)
    else:
        gathered.copy_(packed)
    pieces = [gathered[r * chunk: r * chunk + (e - s) * row_numel] for r, (s, e) in
              ((r, chunk_range(rows, r, n)) for r in range(n))]
    return torch.cat(pieces)


@torch.no_grad()
def all_gather_float8(shard: torch.Tensor, group: dist.ProcessGroup | None, *, rows: int | None = None,
                      fmt: Float8Format | torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """ZeRO-3's all-gather of a weight in fp8 (module docstring): ``(W8, scale)``, the full fp8 tensor
    ``[rows, ...]`` and its fp32 scale (``W ~= W8 / scale``; ``1 / scale`` is ``_scaled_mm``'s ``scale_b``).

    ``shard`` is this rank's rows ``chunk_range(rows, rank, N)`` of the weight; ``rows`` the full tensor's
    (default: ``shard.shape[0] * N``, an even cut). Collective: one MAX all-reduce of an fp32 scalar and
    one all-gather of ``N * ceil(rows / N) * row_numel`` bytes."""
    f = format_of(fmt)
    rank, n = group_rank_size(group)
    rows = shard.shape[0] * n if rows is None else rows
    start, end = chunk_range(rows, rank, n)
    if shard.shape[0] != end - start:
        raise ValueError(f"rank {rank}'s shard has {shard.shape[0]} rows; rows {start}:{end} of {rows} "
                         "expected (ZeRO's ceil cut)")
    row_numel = shard.shape[1:].numel()  # an empty shard [0, ...] still has its rows' shape
    scale = amax_to_scale(agreed_amax(shard, group), f)
    local = quantize(shard, scale, f).reshape(-1).view(torch.uint8)  # gloo takes uint8, not float8
    full = _gather_bytes(local, group, rows, row_numel).view(f.dtype)
    return full.view(rows, *shard.shape[1:]), scale


def float8_tensor(gathered: tuple[torch.Tensor, torch.Tensor]) -> Float8Tensor:
    """The ``(W8, scale)`` of ``all_gather_float8`` as the ``Float8Tensor`` that
    ``refimpl.precision.fp8.float8_linear.Float8Linear`` takes as ``weight_fp8``."""
    return Float8Tensor(*gathered)


@dataclass(frozen=True)
class GatherBytes:
    """Bytes of one all-gather of a ``[rows, ...]`` weight over ``world_size`` ranks: ``payload`` (the
    gathered buffer, ``N * ceil(rows / N) * row_numel * itemsize``: what the tracer books as ``nbytes``),
    ``sent_per_rank`` (the ring model's ``(N - 1) / N * payload``) and ``amax`` (the fp8 gather's one fp32
    all-reduce payload, 0 for a bf16 gather)."""

    payload: int
    sent_per_rank: float
    amax: int


def float8_all_gather_bytes(shape: tuple[int, ...] | torch.Size, world_size: int, *,
                            dtype: torch.dtype = torch.float8_e4m3fn) -> GatherBytes:
    """The bytes of ``all_gather_float8`` (``dtype`` fp8), or of a plain gather in ``dtype``."""
    rows, row_numel = shape[0], int(torch.Size(shape[1:]).numel())
    payload = world_size * -(-rows // world_size) * row_numel * torch.empty((), dtype=dtype).element_size()
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return GatherBytes(payload=payload, sent_per_rank=(world_size - 1) / world_size * payload,
                       amax=4 if fp8 and world_size > 1 else 0)


@dataclass(frozen=True)
class GradientReductionErrors:
    """Relative errors ``||sum - sum64|| / ||sum64||`` of one gradient all-reduce in each dtype (the
    fp8 one a lower bound, module docstring), and the fraction of nonzero gradient entries the fp8 cast
    flushed to zero (this rank's contribution)."""

    fp32: float
    bf16: float
    fp8: float
    fp8_flushed: float


@torch.no_grad()
def gradient_all_reduce_errors(grad: torch.Tensor, group: dist.ProcessGroup | None, *,
                               fmt: Float8Format | torch.dtype = E5M2) -> GradientReductionErrors:
    """The error of summing every rank's ``grad`` (fp32, the same shape everywhere) over ``group`` in fp32,
    in bf16 and with fp8 contributions (one agreed tensorwise scale), against the float64 sum. Collective."""
    f = format_of(fmt)
    _, n = group_rank_size(group)
    flat = grad.detach().reshape(-1).to(torch.float32)
    every = _gather_bytes(flat, group, n, flat.numel()).view(n, -1)       # every rank's gradient, fp32
    exact = every.double().sum(0)

    def rel(total: torch.Tensor) -> float:
        return float((total.double() - exact).norm() / exact.norm().clamp(min=1e-300))

    fp32, bf16 = flat.clone(), flat.to(torch.bfloat16)
    if n > 1:
        ops.all_reduce(fp32, group=group)
        ops.all_reduce(bf16, group=group)
    scale = amax_to_scale(agreed_amax(flat, group), f)
    mine = quantize(flat, scale, f)
    got = _gather_bytes(mine.view(torch.uint8), group, n, flat.numel()).view(f.dtype).view(n, -1)
    fp8 = (got.to(torch.float32) * scale.reciprocal()).sum(0)               # each contribution rounded once
    flushed = float(((mine.to(torch.float32) == 0) & (flat != 0)).sum() / (flat != 0).sum().clamp(min=1))
    return GradientReductionErrors(fp32=rel(fp32), bf16=rel(bf16), fp8=rel(fp8), fp8_flushed=flushed)
