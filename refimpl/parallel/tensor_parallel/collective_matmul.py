"""Collective matmul: the sequence-parallel all-gather and reduce-scatter decomposed into a ring that hides
each transfer behind a matmul (chapter 06; Megatron's ``--tp-comm-overlap``, torchtitan's async TP).

Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models" (ASPLOS '23; the "collective matmul" of Google's "How to Scale Your Model"). Under sequence
parallelism (Korthikanti et al. 2022) the column-parallel linear waits for an all-gather of the sequence
before its first multiply, and the row-parallel linear's reduce-scatter waits for its last: the collective
sits on the critical path. But the product splits by sequence chunk, so the ``t`` ranks of the
tensor-parallel group can stand in a ring (send to ``r + 1``, receive from ``r - 1``, mod ``t``; one
``batch_isend_irecv`` per step, ``refimpl.parallel.context_parallel.context_parallel_communications.
ring_exchange``, the step ring attention uses) and multiply the chunk they hold while the next one travels.
Rank ``r`` of ``t``, ``X_c`` the ``c``-th ``[b, s/t, .]`` chunk of the sequence (dim 1):

* ``all_gather_matmul`` (column parallel, ``A_r: [out/t, in]``): ``Y_r = [X_0; ...; X_{t-1}] A_r^T + b_r``.
  At step ``i = 0 .. t-1`` rank ``r`` holds chunk ``c = (r - i) mod t`` (its own at step 0), posts it to
  ``r + 1`` and the receive of chunk ``r - i - 1`` from ``r - 1`` (not at the last step), computes
  ``Y_r[:, c] = X_c A_r^T + b_r``, then waits: each transfer hides behind the matmul of the chunk already
  there, and only the last matmul has no transfer beside it; ``t - 1`` transfers of ``s/t`` tokens, the
  all-gather's bytes.
* ``matmul_reduce_scatter`` (row parallel, ``B_r: [out, in/t]``, input ``X: [b, s, in/t]``):
  ``Z_r = sum_q X^(q)[:, r] B_q^T`` (``X^(q)`` rank ``q``'s input). A partial sum travels round the ring
  and ends at its destination: at step ``i`` rank ``r`` computes its term for destination
  ``d = (r - 1 - i) mod t``, ``P = X[:, d] B_r^T``, while the running sum for ``d`` (begun at rank
  ``d + 1``) travels to it from ``r - 1``; then ``acc = received + P`` goes on to ``r + 1``. After the last
  step (``d = r``) ``acc`` is ``Z_r``, summed in the order ``((P_{r+1} + P_{r+2}) + ...) + P_r``. Only the
  first term (step 0) has no transfer beside it. So of each ring's ``t`` matmuls ``t - 1`` hide a
  transfer: at ``t = 2`` one of two, the most a 2-rank ring can overlap.

For ``t = 4`` the chunks rank ``r`` multiplies at step ``i``: all-gather ``(r - i) mod 4``, reduce-scatter
``(r - 1 - i) mod 4``::

    step         0  1  2  3          0  1  2  3
    rank 0       0  3  2  1          3  2  1  0
    rank 1       1  0  3  2          0  3  2  1
    rank 2       2  1  0  3          1  0  3  2
    rank 3       3  2  1  0          2  1  0  3

Backward, each is the other (the adjoint of an all-gather is a reduce-scatter): for ``all_gather_matmul``
``dX_r = sum_q dY_q[:, r] A_q`` is a matmul-reduce-scatter ring over ``dY_r[:, d] A_r``, and
``dA_r = sum_c dY_r[:, c]^T X_c`` accumulates along an all-gather ring of the saved ``X_r`` (only the
``s/t`` chunk is saved, as ``.sequence_parallel_linear`` does; the ring gathers it again), ``db_r`` the sum of
``dY_r``; for ``matmul_reduce_scatter`` one all-gather ring of ``dZ`` gives ``dX[:, c] = dZ_c B_r`` and
``dB_r = sum_c dZ_c^T X[:, c]``. The first ring of each backward computes ``dX`` (the layer below waits for
it).

Numerics: the all-gather side's forward multiplies the same rows as one matmul over ``[b, s, in]`` (bitwise on
the CPU kernels measured by tests/ranks/test_collective_matmul.py), but its ``dA`` sums the tokens chunk by
chunk, and the reduce-scatter adds the ``t`` partial sums in ring order, not in the collective's: another
order of the same sum, within ``2 gamma_n sum |terms|`` of it (``gamma_n = n u / (1 - n u)``, Higham's bound
for a sum of ``n`` terms, ``u`` the unit roundoff), not bitwise. ``serialized=True`` is the timing control:
the same code, each transfer waited for as soon as it is posted (bitwise the same results, no overlap).

On GPUs PyTorch's ``torch.distributed._symmetric_memory`` fuses these (``fused_all_gather_matmul``,
``fused_matmul_reduce_scatter``, torchtitan's async TP) with copy engines over NVLink; here the ring is
plain point-to-point, which is what the lesson needs and what runs on gloo. Under autocast the input and
weight are cast to the autocast dtype first (the casts' own backward casts the gradients back).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from refimpl.parallel.context_parallel.context_parallel_communications import ring_exchange
from refimpl.parallel.tensor_parallel.tp_communications import SEQUENCE_DIM, Group, group_rank, group_size

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "ring_all_gather", "ring_reduce_scatter"]


def ring_all_gather(shard: torch.Tensor, compute: Callable[[int, torch.Tensor], torch.Tensor], *,
                    group: Group, serialized: bool = False) -> list[torch.Tensor]:
    """``[compute(c, X_c) for c in range(t)]``, ``X_c`` rank ``c``'s ``shard``: at step ``i`` this rank
    computes with chunk ``(r - i) mod t`` while it passes that chunk on to ``r + 1`` and receives the next
    from ``r - 1`` (module docstring). ``serialized``: each transfer waited for before the compute."""
    r, t = group_rank(group), group_size(group)
    out: list[torch.Tensor | None] = [None] * t
    chunk = shard
    for i in range(t):
        transfer = ring_exchange([chunk], group=group, step=i) if i < t - 1 else None
        if serialized and transfer is not None:
            transfer.wait()
        out[(r - i) % t] = compute((r - i) % t, chunk)
        if transfer is not None:
            (chunk,) = transfer.wait()
    return [y for y in out if y is not None]


def ring_reduce_scatter(partial: Callable[[int], torch.Tensor], *, group: Group,
                        serialized: bool = False) -> torch.Tensor:
    """``sum_q partial_q(r)``, ``partial_q`` rank ``q``'s: at step ``i`` this rank computes its term for
    destination ``d = (r - 1 - i) mod t`` while the running sum for ``d`` arrives from ``r - 1``, adds it
    and passes it on (module docstring). ``serialized``: each transfer waited for before the compute."""
    r, t = group_rank(group), group_size(group)
    acc = partial((r - 1) % t)
    for i in range(1, t):
        transfer = ring_exchange([acc], group=group, step=i)
        if serialized:
            transfer.wait()
        mine = partial((r - 1 - i) % t)
        (received,) = transfer.wait()
        acc = received + mine
    return acc


def _chunks(x: torch.Tensor, t: int, what: str) -> list[torch.Tensor]:
    """``x`` cut into ``t`` equal chunks of the sequence (dim 1); a length that does not divide is refused."""
    if x.dim() < 3 or x.shape[SEQUENCE_DIM] % t:
        raise ValueError(f"{what}: needs [batch, seq, ...] with seq divisible by tp {t}, got "
                         f"{tuple(x.shape)}")
    return list(x.chunk(t, dim=SEQUENCE_DIM))


def _accumulator(weight: torch.Tensor) -> torch.Tensor:
    """Zeros of ``weight``'s shape for ``dW``'s chunk-by-chunk sum, in float32 at least (16-bit weights
    under autocast: one rounding at the end, as one matmul's, not one per chunk)."""
    return torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                       device=weight.device)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # [b, s/t, f] -> [b s/t, f]


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod  # autograd.Function.apply passes the inputs positionally
    def forward(ctx, x_shard, weight, bias, group, serialized):  # noqa: PLR0917
        ctx.save_for_backward(x_shard, weight)                        # x_shard: [b, s/t, in] only
        ctx.group, ctx.serialized, ctx.has_bias = group, serialized, bias is not None
        ys = ring_all_gather(x_shard, lambda c, xc: F.linear(xc, weight, bias), group=group,
                             serialized=serialized)                   # t x [b, s/t, out/t]
        return torch.cat(ys, dim=SEQUENCE_DIM)                        # [b, s, out/t]

    @staticmethod
    def backward(ctx, dy):                                            # dy: [b, s, out/t]
        x_shard, weight = ctx.saved_tensors
        group, serialized = ctx.group, ctx.serialized
        dys = _chunks(dy, group_size(group), "all_gather_matmul")     # t x [b, s/t, out/t]
        dx = ring_reduce_scatter(lambda d: dys[d].matmul(weight), group=group,
                                 serialized=serialized)               # [b, s/t, in]
        dw = _accumulator(weight)                                     # [out/t, in]

        def weight_grad(c: int, xc: torch.Tensor) -> torch.Tensor:
            dw.add_(_tokens(dys[c]).t().matmul(_tokens(xc)))         # [out/t, tokens] @ [tokens, in]
            return xc

        ring_all_gather(x_shard, weight_grad, group=group, serialized=serialized)
        db = _tokens(dy).sum(0) if ctx.has_bias else None             # [out/t]
        return dx, dw.to(weight.dtype), db, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod  # autograd.Function.apply passes the inputs positionally
    def forward(ctx, x, weight, group, serialized):
        ctx.save_for_backward(x, weight)                              # x: [b, s, in/t]
        ctx.group, ctx.serialized = group, serialized
        xs = _chunks(x, group_size(group), "matmul_reduce_scatter")   # t x [b, s/t, in/t]
        return ring_reduce_scatter(lambda d: F.linear(xs[d], weight), group=group,
                                   serialized=serialized)             # [b, s/t, out]

    @staticmethod
    def backward(ctx, dz):                                            # dz: [b, s/t, out]
        x, weight = ctx.saved_tensors
        xs = _chunks(x, group_size(ctx.group), "matmul_reduce_scatter")
        dw = _accumulator(weight)                                     # [out, in/t]

        def grads(c: int, dzc: torch.Tensor) -> torch.Tensor:
            dw.add_(_tokens(dzc).t().matmul(_tokens(xs[c])))          # [out, tokens] @ [tokens, in/t]
            return dzc.matmul(weight)                                 # [b, s/t, out] @ [out, in/t]

        dxs = ring_all_gather(dz.contiguous(), grads, group=ctx.group, serialized=ctx.serialized)
        return torch.cat(dxs, dim=SEQUENCE_DIM), dw.to(weight.dtype), None, None  # [b, s, in/t]


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype if autocast is on for ``x``'s device (the forward matmuls run in it), else None."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      group: Group, serialized: bool = False) -> torch.Tensor:
    """``all_gather_seq(x_shard) @ weight.T + bias`` as a ring (module docstring): ``[b, s/t, in]`` ->
    ``[b, s, out/t]`` for ``weight: [out/t, in]``; saves only ``x_shard``. A group of one is ``F.linear``."""
    t = group_size(group)
    if t == 1:
        return F.linear(x_shard, weight, bias)
    _chunks(x_shard, 1, "all_gather_matmul")  # [batch, seq/t, in]
    if (dtype := _autocast_dtype(x_shard)) is not None:
        x_shard, weight = x_shard.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return _AllGatherMatmul.apply(x_shard, weight, bias, group, serialized)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, *, group: Group,
                          serialized: bool = False) -> torch.Tensor:
    """``reduce_scatter_seq(x @ weight.T)`` as a ring (module docstring): ``[b, s, in/t]`` ->
    ``[b, s/t, out]`` for ``weight: [out, in/t]`` (the bias, whole, is the caller's to add after). A group
    of one is ``F.linear``."""
    t = group_size(group)
    if t == 1:
        return F.linear(x, weight)
    _chunks(x, t, "matmul_reduce_scatter")
    if (dtype := _autocast_dtype(x)) is not None:
        x, weight = x.to(dtype), weight.to(dtype)
    return _MatmulReduceScatter.apply(x, weight, group, serialized)
