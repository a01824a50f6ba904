"""Mixed precision from scratch: the policy, fp32 master weights, a dynamic loss scaler (chapter 05).

One concept per file:

* ``.policy``: ``MixedPrecisionPolicy`` (``param_dtype``, ``compute_dtype``, ``reduce_dtype``, the
  three dtypes of FSDP2's policy), the ``--precision`` names and ``dtype_from_name``;
* ``.master_weights``: ``MasterWeights``, the fp32 copy a 16-bit model steps through
  (Micikevicius et al. 2018, "Mixed Precision Training", section 3.1);
* ``.loss_scaler``: ``DynamicLossScaler``, decision for decision ``torch.amp.GradScaler`` plus
  Megatron-LM's hysteresis and minimum scale (section 3.2), the overflow flag agreed across ranks;
* ``.mixed_precision``: ``MixedPrecision``, what the trainer calls (autocast, scaled backward, the
  checked step).

Gradients in 16 bits on the wire are data parallelism's business: the reduction and its hooks
(``reduce_gradients_``, ``low_precision_all_reduce_``, ``fp32_accumulating_comm_hook``,
``ddp_comm_hook``) live in ``refimpl.parallel.data_parallel.data_parallel_communications``, beside
chapter 03's hooks; import them from there (``parallel`` imports ``precision``, ZeRO-3's ``mp_policy``,
never the other way).
"""

from __future__ import annotations

from refimpl.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleError,
    LossScalerConfig,
    ScalerState,
    overflow_on_any_rank,
    update_scale,
)
from refimpl.precision.master_weights import MasterWeights
from refimpl.precision.mixed_precision import MixedPrecision
from refimpl.precision.policy import (
    DTYPES,
    PRECISIONS,
    MixedPrecisionPolicy,
    compute_dtype_of,
    dtype_from_name,
)

__all__ = [
    "DTYPES",
    "PRECISIONS",
    "DynamicLossScaler",
    "LossScaleError",
    "LossScalerConfig",
    "MasterWeights",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "ScalerState",
    "compute_dtype_of",
    "dtype_from_name",
    "overflow_on_any_rank",
    "update_scale",
]
