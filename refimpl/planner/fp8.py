"""``--precision fp8`` in the planner: which weights run in fp8 and what that changes per rank (chapter 10).

The trainer (``refimpl.precision.fp8.apply_float8_training``) gives fp8 GEMMs to every linear of the
plain GPT but the first (block 0's ``query_key_value``) and the last (the output layer: tied, the word
embedding), and keeps any weight that is not a multiple of 16 in both dims in bf16. Around them the run is
bf16 autocast over fp32 weights, so against ``--precision bf16`` two terms change, both measured with
``refimpl.measure.activations.SavedTensorMeter`` (tests/trainer/ranks/cli/test_train_fp8.py):

* **weight copies**: autocast keeps a bf16 copy of each weight it multiplies (``2`` bytes per element);
  an fp8 layer keeps none, it saves the fp32 Parameter itself and casts it to fp8 (``1`` byte per element)
  in each GEMM that reads it, a transient copy freed after the GEMM: the largest fp8 weight of the rank
  bounds it;
* **saved inputs**: an fp8 layer saves its input as it arrives, where autocast's ``linear`` saves the bf16
  copy. The two LayerNorm-fed layers of a block (``query_key_value``, ``dense_h_to_4h``) receive fp32
  (LayerNorm runs in fp32 under autocast), so each saves ``(4 - 2) b s h`` bytes more than in bf16
  (``s`` the rank's tokens, ``s/cp``); ``dense`` and ``dense_4h_to_h`` receive bf16, no change.
"""

from __future__ import annotations

from refimpl.config import ModelConfig
from refimpl.planner.param_table import ParamSpec, _model_params, param_table

__all__ = ["FP8_ALIGN", "fp8_extra_saved_bytes", "fp8_weights"]

FP8_ALIGN = 16  # torch._scaled_mm on CUDA (refimpl.precision.fp8.float8_linear.ALIGN)
_LAYERNORM_FED = ("query_key_value.weight", "dense_h_to_4h.weight")


def _aligned(shape: tuple[int, ...]) -> bool:
    return all(n % FP8_ALIGN == 0 for n in shape)


def fp8_weights(config: ModelConfig, *, tp: int = 1) -> tuple[ParamSpec, ...]:
    """The weights one of ``tp`` tensor-parallel ranks multiplies in fp8 (module docstring), in the
    model's order."""
    table = param_table(config, tp=tp)
    full = {name: shape for name, shape, _ in _model_params(config)[0]}
    linears = [p for p in table.params if p.matmul and p is not table.head]  # the head: the last linear
    first = linears[0].name if linears else None
    return tuple(p for p in linears if p.name != first and _aligned(full[p.name]))


def fp8_extra_saved_bytes(config: ModelConfig, *, micro_batch: int, tokens: int, tp: int = 1,
                          sequence_parallel: bool = False) -> list[int]:
    """Per block, the bytes an fp8 run saves beyond a bf16 run's (module docstring): ``2 b s h`` per
    LayerNorm-fed fp8 layer, ``tokens`` the rank's ``s/cp``; the column layers' input is whole under tp,
    but under sequence parallelism the seam saves the rank's ``s/t`` tokens before its gather (fp32 where
    bf16's sequence-parallel path saves them cast to bf16)."""
    names = {p.name for p in fp8_weights(config, tp=tp)}
    per_layer = (4 - 2) * micro_batch * (tokens // tp if sequence_parallel else tokens) * config.hidden_size
    return [per_layer * sum(n.startswith(f"layers.{i}.") and n.endswith(_LAYERNORM_FED) for n in names)
            for i in range(config.num_layers)]
