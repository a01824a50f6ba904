"""Mixture-of-experts blocks and expert parallelism in the planner: state per rank, saved activations and
all-to-all bytes (chapter 09).

Shazeer et al. 2017, GShard (Lepikhin et al. 2020), Switch (Fedus et al. 2021); the layout is torchtitan's
dp2ep (Megatron-LM's MoE parallel folding): the ``N = dp x cp`` ranks are also ``edp x ep``, ``ep``
innermost (``refimpl.distributed.mesh.ParallelDims.expert_grid``). Block ``i`` of an MoE config
(``refimpl.config.ModelConfig.is_moe_layer``) has ``E`` experts and a top-``k`` router.

**State per rank** (``moe_state_memory_per_rank``): rank ``r`` of the ``dp x cp`` view is ep rank
``r mod ep`` and edp rank ``r div ep``; it holds ``E/ep`` experts of each block (rows ``[q E/ep, (q+1)
E/ep)`` of the ``[E, ...]`` tensors) and every dense tensor (its tp shard). ZeRO stage ``z`` (1-2) shards the
dense tensors over the ``N`` ranks and the expert tensors over the ``edp = N/ep`` ranks that hold the same
experts (``refimpl.parallel.zero.ShardedOptimizer``'s shard groups), each along dim 0 by the runtime's
``refimpl.distributed.placement.chunk_range``: ``refimpl.planner.zero_state.zero_memory`` of each
part, summed. The experts are replicated over tp (``refimpl.parallel.expert_parallel_gpt``).

**The load** (``ExpertLoad``): in one forward this rank keeps ``A = sum_e a_e`` assignments
(``a = Routing.kept_per_expert``: dropless ``A = k T`` for its ``T = b s`` tokens; with capacity each
``a_e <= C = ceil(k T / E cf)``), ``A_self`` of them for its own experts, and its local experts compute
``R = sum_j r_j`` rows, ``r_j`` summed over the ep group's ranks (``R = A`` at ep 1). Dropless routing
makes them the router's choice: measured counts are an input, ``ExpertLoad.uniform`` the default
(``k T / E`` per expert, capped at ``C``: ``A = min(k T, E C)``, ``A_self = A / ep``, ``R = A``).

**Saved for backward** by one MoE MLP (``moe_mlp_saved_terms``; fp32 router whatever the precision,
``x`` the MoE input, the post-attention LayerNorm's fp32 output, ``f`` the expert width, ``L = E/ep``,
``q`` the experts' bytes: the compute dtype's, for the grouped experts too (autocast does not cast
``torch._grouped_mm``, so ``refimpl.parallel.expert_parallel.GroupedExperts`` casts its rows and
weights to autocast's dtype itself, as torchtitan does))::

    4 T h                  router input (x; the dense block's "MLP input")
    + 4 T E                scores (softmax / sigmoid output)
    + 8 T k + 4 T k + 4 T  top-k ids (int64); the gathered weights and their sum (renormalisation)
    + 4 b E                the sequence-wise balance loss's f (when aux_loss_coeff > 0; sigmoid: + 4 T)
    + 8 A + 8 T k          the permutation's token index; the sort's indices (int64; the kept A are a
                           view of all T k)
    + 16 R                 ep > 1: the rank-major -> expert-major order and its inverse (int64)
    + c' q R h             the experts' input (c' = 2 for SwiGLU's loop under autocast: w1 and w3 each
                           cast it; else 1: the grouped experts cast it once for both)
    + c q R f              the experts' intermediates: SwiGLU c = 4 (w1 x, silu, w3 x, their product),
                           GELU c = 2 (w1 x, gelu)
    + 4 L                  _grouped_mm's int32 offsets (when it runs: 16-byte strides in the compute
                           dtype, h and f multiples of 4 in fp32, of 8 in bf16)
    + q A h                the expert outputs back home (the combine's index_copy source)
    + T k + 4 T k          the keep mask (bool) and the kept weights (fp32)
    + 4 T k h              the combine's fp32 unpermuted outputs, dropped assignments included

(``refimpl.measure.activations.SavedTensorMeter`` measures these, to the byte, for the counts the
forward produced; tests/planner/ranks/test_planner_moe.py). The attention half of the block is the dense
block's (``refimpl.planner.activations.activation_bytes_per_layer`` without its MLP terms); under tp the MoE
MLP sees every token, ``T = b s`` on every tp rank. Autocast keeps 16-bit copies of the linears' weights
and the experts' but not of the fp32 routers' (``autocast_weight_elements``). At ep 1 dropless only
``A = R = k T`` enters: uniform routing is exact there.

**All-to-all bytes** (``all_to_all_bytes``, as ``refimpl.comm.CommTracer`` books them on the ep
group, ``refimpl.comm.ops.all_to_all_single``): per block and forward the count exchange (no split
sizes: the ring model, ``(ep - 1)/ep 8 E``), the dispatch ``(A - A_self) 4 h`` (fp32 rows: the experts
cast them after the exchange) and the return ``(R - A_self) q h`` (the experts' output dtype); backward
runs each the other way, in its forward tensor's dtype: the dispatch's gradient is the fp32 gradient of
the ``R - A_self`` rows received, ``(R - A_self) 4 h``, the return's the ``q``-byte gradient of the ``A -
A_self`` rows sent, ``(A - A_self) q h`` (``A_self`` rows stay home both ways; with ``q = 4`` the two
readings agree, with ``q = 2`` and ``A != R`` only this one is the tracer's). Activation checkpointing
repeats the forward's three in backward. Uniform routing gives ``2 (ep - 1)/ep k T (4 + q) h + (ep - 1)/ep
8 E`` per block and forward+backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refimpl.config import ConfigError, ModelConfig, ParallelConfig
from refimpl.measure.state import StateMemory
from refimpl.planner.activations import activation_bytes_per_layer
from refimpl.planner.layout import Layout, tensor_parallel_degree, zero_shard_degree
from refimpl.planner.param_table import param_table
from refimpl.planner.zero_state import zero_memory
from refimpl.support import MOE_NOT_MODELLED, not_modelled

__all__ = ["DENSE_MLP_TERMS", "ExpertLoad", "all_to_all_bytes", "autocast_weight_elements", "check_moe_plan",
           "expert_parallel_degree", "is_expert_tensor", "moe_activation_bytes", "moe_mlp_saved_terms",
           "moe_state_memory_per_rank", "unmodelled_moe"]

EXPERT_TENSORS = ".mlp.moe.experts."
"""What the name of a grouped expert tensor holds (``MoEMLP.expert_parallel_parameters``)."""

ROUTER = ".mlp.moe.router."
"""What the name of an MoE block's router weight holds."""

DENSE_MLP_TERMS = ("MLP input", "GELU input", "GELU output = second linear input")
"""The dense block's MLP terms (``refimpl.planner.activations.activation_bytes_per_layer``), which an
MoE block replaces by ``moe_mlp_saved_terms``."""


def is_expert_tensor(name: str) -> bool:
    """Whether parameter ``name`` (of the plain GPT) is a grouped expert tensor, split over ``ep``."""
    return EXPERT_TENSORS in name


def expert_parallel_degree(dims: Layout) -> int:
    """``dims.ep`` (1 when the layout has none), checked to divide ``dp x cp``."""
    ep = getattr(dims, "ep", 1)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or zero_shard_degree(dims) % ep:
        raise ValueError(f"ep must be a positive integer that divides dp x cp, got ep={ep!r} in {dims!r}")
    return ep


def moe_state_memory_per_rank(config: ModelConfig, dims: Layout, *, zero_stage: int = 0,
                              dp_rank: int = 0) -> StateMemory:
    """Weights, gradients and AdamW state of rank ``dp_rank`` of the ``dp x cp`` group (module docstring):
    the dense tensors (tp shards) by ZeRO ``zero_stage`` over ``dp x cp``, the ``E/ep`` local experts' rows
    over the expert-data-parallel group (``dp x cp / ep``): under ZeRO-3 each block's experts are a unit
    of their own sharded there (``refimpl.parallel.parallelize``'s ``_expert_units``), the same rows."""
    n, ep = zero_shard_degree(dims), expert_parallel_degree(dims)
    if config.num_experts % ep:
        raise ValueError(f"{config.num_experts} experts do not split over ep={ep}")
    table = param_table(config, tp=tensor_parallel_degree(dims))
    dense = [p.shape for p in table.params if not is_expert_tensor(p.name)]
    experts = [(p.shape[0] // ep, *p.shape[1:]) for p in table.params if is_expert_tensor(p.name)]
    a = zero_memory(dense, n, zero_stage, rank=dp_rank)
    b = zero_memory(experts, n // ep, zero_stage, rank=dp_rank // ep)
    return StateMemory(weights=a.weights + b.weights, grads=a.grads + b.grads,
                       optimizer=a.optimizer + b.optimizer)


@dataclass(frozen=True, kw_only=True)
class ExpertLoad:
    """One MoE block's rows on one rank in one forward (module docstring): ``kept[e]`` this rank's kept
    assignments per expert (``[E]``, ``refimpl.parallel.expert_parallel.Routing.kept_per_expert``),
    ``received[j]`` the rows its local expert ``j`` computes, from every rank of the ep group (``[E/ep]``),
    ``ep_rank`` its rank there."""

    kept: tuple[int, ...]
    received: tuple[int, ...]
    ep_rank: int = 0

    @property
    def ep(self) -> int:
        return len(self.kept) // len(self.received)

    @property
    def sent(self) -> int:
        """``A``: the rows this rank dispatches (its kept assignments)."""
        return sum(self.kept)

    @property
    def to_self(self) -> int:
        """``A_self``: those for its own experts (they do not leave the rank)."""
        first = self.ep_rank * len(self.received)
        return sum(self.kept[first:first + len(self.received)])

    @property
    def computed(self) -> int:
        """``R``: the rows its local experts compute."""
        return sum(self.received)

    @classmethod
    def from_counts(cls, kept_by_rank: Sequence[Sequence[int]], ep_rank: int) -> ExpertLoad:
        """The load of rank ``ep_rank`` from every ep rank's kept counts ``kept_by_rank[q][e]`` (measured)."""
        ep, e = len(kept_by_rank), len(kept_by_rank[0])
        local = e // ep
        first = ep_rank * local
        received = tuple(sum(int(k[first + j]) for k in kept_by_rank) for j in range(local))
        return cls(kept=tuple(int(c) for c in kept_by_rank[ep_rank]), received=received, ep_rank=ep_rank)

    @classmethod
    def uniform(cls, config: ModelConfig, tokens: int, *, ep: int = 1, ep_rank: int = 0) -> ExpertLoad:
        """Every rank routes its ``tokens`` alike, ``k T / E`` per expert (the remainder to the first
        experts), each capped at the capacity ``C = ceil(k T / E cf)`` (``config.capacity_factor``)."""
        e, k = config.num_experts, config.top_k
        if e % ep:
            raise ValueError(f"{e} experts do not split over ep={ep}")
        q, rest = divmod(k * tokens, e)
        kept = [q + (i < rest) for i in range(e)]
        if config.capacity_factor is not None:
            cap = math.ceil(k * tokens / e * config.capacity_factor)  # the router's expert_capacity
            kept = [min(c, cap) for c in kept]
        return cls.from_counts([kept] * ep, ep_rank)


def _uses_grouped_mm(config: ModelConfig, compute_dtype: torch.dtype) -> bool:
    """``refimpl.parallel.expert_parallel.GroupedExperts.uses_grouped_mm`` for the layer's input (the
    LayerNorm's fp32 output) computed in ``compute_dtype`` (fp32, or autocast's, to which the grouped
    experts cast it): 16-byte strides in that dtype. As on CPU and on an sm90 / sm100 GPU in bf16; where
    CUDA would take ``_grouped_mm``'s fallback (fp32, fp16) the layer runs its loop, which saves the same
    bytes but the ``4 L`` offsets (``refimpl.parallel.expert_parallel.grouped_mm_runs_fused``)."""
    size = compute_dtype.itemsize
    return (config.hidden_size * size) % 16 == 0 and (config.expert_hidden_size * size) % 16 == 0


def moe_mlp_saved_terms(config: ModelConfig, load: ExpertLoad, *, micro_batch: int, seq_len: int,
                        compute_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """What one MoE MLP saves for backward on one rank (the module docstring's terms), for ``micro_batch``
    sequences of ``seq_len`` tokens and the rows of ``load``."""
    b, h, e, k = micro_batch, config.hidden_size, config.num_experts, config.top_k
    t, f = b * seq_len, config.expert_hidden_size
    a, r, local = load.sent, load.computed, len(load.received)
    if len(load.kept) != e:
        raise ValueError(f"the load counts {len(load.kept)} experts, the block has {e}")
    q = compute_dtype.itemsize  # the experts compute, save and return in it (module docstring)
    grouped = _uses_grouped_mm(config, compute_dtype)
    swiglu = config.moe_activation == "swiglu"
    terms = {
        "router input (fp32)": 4 * t * h,
        "router scores (fp32)": 4 * t * e,
        "top-k ids (int64), weights and their sum (fp32)": 8 * t * k + 4 * t * k + 4 * t,
    }
    if config.aux_loss_coeff:
        terms["balance loss f (fp32)"] = 4 * b * e + (4 * t if config.score_func == "sigmoid" else 0)
    terms |= {"token index (int64)": 8 * a, "sorted order (int64: the sort's T k indices)": 8 * t * k}
    if load.ep > 1:
        terms |= {"expert-major order and its inverse (int64)": 16 * r}
    casts = 2 if swiglu and q != 4 and not grouped else 1  # the loop's autocast casts it for w1 and w3
    terms |= {
        "expert input": casts * q * r * h,
        "expert intermediates": (4 if swiglu else 2) * q * r * f,
    }
    if grouped:
        terms |= {"grouped_mm offsets (int32)": 4 * local}
    terms |= {
        "expert outputs back home (the combine's index_copy source)": q * a * h,
        "keep mask (bool), kept weights (fp32)": t * k + 4 * t * k,
        "unpermuted expert outputs (fp32)": 4 * t * k * h,
    }
    return terms


def moe_activation_bytes(config: ModelConfig, *, micro_batch: int, seq_len: int,
                         compute_dtype: torch.dtype = torch.float32, tp: int = 1, ep: int = 1,
                         checkpointed_blocks: set[int] | list[int] | tuple[int, ...] = (),
                         loads: Sequence[ExpertLoad] | None = None) -> list[int]:
    """Saved bytes of every block on one rank (as ``refimpl.planner.activations.activation_bytes``),
    the MoE blocks by ``moe_mlp_saved_terms`` in place of their dense MLP terms: ``loads`` one
    ``ExpertLoad`` per MoE block in order (measured), default ``ExpertLoad.uniform`` at ``ep``."""
    moe = config.moe_layers
    if loads is None:
        loads = [ExpertLoad.uniform(config, micro_batch * seq_len, ep=ep)] * len(moe)
    if len(loads) != len(moe):
        raise ValueError(f"{len(loads)} expert loads for {len(moe)} MoE blocks")
    by_block = dict(zip(moe, loads, strict=True))
    chosen = set(checkpointed_blocks)
    out = []
    for i in range(config.num_layers):
        terms = activation_bytes_per_layer(config, checkpointed=i in chosen, micro_batch=micro_batch,
                                           seq_len=seq_len, compute_dtype=compute_dtype, tp=tp).terms
        if i in by_block and i not in chosen:
            terms = {n: v for n, v in terms.items() if n not in DENSE_MLP_TERMS}
            terms |= moe_mlp_saved_terms(config, by_block[i], micro_batch=micro_batch, seq_len=seq_len,
                                         compute_dtype=compute_dtype)
        out.append(sum(terms.values()))
    return out


def all_to_all_bytes(config: ModelConfig, load: ExpertLoad, *, compute_dtype: torch.dtype = torch.float32,
                     recomputed: bool = False) -> dict[str, float]:
    """Bytes one rank sends on the ep group for one MoE block's forward and backward, by term (module
    docstring; ``recomputed``: activation checkpointing runs the forward's collectives again)."""
    ep, h, e = load.ep, config.hidden_size, config.num_experts
    if ep == 1:
        return {}
    q = compute_dtype.itemsize
    out_rows, in_rows = load.sent - load.to_self, load.computed - load.to_self  # A - A_self, R - A_self
    forwards = 2 if recomputed else 1
    return {"count exchange (ring model)": forwards * (ep - 1) / ep * 8 * e,
            "dispatch (forward) and its gradient": (forwards * out_rows + in_rows) * 4 * h,
            "return (forward) and its gradient": (forwards * in_rows + out_rows) * q * h}


def unmodelled_moe(config: ModelConfig, *, pp: int = 1, cp: int = 1, zero_stage: int = 0,
                   sequence_parallel: bool = False, precision: str = "fp32") -> list[str]:
    """What of an MoE layout the planner does not model, by name (``refimpl.support.MOE_NOT_MODELLED``;
    empty for a dense model). ``zero_stage`` is accepted for the callers' uniformity: ZeRO 0-3 are
    modelled."""
    if not config.num_experts:
        return []
    layout = ParallelConfig(pp=pp, cp=cp, sequence_parallel=sequence_parallel, precision=precision)
    return [name for name, on in MOE_NOT_MODELLED if on(config, layout)]


def check_moe_plan(config: ModelConfig, *, what: str, **layout) -> None:
    """Refuse, in one line, what ``unmodelled_moe`` names (``layout``: its keyword arguments), in the words
    of ``refimpl.support.NOT_MODELLED_TABLE``'s row ``moe-layout``."""
    if unmodelled := unmodelled_moe(config, **layout):
        raise ConfigError(f"{what}: {not_modelled('moe-layout')}; not {', '.join(unmodelled)}")


def autocast_weight_elements(config: ModelConfig, *, tp: int = 1, ep: int = 1) -> int:
    """Elements of the weights autocast keeps a 16-bit copy of on one rank: the linear layers'
    (``refimpl.planner.params_flops.matmul_weights_per_rank``) but the MoE routers', which compute in
    fp32 with autocast off (``refimpl.parallel.expert_parallel.TopKRouter``), and the rank's experts
    (their per-expert loop's matmuls are cast by autocast, the grouped experts cast their weights
    themselves)."""
    table = param_table(config, tp=tp)
    return sum(p.numel // (ep if is_expert_tensor(p.name) else 1) for p in table.params
               if (p.matmul and ROUTER not in p.name) or is_expert_tensor(p.name))
