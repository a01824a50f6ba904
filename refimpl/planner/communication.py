"""Bytes the collectives of a training step move, as formulas a chapter checks against the tracer
(chapters 02, 04, 06 and 07).

* The bandwidth-optimal ring (Patarasuk & Yuan, JPDC 2009; Thakur, Rabenseifner & Gropp, IJHPCA 2005): a
  rank of ``n`` sends ``(n - 1)/n S`` in a reduce-scatter or an all-gather of ``S`` bytes and twice that
  in an all-reduce. ``ring_bytes_sent`` is that count made exact for uneven chunks (what
  ``refimpl.comm.ring`` sends, measured byte by byte by ``refimpl.comm.CommTracer``);
  ``wire_bytes`` is the same model for one op on a payload. The tracer books it for every
  ``torch.distributed`` collective, so its home is the runtime (``refimpl.comm.tracer``, below the
  planner in the import direction) and the planner re-exports it rather than repeat it.
* ZeRO (Rajbhandari et al. 2020): which collectives a step issues, how many and with which payload (the
  bytes of the tensors handed to each op, what ``refimpl.comm.tracer.CommTracer`` records as
  ``CommEvent.nbytes``) is ``zero_collectives``: that is what a chapter checks against the tracer.
  Traffic on the wire is the ring *model* applied to those payloads (``wire_bytes``),
  ``zero_comm_bytes``, per step and rank, in elements: data parallelism all-reduces the gradients,
  2 (N-1)/N Psi; stages 1 and 2 reduce-scatter the gradients and all-gather the updated parameters,
  (N-1)/N Psi each, the same 2 (N-1)/N Psi; stage 3 also all-gathers every unit for its forward and again
  for its backward, 3 (N-1)/N Psi, 1.5x data parallelism (the root unit, needed again at once by the
  backward, is not freed after forward, as in FSDP2). Padding and the shard rule are
  ``refimpl.planner.zero_state``'s (``refimpl.planner.zero_state.padded_numel``).
* Tensor parallelism (Shoeybi et al. 2019; sequence parallelism, Korthikanti et al. 2022; chapter 06):
  ``tensor_parallel_collectives``, the collectives of one forward and backward of our TP GPT. Per
  block two all-reduces of ``b s h`` forward (after each row layer, ``g``) and two backward (before each
  column layer, ``f``), each ``2 (t-1)/t b s h`` elements on the wire in the ring model; with SP each
  becomes an all-gather and a reduce-scatter of the same full tensor, ``(t-1)/t b s h`` each: the same
  bytes, plus one more all-gather per column layer in backward (its input, saved as the ``s/t`` shard,
  gathered again). The vocab-parallel embedding's all-reduce becomes a reduce-scatter into the sequence
  shard (Megatron-Core's ``reduce_scatter_embeddings``): its forward traffic halves, ``(t-1)/t b s h``
  instead of ``2 (t-1)/t b s h``, and its backward is the conjugate all-gather. The payloads (``nbytes``)
  are what the layers hand to each call, exact; the bytes on the wire are the ring *model* of them: NCCL
  picks ring, tree or, on NVSwitch boxes such as HGX H100, NVLS (in-switch reduction) by size and topology,
  and those send other amounts.
* Context parallelism (chapter 07): ``context_parallel_bytes``, what one rank sends for one layer's
  attention. Ring attention (Liu et al. 2023) posts ``cp - 1`` exchanges of its K/V block forward, with
  ``x = b (a/t) (s/cp) d`` elements per tensor: ``2 (cp-1) p x`` bytes, ``(cp-1)/cp`` of the whole
  sequence's K and V, whatever ``cp``; backward sends the K/V blocks round again and the partial dK/dV
  behind them (float32, the ring's block dtype, also under autocast): ``2 (cp-1) (p + 4) x``.
  Point-to-point bytes are exact (the tracer measures each ``isend``). DeepSpeed-Ulysses (Jacobs et al.
  2023) makes four all-to-alls of the local ``[b, a/t, s/cp, d]`` tensor forward (q, k, v to head shards,
  the output back) and four backward (dO in; dQ, dK, dV back), each sending ``(cp-1)/cp`` of it, ``4
  (cp-1)/cp p x`` per direction: for a fixed sequence it falls as ``1/cp``, the ring's stays. The all-to-all
  figure is the ring model's (``wire_bytes``), exact for an equal split: a rank keeps the one of its
  ``cp`` equal blocks addressed to itself and sends each other rank one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from refimpl.comm.ring import chunk_sizes
from refimpl.comm.tracer import wire_bytes
from refimpl.config import ModelConfig
from refimpl.planner.activations import METHODS, check_tp, local_tokens
from refimpl.planner.zero_state import Shape, check_zero_stage, padded_numel

__all__ = ["context_parallel_bytes", "ring_bytes_sent", "shared_qkv_elements", "tensor_parallel_collectives",
           "tp_stage_collectives", "wire_bytes", "zero_collectives", "zero_comm_bytes"]


def ring_bytes_sent(numel: int, n: int, rank: int, element_size: int, *, op: str = "all_reduce") -> int:
    """Exact bytes rank ``rank`` sends in a ring ``op`` on a tensor of ``numel`` elements, uneven chunks too.

    Reduce-scatter sends every chunk but chunk ``rank``, all-gather every chunk but chunk ``rank + 1``;
    all-reduce does both. Equals ``(n - 1)/n S`` (resp. ``2(n - 1)/n S``) bytes when ``n`` divides ``numel``.
    """
    if n == 1:
        return 0
    c = chunk_sizes(numel, n)
    rs = numel - c[rank]
    ag = numel - c[(rank + 1) % n]
    per_op = {"reduce_scatter": rs, "all_gather": ag, "all_reduce": rs + ag}
    if op not in per_op:
        raise ValueError(f"op must be one of {sorted(per_op)}, got {op!r}")
    return per_op[op] * element_size


def zero_collectives(
    unit_shapes: Sequence[Sequence[Shape]], world_size: int, zero_stage: int, *,
    trainable: Sequence[Sequence[bool]] | None = None, bytes_per_element: int = 4, root_unit: int | None = 0,
    replicas: int = 1,
) -> dict[str, tuple[int, int]]:
    """The collectives one rank issues in one optimizer step at ZeRO ``zero_stage``: ``{op: (count,
    payload)}``; under HSDP (``replicas`` R > 1, ZeRO-3 only) ``world_size`` is the shard group's S and each
    unit's reduced gradient shard (``1/S`` of its padded gradients) is all-reduced over the R replicas once
    more: ``"all_reduce": (trained units, grads / S)``.

    The payload is the bytes of the tensor handed to the op (the input of an all-reduce and of a
    reduce-scatter, the output of an all-gather: the full, padded tensor). One micro-batch per step, every
    stage-1/2 bucket large enough for all the gradients (one reduce-scatter, one all-gather), stage 3 with
    one all-gather per unit for forward, one more for backward except ``root_unit`` (kept after forward),
    and one reduce-scatter per unit that has a trainable parameter. ``{}`` on one rank (no collective).
    """
    check_zero_stage(zero_stage, world_size)
    if replicas > 1 and zero_stage != 3:
        raise ValueError(f"HSDP (replicas {replicas}) is ZeRO-3's; got zero_stage {zero_stage}")
    n, b = world_size, bytes_per_element
    if trainable is None:
        trainable = [[True] * len(shapes) for shapes in unit_shapes]
    trained = [[s for s, t in zip(shapes, flags, strict=True) if t]
               for shapes, flags in zip(unit_shapes, trainable, strict=True)]
    if n == 1:  # no shard group: with replicas, plain data parallelism of each unit's gradients
        grads = b * sum(math.prod(s) for shapes in trained for s in shapes)
        return {"all_reduce": (sum(1 for t in trained if t), grads)} if replicas > 1 else {}
    if zero_stage == 0:
        return {"all_reduce": (1, b * sum(math.prod(s) for shapes in trained for s in shapes))}
    grads = b * sum(padded_numel(shapes, n) for shapes in trained)
    if zero_stage in (1, 2):
        return {"reduce_scatter": (1, grads), "all_gather": (1, grads)}
    units = [u for u, shapes in enumerate(unit_shapes) if shapes]
    again = [u for u in units if u != root_unit]
    gathered = b * sum((1 if u == root_unit else 2) * padded_numel(unit_shapes[u], n) for u in units)
    reduced = sum(1 for t in trained if t)
    out = {"all_gather": (len(units) + len(again), gathered), "reduce_scatter": (reduced, grads)}
    if replicas > 1:  # HSDP: the shards' mean over the replicas (FSDP2's all-reduce after the reduce-scatter)
        out["all_reduce"] = (reduced, grads // n)
    return out


def zero_comm_bytes(
    unit_shapes: Sequence[Sequence[Shape]], world_size: int, zero_stage: int, *,
    trainable: Sequence[Sequence[bool]] | None = None, bytes_per_element: int = 4, root_unit: int | None = 0,
) -> float:
    """Wire bytes one rank sends in one optimizer step at ZeRO ``zero_stage``: the ring *model* applied to the
    payloads of ``zero_collectives`` (all-reduce ``2 (N-1)/N``, the others ``(N-1)/N`` of the payload).

    ``unit_shapes[u]`` lists the parameter shapes of unit ``u`` and ``trainable[u]`` which of them get a
    gradient (default: all); stages 0-2 only use the trainable total. Stage 0 all-reduces the unpadded
    gradients; stages 1-3 move padded tensors (``padded_numel``): stages 1-2 reduce-scatter the
    gradients and all-gather the stepped parameters; stage 3 all-gathers every unit (all its parameters,
    frozen ones too) for forward, again for backward except ``root_unit`` (kept after forward, as FSDP2
    does; None: re-gather every unit), and reduce-scatters the trainable ones.
    """
    ops = zero_collectives(unit_shapes, world_size, zero_stage, trainable=trainable,
                           bytes_per_element=bytes_per_element, root_unit=root_unit)
    return sum(wire_bytes(op, payload, world_size) for op, (_, payload) in ops.items())


def tensor_parallel_collectives(*, num_layers: int, hidden_size: int, micro_batch: int, seq_len: int, tp: int,
                                sequence_parallel: bool = False, bytes_per_element: int = 4,
                                config: ModelConfig | None = None) -> dict[str, tuple[int, int]]:
    """The collectives one rank of ``refimpl.parallel.tensor_parallel.apply_tensor_parallel``'s GPT
    issues in one forward + backward of a micro-batch ``[b, s]``, float32: ``{op: (count, payload)}``
    (module docstring; ``{}`` at ``tp = 1``): ``tp_stage_collectives`` of the whole model (embedding, ``L``
    blocks, head and the vocab-parallel loss's three all-reduces of ``b s``) and, with SP, after backward
    one all-reduce of ``h`` per replicated parameter that saw ``s/t`` tokens (each block's two norms'
    weights and biases and two row biases, the final norm's). The payload is the full tensor (the tracer's
    ``nbytes``); ``wire_bytes`` gives the ring model's bytes sent. ``config`` (None: GPT-2's form) gives the
    block's form: RMSNorm has one parameter to sum, no biases no row biases (the Llama form: ``2 L + 1``
    sums of ``h``); with fewer key/value heads ``g`` than ``t`` each block also all-gathers its qkv output,
    ``b s (a + 2 g) d``, and reduce-scatters its gradient (``refimpl.models.gpt_sharding.SharedKeyValueQKV``).
    """
    if tp == 1:
        return {}
    tokens = micro_batch * seq_len
    shared = 0 if config is None else shared_qkv_elements(config, tp=tp, tokens=tokens)
    out = tp_stage_collectives(layers=num_layers, first=True, last=True, x=tokens * hidden_size,
                               tokens=tokens, sequence_parallel=sequence_parallel, shared_qkv=shared,
                               bytes_per_element=bytes_per_element)
    if not sequence_parallel:
        return out
    per_norm = 1 if config is not None and config.normalization == "rmsnorm" else 2
    biases = 0 if config is not None and not config.add_bias else 2
    n = (2 * per_norm + biases) * num_layers + per_norm  # the s/t-token parameters, summed after backward
    return _summed(out, {"all_reduce": (n, bytes_per_element * n * hidden_size)})


def shared_qkv_elements(config: ModelConfig, *, tp: int, tokens: int) -> int:
    """Elements of one block's qkv output that ``refimpl.models.gpt_sharding.SharedKeyValueQKV``
    all-gathers (and reduce-scatters back) when ``t/g`` ranks share each key/value head, ``tokens (a + 2g)
    d``; 0 when each rank holds whole query groups."""
    if config.query_groups >= tp:
        return 0
    return tokens * (config.num_attention_heads + 2 * config.query_groups) * config.head_dim


def tp_stage_collectives(*, layers: int, first: bool, last: bool, x: int, tokens: int,
                         sequence_parallel: bool, shared_qkv: int = 0,
                         bytes_per_element: int = 4) -> dict[str, tuple[int, int]]:
    """One micro-batch's tensor-parallel collectives ``{op: (count, payload)}`` of a pipeline stage holding
    ``layers`` blocks, ``first`` / ``last``: with the embedding / the head and the loss (both: the whole
    model, ``tensor_parallel_collectives`` without the SP gradients' sums); ``x = b s h``, ``tokens = b s``,
    ``shared_qkv``: a block's qkv elements gathered when fewer key/value heads than ranks share them.
    Without SP ``4 L + f + l`` all-reduces of ``x`` and the loss's three of ``b s``; with SP all-gathers
    ``(6 L + f + 2 l) x`` and reduce-scatters ``(4 L + f + l) x`` (the ``f``/``g`` pairs, the embedding's
    reduce-scatter, the column layers' inputs gathered again in backward)."""
    L, f, la, e = layers, int(first), int(last), bytes_per_element  # noqa: N806 (the paper's L)
    qkv = (L, e * L * shared_qkv)
    shared = {"all_gather": qkv, "reduce_scatter": qkv} if shared_qkv else {}
    if not sequence_parallel:
        n = 4 * L + f + la
        return _summed({"all_reduce": (n + 3 * la, e * (n * x + 3 * la * tokens))}, shared)
    gathers, scatters = 6 * L + f + 2 * la, 4 * L + f + la
    return _summed({"all_reduce": (3 * la, e * 3 * la * tokens), "all_gather": (gathers, e * gathers * x),
                    "reduce_scatter": (scatters, e * scatters * x)}, shared)


def _summed(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``{op: (count, payload)}`` of both, counts and payloads added."""
    out = {}
    for op in {**a, **b}:
        (count_a, payload_a), (count_b, payload_b) = a.get(op, (0, 0)), b.get(op, (0, 0))
        out[op] = (count_a + count_b, payload_a + payload_b)
    return out


def context_parallel_bytes(config: ModelConfig, *, micro_batch: int, seq_len: int, cp: int, method: str,
                           tp: int = 1, compute_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes ONE rank sends for ONE layer's attention under context parallelism, ``{"forward": ...,
    "backward": ...}`` (chapter 07; see the module docstring).

    ``seq_len`` is the whole sequence (each rank holds ``s/cp`` tokens), ``tp`` the tensor-parallel degree
    (attention runs on ``a/t`` heads), ``compute_dtype`` the dtype of q, k, v (``p`` bytes). With
    ``x = b (a/t) (s/cp) d`` one rank's q and ``x_kv = b (g/t) (s/cp) d`` its k or v (``g`` key/value heads;
    ``g = a`` without grouped-query attention): ``method`` ``"ring"``: forward ``2 (cp-1) p x_kv``, backward
    ``2 (cp-1) (p + 4) x_kv`` (dK/dV travel in float32, the ring's block dtype; K/V at their own heads).
    ``"ulysses"``: ``(cp-1)/cp p (2 x + 2 x_kv)`` each way (q and the output at ``a`` heads, k and v at
    ``g``). Zero when ``cp = 1``. The sizes must split: the ring's ``2 cp`` zig-zag chunks, Ulysses' ``cp``
    parts and heads.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_tp(config, tp)
    s = local_tokens(config, seq_len=seq_len, cp=cp, cp_method=method, cp_layout=None, tp=tp)
    if cp == 1:
        return {"forward": 0, "backward": 0}
    p = compute_dtype.itemsize
    x = micro_batch * (config.num_attention_heads // tp) * s * config.head_dim  # one rank's q
    x_kv = micro_batch * (config.query_groups // tp) * s * config.head_dim  # its k or v
    if method == "ring":
        return {"forward": 2 * (cp - 1) * p * x_kv, "backward": 2 * (cp - 1) * (p + 4) * x_kv}
    per_direction = (cp - 1) * p * (2 * x + 2 * x_kv) // cp  # exact: each holds cp equal blocks
    return {"forward": per_direction, "backward": per_direction}
