"""Formulas only: what a training run needs and moves, before anything runs (chapters 00-10).

* ``refimpl.planner.params_flops``: parameters, their shapes, FLOPs per token (PaLM appendix B);
  ``refimpl.planner.param_table``: a rank's parameters by name, read from a meta-device model and the
  tensor-parallel plan the model declares (``tensor_parallel_plan``);
* ``refimpl.planner.memory``: model state of a replica and per rank, a run's memory per rank (the
  trainer's preflight); ``refimpl.planner.zero_state``: ZeRO stages 0-3 (Rajbhandari et al. 2020);
* ``refimpl.planner.experts``: MoE blocks and expert parallelism (chapter 09): the experts' state per
  rank (over the expert-data-parallel group), an MoE block's saved bytes and its all-to-all bytes, from
  measured per-expert counts or uniform routing;
* ``refimpl.planner.activations``: bytes saved for backward, per rank under tensor, sequence and
  context parallelism (Korthikanti et al. 2022; chapters 05-07);
* ``refimpl.planner.communication``: bytes of the ring collectives, of ZeRO's and of tensor
  parallelism's collectives, and of context parallelism's ring and all-to-alls;
* ``refimpl.planner.time_model``: the alpha-beta cost model fitted to measured times;
  ``refimpl.planner.step_time``: a step's time on a link, its compute plus the transfers nothing hides,
  and which ones it assumes hidden (chapters 03-04, checked on the shaped link);
* ``refimpl.planner.pipeline_stages``: the pipeline's stages, the parameters and state each rank holds;
  ``refimpl.planner.pipeline_memory``: per pipeline rank, the activations it holds at its peak under a
  schedule (chapter 08);
* ``refimpl.planner.run_prediction``: one trainer run at a layout, per rank: state, held
  activations, bytes per process group per step, the bubble (chapter 12); ``refimpl.planner.step_bytes``:
  each technique's declared bytes per group it adds up (``STEP_BYTES``), their formulas
  ``refimpl.planner.run_terms``';
* ``refimpl.planner.layout``: the layout (``ParallelDims``-like degrees) that per-rank functions take.

Each figure is checked in a chapter against a measurement from ``refimpl.measure``, a different source.
Re-exported here, not repeated: ``refimpl.measure.state.StateMemory`` (the one class formulas and
measurements both return), the device peak table and MFU (``refimpl.measure.peaks``,
``refimpl.measure.throughput``), the ring model of one op (``refimpl.comm.tracer.wire_bytes``,
which the tracer books at run time). The runtime's sharding rule is reused:
``refimpl.distributed.placement.chunk_range``.
"""

from refimpl.measure.peaks import PEAK_DTYPES, PEAK_FLOPS, peak_flops
from refimpl.measure.state import StateMemory
from refimpl.measure.throughput import model_flops_utilization
from refimpl.planner.activations import (
    ActivationBreakdown,
    activation_bytes,
    activation_bytes_per_layer,
    korthikanti_bytes_per_layer,
    outside_block_bytes,
)
from refimpl.planner.communication import (
    context_parallel_bytes,
    ring_bytes_sent,
    tensor_parallel_collectives,
    wire_bytes,
    zero_collectives,
    zero_comm_bytes,
)
from refimpl.planner.experts import (
    ExpertLoad,
    all_to_all_bytes,
    moe_activation_bytes,
    moe_state_memory_per_rank,
)
from refimpl.planner.layout import (
    Layout,
    context_parallel_degree,
    data_parallel_degree,
    pipeline_parallel_degree,
    tensor_parallel_degree,
    zero_shard_degree,
)
from refimpl.planner.layout_plan import LayoutPlan, evaluate_layout, evaluate_stages
from refimpl.planner.memory import (
    RunMemory,
    run_memory_of,
    run_memory_per_rank,
    state_memory,
    state_memory_per_rank,
)
from refimpl.planner.params_flops import (
    ParamCount,
    flops_per_token,
    matmul_weights_per_rank,
    num_param_tensors,
    param_count,
    param_shapes,
)
from refimpl.planner.pipeline_memory import (
    PipelineRankMemory,
    pipeline_memory_per_rank,
    stage_deferred_bytes,
    stage_saved_bytes,
)
from refimpl.planner.pipeline_stages import pipeline_state_memory
from refimpl.planner.run_prediction import RankPrediction, RunPrediction, predict_run
from refimpl.planner.run_terms import (
    data_parallel_bytes,
    recompute_tp_payloads,
    shard_group_rank,
    sixteen_bit_weight_activations,
)
from refimpl.planner.time_model import AlphaBeta, fit_alpha_beta
from refimpl.planner.zero_state import (
    ADAM_MIXED_PRECISION_K,
    STAGES,
    padded_numel,
    shard_rows,
    sharded_numel,
    zero3_peak_gathered_bytes,
    zero_memory,
    zero_memory_paper,
)

__all__ = ["ADAM_MIXED_PRECISION_K", "PEAK_DTYPES", "PEAK_FLOPS", "STAGES", "ActivationBreakdown",
           "AlphaBeta", "ExpertLoad", "Layout", "LayoutPlan", "ParamCount", "PipelineRankMemory",
           "RankPrediction", "RunMemory", "RunPrediction", "StateMemory", "activation_bytes",
           "activation_bytes_per_layer", "all_to_all_bytes", "context_parallel_bytes",
           "context_parallel_degree", "data_parallel_bytes", "data_parallel_degree", "evaluate_layout",
           "evaluate_stages", "fit_alpha_beta", "flops_per_token", "korthikanti_bytes_per_layer",
           "matmul_weights_per_rank", "model_flops_utilization", "moe_activation_bytes",
           "moe_state_memory_per_rank", "num_param_tensors", "outside_block_bytes", "padded_numel",
           "param_count", "param_shapes", "peak_flops", "pipeline_memory_per_rank",
           "pipeline_parallel_degree", "pipeline_state_memory", "predict_run", "recompute_tp_payloads",
           "ring_bytes_sent", "run_memory_of", "run_memory_per_rank", "shard_group_rank", "shard_rows",
           "sharded_numel", "sixteen_bit_weight_activations", "stage_deferred_bytes", "stage_saved_bytes",
           "state_memory", "state_memory_per_rank", "tensor_parallel_collectives", "tensor_parallel_degree",
           "wire_bytes", "zero3_peak_gathered_bytes", "zero_collectives", "zero_comm_bytes", "zero_memory",
           "zero_memory_paper", "zero_shard_degree"]
