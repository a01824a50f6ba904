"""One layout of a cluster estimated: memory per GPU, bytes per axis, bubble and step time (chapter 12).

``evaluate_layout`` is what ``python -m refimpl.plan`` (``refimpl.plan``) computes for every layout
and combination it searches, and what ``--layout`` prints; a chapter calls it directly. Its terms:

* **model state** per GPU: ``refimpl.planner.zero_state.zero_memory_paper`` (Rajbhandari et al. 2020,
  ``K = 12``: bf16 weights and gradients, fp32 master weights and Adam moments) over the ``N / (tp pp)``
  parameters of a rank, sharded over the ``(dp / dp_replicate) x cp`` ranks of its ZeRO group: stage 1
  shards the optimizer, stage 2 the gradients too, stage 3 the weights too. HSDP (``dp_replicate`` R > 1,
  FSDP's hybrid sharding) shards within ``dp / R`` ranks and replicates the shards ``R`` times;
* **gathered** (ZeRO-3 only): under pipeline parallelism the trainer's default keeps each stage gathered
  through the step, its bf16 weights and full gradients (``4 N / (tp pp)``), its collectives once per step;
  when that does not fit, the stage is gathered and reduced per micro-batch (``--zero3-reshard-per-
  microbatch``: ``m`` times the dp bytes) and holds, as without a pipeline, one block's bf16 weights being
  used, the next one's prefetched and the block's full bf16 gradients before their reduce-scatter,
  ``3 x 2 x`` a block's parameters ``/ tp``
  (``refimpl.planner.zero_state.zero3_peak_gathered_bytes`` with prefetch, blocks as units);
* **activations**: one micro-batch of ``s/cp`` tokens per layer with sequence parallelism, ``34 s b h / t``
  plus ``5 a s^2 b / t`` without flash attention (Korthikanti et al. 2022; the Llama form at its own sizes:
  GQA's k/v, SwiGLU, no dropout, ``refimpl.planner.activations.paper_bytes_per_layer``), times
  ``L/pp`` layers, times the ``min(pp, m)`` micro-batches the first 1F1B stage holds; with recomputation
  every block keeps only its input, ``2 s b h / t``, plus one block recomputed;
* **bytes each GPU sends per step**, per axis, by the ring model (``refimpl.comm.tracer.wire_bytes``):
  TP's collectives (``refimpl.planner.communication.tensor_parallel_collectives``; with fewer key/value
  heads than ``t``, each block's qkv output all-gathered and reduce-scattered back), the pipeline's
  boundary sends (``boundary_bytes``), CP's ring (``refimpl.planner.communication.context_parallel_bytes``)
  and dp: the bf16 gradient all-reduce
  (stages 0-2: a reduce-scatter and an all-gather move the same bytes), 1.5 times that at ZeRO-3 (an
  all-gather of the weights for forward and one for backward, a reduce-scatter of the gradients; each
  block gathered once per pass of the step, not per micro-batch); under HSDP these run within the shard
  group and the shards' all-reduce crosses the ``R`` replicas;
* **mixture of experts** (``ep``, inside ``dp x cp``): the routed experts' state ``/ (ep pp)``, replicated
  over tp, sharded by ZeRO over the ``dp x cp / ep`` ranks that hold the same experts (their gradients
  reduced there), the MoE blocks' activations at ``k`` routed and the shared experts per token, and the
  all-to-all bytes refimpl's expert parallelism sends for uniform routing
  (``refimpl.planner.experts.all_to_all_bytes``), over the ``tp x ep`` ranks' link;
* **time**: the model FLOPs ``(6 N + 12 L h s) x tokens`` at ``mfu`` of the bf16 peak, plus a third of it
  (one more forward) under recomputation, stretched by the 1F1B bubble ``(pp-1)/(m+pp-1)``, plus every
  axis' bytes at the link it crosses (NVLink inside a node, the network between), none overlapped.

Ranks are laid out ``[pp, dp_replicate, dp_shard, cp, tp]``, tp innermost (``refimpl.distributed.mesh``).
An estimate from data-sheet figures (``GPUS``), not a measurement.

**What the trainer would run.** Each combination is the trainer's ``refimpl.config.ParallelConfig``
``trainer_config`` (``LayoutPlan.parallel``), and ``check_layout`` refuses, in the same words,
what the trainer refuses: the support table's rows (``refimpl.support.check_supported``, e.g. HSDP is
ZeRO-3's) and the shapes its tensor and context parallelism cannot split
(``refimpl.support.shape_refusals``); ``layout_refusals`` lists them for the search, which skips
them. The planner's fields map onto the trainer's options explicitly: ``recompute`` is
``activation_checkpointing="all"`` (every block), the ``m`` micro-batches are ``microbatches`` under a
pipeline and, without one, gradient accumulation, which the trainer derives from the batch and
``--micro-batch-size`` (``microbatches`` is a pipeline option there); ``zero3_per_microbatch`` is
``zero3_reshard_per_microbatch``; the planner's assumptions are ``precision="bf16"``, sequence parallelism
whenever ``tp > 1`` (the trainer refuses it at tp 1), ring attention and the 1F1B schedule. ``flash``
(the s^2 scores kept or not) is a memory assumption with no trainer option.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from refimpl.comm.tracer import wire_bytes
from refimpl.config import ConfigError, ModelConfig, ParallelConfig
from refimpl.measure.peaks import PEAK_FLOPS
from refimpl.measure.state import StateMemory
from refimpl.planner.activations import paper_bytes_per_layer
from refimpl.planner.communication import context_parallel_bytes, tensor_parallel_collectives
from refimpl.planner.experts import ExpertLoad, all_to_all_bytes
from refimpl.planner.params_flops import flops_per_token, param_count
from refimpl.planner.zero_state import STAGES, zero_memory_paper
from refimpl.support import refusals, shape_refusals

__all__ = ["BOUNDARY_BYTES_PER_ELEMENT", "GPUS", "MEMORY_FRACTION", "LayoutPlan", "boundary_bytes",
           "check_layout", "choose", "evaluate_layout", "evaluate_stages", "layout_refusals",
           "trainer_config"]

# per GPU, from the data sheets: memory (bytes), NVLink bandwidth per direction and the network per GPU
# per direction (bytes/s); dense bf16 peaks come from refimpl.measure.peaks
GPUS = {
    "H100": {"memory": 80e9, "nvlink": 450e9, "network": 50e9},   # NVLink 4: 900 GB/s both ways; NDR 400 Gb/s
    "H200": {"memory": 141e9, "nvlink": 450e9, "network": 50e9},
    "A100": {"memory": 80e9, "nvlink": 300e9, "network": 25e9},   # NVLink 3: 600 GB/s both ways; HDR 200 Gb/s
}
MEMORY_FRACTION = 0.9  # of a GPU's memory a plan may use: the rest for the allocator, NCCL, the CUDA context

# what refimpl's pipeline sends at a stage boundary: the residual stream, float32 under autocast too (the
# residual add of an fp32 input and a bf16 block output promotes to fp32; the receivers allocate float32:
# refimpl.parallel.pipeline_parallel), measured per send in tests/ranks/test_boundary_bytes.py. Megatron-LM
# sends its params dtype, bf16: half of this.
BOUNDARY_BYTES_PER_ELEMENT = 4


def boundary_bytes(*, micro_batch: int, seq_len: int, hidden_size: int, tp: int, cp: int,
                   sequence_parallel: bool = True) -> float:
    """Bytes of one stage-boundary tensor (an activation forward, or its gradient backward) one GPU sends:
    ``[b, s/cp, h]`` float32, ``[b, s/(cp tp), h]`` under sequence parallelism (each tp rank sends its
    sequence shard; Korthikanti et al. 2022)."""
    tokens = seq_len / cp / (tp if sequence_parallel else 1)
    return BOUNDARY_BYTES_PER_ELEMENT * micro_batch * tokens * hidden_size


@dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    """One layout at one ZeRO stage, recomputation and HSDP degree: bytes per GPU, bytes each GPU sends per
    step per axis, seconds."""

    dp: int
    tp: int
    pp: int
    cp: int
    microbatches: int
    zero_stage: int
    recompute: bool
    dp_replicate: int
    state: StateMemory  # zero_memory_paper's weights, gradients, optimizer (fractional bytes)
    gathered_bytes: float  # ZeRO-3's working set of full blocks
    activation_bytes: float
    limit_bytes: float  # MEMORY_FRACTION of the GPU's memory
    sent: dict[str, float]
    bubble: float
    compute_s: float  # the model FLOPs at the assumed MFU
    recompute_s: float  # the forward recomputation adds
    comm_s: float
    zero3_per_microbatch: bool = False  # ZeRO-3 under pp: each micro-batch gathers and reduces (the trainer's
    # --zero3-reshard-per-microbatch), chosen when the default (the stage kept gathered) does not fit
    ep: int = 1  # expert parallelism: the routed experts split over ep of the dp x cp ranks

    @property
    def zero_label(self) -> str:
        """The ZeRO stage as the tables print it: ``3m`` for ZeRO-3 gathered per micro-batch under pp."""
        return f"{self.zero_stage}m" if self.zero3_per_microbatch else str(self.zero_stage)

    @property
    def parallel(self) -> ParallelConfig:
        """The trainer's configuration of this combination (``trainer_config``)."""
        return trainer_config(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, zero_stage=self.zero_stage,
                              recompute=self.recompute, dp_replicate=self.dp_replicate,
                              microbatches=self.microbatches, zero3_per_microbatch=self.zero3_per_microbatch,
                              ep=self.ep)

    @property
    def state_bytes(self) -> float:
        return self.state.total

    @property
    def memory_bytes(self) -> float:
        return self.state.total + self.gathered_bytes + self.activation_bytes

    @property
    def margin_bytes(self) -> float:
        """Bytes left under the limit; negative: by how much it does not fit."""
        return self.limit_bytes - self.memory_bytes

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.recompute_s) / (1 - self.bubble) + self.comm_s


def trainer_config(*, dp: int, tp: int, pp: int, cp: int, zero_stage: int, recompute: bool, dp_replicate: int,
                   microbatches: int, zero3_per_microbatch: bool = False, ep: int = 1) -> ParallelConfig:
    """The ``refimpl.config.ParallelConfig`` the trainer runs for one of the planner's combinations
    (``RunOptions.parallel`` of the flags that give it): the mapping of the module docstring."""
    return ParallelConfig(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, dp_replicate=dp_replicate, zero_stage=zero_stage,
                          precision="bf16", sequence_parallel=tp > 1, cp_method="ring", pp_schedule="1f1b",
                          microbatches=microbatches if pp > 1 else None,
                          activation_checkpointing="all" if recompute else None,
                          zero3_reshard_per_microbatch=zero3_per_microbatch)


def layout_refusals(config: ModelConfig, *, dp: int, tp: int, pp: int, cp: int, seq_len: int,
                    global_batch: int, micro_batch: int, zero_stage: int, recompute: bool = False,
                    dp_replicate: int = 1, ep: int = 1) -> list[str]:
    """Why the trainer would refuse this combination (its ``trainer_config``), one sentence per
    reason, none when it runs it: the support table's rows (``refimpl.support.refusals``), then the
    shapes (``refimpl.support.shape_refusals``). The degrees must be positive (``check_layout``)."""
    microbatches = max(global_batch // (dp * micro_batch), 1)
    parallel = trainer_config(dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero_stage, recompute=recompute,
                              dp_replicate=dp_replicate, microbatches=microbatches, ep=ep)
    return ([row.message() for row in refusals(parallel, moe=config.num_experts > 0)]
            + shape_refusals(config, parallel, seq_len=seq_len))


def check_layout(config: ModelConfig, *, dp: int, tp: int, pp: int, cp: int, seq_len: int, global_batch: int,
                 micro_batch: int, zero_stage: int, dp_replicate: int, recompute: bool = False, ep: int = 1
                 ) -> None:
    """A ConfigError unless the degrees split the model, the sequence and the batch and the trainer runs the
    combination (``layout_refusals``, in the support table's words)."""
    _check_degrees(config, dp=dp, tp=tp, pp=pp, cp=cp, seq_len=seq_len, global_batch=global_batch,
                   micro_batch=micro_batch, zero_stage=zero_stage, dp_replicate=dp_replicate, ep=ep)
    why = layout_refusals(config, dp=dp, tp=tp, pp=pp, cp=cp, seq_len=seq_len, global_batch=global_batch,
                          micro_batch=micro_batch, zero_stage=zero_stage, recompute=recompute,
                          dp_replicate=dp_replicate, ep=ep)
    if why:
        raise ConfigError("; and ".join(why))


def _check_degrees(config: ModelConfig, *, dp: int, tp: int, pp: int, cp: int, seq_len: int,
                   global_batch: int, micro_batch: int, zero_stage: int, dp_replicate: int, ep: int = 1
                   ) -> None:
    """The arithmetic of ``check_layout``: positive degrees, a ZeRO stage, splits that divide."""
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("micro_batch", micro_batch),
                    ("dp_replicate", dp_replicate), ("ep", ep)):
        if v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
    if zero_stage not in STAGES:
        raise ConfigError(f"ZeRO stage must be one of {STAGES}, got {zero_stage}")
    for name, d, what, n in (("tp", tp, "heads", config.num_attention_heads),
                             ("pp", pp, "layers", config.num_layers), ("hsdp", dp_replicate, "dp ranks", dp),
                             ("dp x micro-batch", dp * micro_batch, "sequences per step", global_batch),
                             ("ep", ep, "dp x cp ranks", dp * cp)):
        if n % d:
            raise ConfigError(f"{name} {d} does not divide the {n} {what}")
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(f"cp {cp}: the ring's 2 cp chunks do not split {seq_len} tokens")
    if ep > 1 and (config.num_experts == 0 or config.num_experts % ep):
        raise ConfigError(f"ep {ep} splits the routed experts: the model has {config.num_experts}")


def _model_state(config: ModelConfig, *, tp: int, pp: int, ep: int, shard: int, edp: int, zero_stage: int
                 ) -> tuple[StateMemory, float, float]:
    """ZeRO's state per GPU and the rank's dense and expert parameters: the dense ones ``/ (tp pp)``
    sharded over the ZeRO group, the routed experts ``/ (ep pp)`` (replicated over tp) over the
    expert-data-parallel ``dp x cp / ep`` ranks that hold the same experts."""
    count = param_count(config)
    dense, experts = (count.total - count.experts) / (tp * pp), count.experts / (ep * pp)
    parts = [zero_memory_paper(dense, shard, zero_stage)]
    if experts:
        parts.append(zero_memory_paper(experts, edp, zero_stage))
    state = StateMemory(**{k: sum(getattr(x, k) for x in parts) for k in ("weights", "grads", "optimizer")})
    return state, dense, experts


def _held_activations(config: ModelConfig, *, tokens: int, keys: int, micro_batch: int, tp: int, pp: int,
                      microbatches: int, recompute: bool, flash: bool) -> float:
    """The activations the first 1F1B stage holds: ``min(pp, m)`` micro-batches of its ``L/pp`` blocks
    (dense and MoE blocks at their own sizes, ``paper_bytes_per_layer``), or with recomputation each
    block's input and one block recomputed."""
    L, moe = config.num_layers, len(config.moe_layers)  # noqa: N806
    per = {kind: paper_bytes_per_layer(config, seq_len=tokens, key_len=keys, micro_batch=micro_batch, tp=tp,
                                       flash=flash, sequence_parallel=True, moe=kind,
                                       dropout=config.activation == "gelu") for kind in {False, moe > 0}}
    held = min(pp, microbatches) / pp
    if recompute:
        return 2 * tokens * micro_batch * config.hidden_size / tp * L * held + per[moe > 0]
    return ((L - moe) * per[False] + moe * per[moe > 0]) * held


def _expert_all_to_all(config: ModelConfig, *, tokens: int, micro_batch: int, tp: int, pp: int, ep: int,
                       microbatches: int, recompute: bool) -> float:
    """Bytes one GPU sends per step in the MoE blocks' all-to-alls: what refimpl's expert parallelism sends
    for uniform routing (``refimpl.planner.experts.all_to_all_bytes``, byte-exact against the trainer in
    tests/planner/ranks/test_planner_moe.py: fp32 rows dispatched, bf16 rows returned, the gradients back, the
    recomputed forward's again) for each of the ``b s / (cp t)`` tokens this GPU routes (sequence parallelism:
    each tp rank routes its own), per MoE block of its stage and micro-batch."""
    if ep == 1:
        return 0.0
    load = ExpertLoad.uniform(config, micro_batch * tokens // tp, ep=ep)
    per_block = sum(all_to_all_bytes(config, load, compute_dtype=torch.bfloat16,
                                     recomputed=recompute).values())
    return per_block * len(config.moe_layers) / pp * microbatches


def evaluate_layout(config: ModelConfig, *, dp: int, tp: int, pp: int, cp: int = 1, gpu: str = "H100",
                    gpus_per_node: int = 8, seq_len: int, global_batch: int, micro_batch: int = 1,
                    mfu: float = 0.5, zero_stage: int = 1, recompute: bool = False, dp_replicate: int = 1,
                    flash: bool = True, ep: int = 1) -> LayoutPlan:
    """The estimate of one layout at one ZeRO stage, recomputation and HSDP degree (module docstring)."""
    check_layout(config, dp=dp, tp=tp, pp=pp, cp=cp, seq_len=seq_len, global_batch=global_batch,
                 micro_batch=micro_batch, zero_stage=zero_stage, dp_replicate=dp_replicate,
                 recompute=recompute, ep=ep)
    spec, peak = GPUS[gpu], PEAK_FLOPS[gpu]["bf16"]
    L, h, s, b = config.num_layers, config.hidden_size, seq_len, micro_batch  # noqa: N806
    m, sc = global_batch // (dp * b), s // cp  # micro-batches; tokens per GPU per sequence
    shard, replicas = dp // dp_replicate * cp, dp_replicate  # the ZeRO group; its replicas (HSDP)
    state, dense, experts = _model_state(config, tp=tp, pp=pp, ep=ep, shard=shard, edp=dp * cp // ep,
                                         zero_stage=zero_stage)
    count = param_count(config)
    moe = len(config.moe_layers)
    block = (count.layers - count.experts) / L / tp + (count.experts / moe / ep if moe else 0)
    gathered = 3 * 2 * block if zero_stage == 3 else 0.0
    kept = _held_activations(config, tokens=sc, keys=s, micro_batch=b, tp=tp, pp=pp, microbatches=m,
                             recompute=recompute, flash=flash)
    collectives = tensor_parallel_collectives(num_layers=L // pp, hidden_size=h, micro_batch=b, seq_len=sc,
                                              tp=tp, bytes_per_element=2, config=config)
    ring = context_parallel_bytes(config, micro_batch=b, seq_len=s, cp=cp, method="ring", tp=tp,
                                  compute_dtype=torch.bfloat16)
    grads = 2 * (dense + experts)  # bf16
    in_shard = (wire_bytes("all_reduce", 2 * dense, shard)  # the experts' over the edp ranks holding them
                + wire_bytes("all_reduce", 2 * experts, dp * cp // ep)) * (1.5 if zero_stage == 3 else 1)
    per_micro = False
    if zero_stage == 3 and pp > 1:  # the trainer's two modes under pp: the stage kept gathered (bf16 weights
        # and full gradients through the step, collectives once), else gathered and reduced per micro-batch
        # (where the support table takes it)
        per_micro_config = replace(trainer_config(dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=3,
                                                  recompute=recompute, dp_replicate=dp_replicate,
                                                  microbatches=m, ep=ep), zero3_reshard_per_microbatch=True)
        if (state.total + 2 * grads + kept <= MEMORY_FRACTION * spec["memory"]
                or refusals(per_micro_config, moe=moe > 0)):
            gathered = 2 * grads
        else:
            per_micro, in_shard = True, in_shard * m
    across = wire_bytes("all_reduce", 2 * dense / shard, replicas)
    sent = {  # bytes one GPU sends per step, per axis
        "tp": sum(wire_bytes(op, payload, tp) for op, (_, payload) in collectives.items()) * m,
        "dp": in_shard + across,
        "pp": boundary_bytes(micro_batch=b, seq_len=s, hidden_size=h, tp=tp, cp=cp) * m * min(pp - 1, 2),
        "cp": (ring["forward"] + ring["backward"]) * (L // pp) * m,
        "ep": _expert_all_to_all(config, tokens=sc, micro_batch=b, tp=tp, pp=pp, ep=ep, microbatches=m,
                                 recompute=recompute),
    }

    def bandwidth(span: int) -> float:  # a group spanning `span` consecutive ranks
        return spec["nvlink"] if span <= gpus_per_node else spec["network"]

    comm = (sent["tp"] / bandwidth(tp) + in_shard / bandwidth(tp * shard) + across / bandwidth(tp * cp * dp)
            + sent["pp"] / bandwidth(tp * cp * dp * pp) + sent["cp"] / bandwidth(tp * cp)
            + sent["ep"] / bandwidth(tp * ep))
    compute = flops_per_token(config, s) * global_batch * s / (dp * tp * pp * cp * peak * mfu)
    return LayoutPlan(dp=dp, tp=tp, pp=pp, cp=cp, microbatches=m, zero_stage=zero_stage, recompute=recompute,
                      dp_replicate=dp_replicate, state=state, gathered_bytes=gathered, activation_bytes=kept,
                      limit_bytes=MEMORY_FRACTION * spec["memory"], sent=sent, bubble=(pp - 1) / (m + pp - 1),
                      compute_s=compute, recompute_s=compute / 3 if recompute else 0.0, comm_s=comm,
                      zero3_per_microbatch=per_micro, ep=ep)


def evaluate_stages(config: ModelConfig, *, stages: tuple[int, ...] = STAGES, recompute: bool | None = None,
                    dp_replicate: int = 1, **layout) -> list[LayoutPlan]:
    """``evaluate_layout`` at each ZeRO stage of ``stages`` (``layout``: its other arguments), without
    recomputation when that fits, else with it (``recompute`` None; True or False: only that), at HSDP's
    ``dp_replicate``; the combinations the trainer refuses (``layout_refusals``: HSDP is ZeRO-3's) are
    left out, a stage with none left too (none at all: ``check_layout``'s ConfigError)."""
    args = {k: layout[k] for k in ("dp", "tp", "pp", "seq_len", "global_batch")} | {
        "cp": layout.get("cp", 1), "micro_batch": layout.get("micro_batch", 1), "dp_replicate": dp_replicate,
        "ep": layout.get("ep", 1)}
    recomputes = (False, True) if recompute is None else (recompute,)
    for z in stages:
        _check_degrees(config, **args, zero_stage=z)
    combos = [[r for r in recomputes if not layout_refusals(config, **args, zero_stage=z, recompute=r)]
              for z in stages]
    if not any(combos):  # every stage refused: say why, in the trainer's words
        check_layout(config, **args, zero_stage=stages[0], recompute=recomputes[0])
    tried = [[evaluate_layout(config, **layout, zero_stage=z, recompute=r, dp_replicate=dp_replicate)
              for r in rs] for z, rs in zip(stages, combos, strict=True) if rs]
    return [next((p for p in t if p.fits), t[-1]) for t in tried]


def choose(candidates: list[LayoutPlan]) -> LayoutPlan:
    """The planner's rule for one layout: among the combinations that fit, the shortest step, ties (stages
    0-2 move the same bytes) to the lowest ZeRO stage, then no recomputation, no replication, the lowest
    expert-parallel degree; when none fits, the one needing the least memory."""
    fit = [p for p in candidates if p.fits]
    if fit:
        return min(fit, key=lambda p: (p.step_s, p.zero_stage, p.recompute, p.dp_replicate, p.ep))
    return min(candidates, key=lambda p: (p.memory_bytes, p.step_s))
