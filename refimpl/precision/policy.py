"""The mixed-precision policy: the dtypes of the weights, the matmuls and the gradient reduction (chapter 05).

Three dtypes describe a mixed-precision run (the same three as FSDP2's ``MixedPrecisionPolicy``):

* ``param_dtype``: the dtype the model's weights are held in for compute. ``float32`` means the autocast
  path (the weights stay fp32 and ``torch.autocast`` makes a low-precision copy of each for its matmul);
  ``float16``/``bfloat16`` means the master-weights path of Micikevicius et al. 2018 ("Mixed Precision
  Training", section 3.1): the model holds 16-bit copies, the optimizer an fp32 master copy
  (``refimpl.precision.master_weights.MasterWeights``);
* ``compute_dtype``: the dtype of the matrix multiplies (what autocast casts to);
* ``reduce_dtype``: the dtype gradients travel in during the data-parallel all-reduce. A 16-bit
  ``reduce_dtype`` halves the bytes;
  ``refimpl.parallel.data_parallel.data_parallel_communications.reduce_gradients_`` still sums in fp32.

fp16 needs loss scaling (section 3.2; ``refimpl.precision.loss_scaler``), bf16 (fp32's exponent range)
does not.

``--precision fp8`` (chapter 10) is the bf16 policy here (autocast to bf16 over fp32 weights, gradients
reduced in fp32): the fp8 part lives in the linear layers themselves, whose three GEMMs cast their operands
to fp8 with their own scales (``refimpl.precision.fp8.training``, applied by ``parallelize``); what is
not a linear (attention, LayerNorm, the loss, the first and last linear) computes as under bf16.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from refimpl.config import PRECISIONS
from refimpl.precision.loss_scaler import DynamicLossScaler

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}
AUTOCAST_OF: dict[str, str] = {"fp8": "bf16"}  # fp8's policy: bf16 autocast, the fp8 GEMMs in the linears


def compute_dtype_of(precision: str) -> torch.dtype:
    """The dtype a ``--precision`` run computes its activations in (what the planner counts them at):
    fp8's is bf16, the autocast around its fp8 GEMMs (``AUTOCAST_OF``); ``ValueError`` for an unknown
    name."""
    return dtype_from_name(AUTOCAST_OF.get(precision, precision))


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` (a dtype passes through)."""
    if isinstance(name, torch.dtype):
        if name not in _NAMES:
            raise ValueError(f"unsupported dtype {name}; expected one of {list(DTYPES.values())}")
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}")
    return DTYPES[name]


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Parameter, compute and gradient-reduction dtypes of a run; see the module docstring.

    Master weights and optimizer state are always fp32. ``loss_scaling`` is on exactly when something
    computes in fp16.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "reduce_dtype"):
            dtype_from_name(getattr(self, field))
        if self.param_dtype not in (torch.float32, self.compute_dtype):
            raise ValueError(
                f"param_dtype={self.param_dtype} must be float32 (autocast) or equal compute_dtype="
                f"{self.compute_dtype} (16-bit weights with an fp32 master copy)"
            )

    @classmethod
    def from_name(
        cls, name: str, *, master_weights: bool = False, reduce_dtype: str | torch.dtype | None = None
    ) -> MixedPrecisionPolicy:
        """The policy behind ``--precision {fp32,bf16,fp16,fp8}`` (fp8: bf16's, module docstring).

        Default: autocast in ``name`` over fp32 weights, gradients reduced in fp32. ``master_weights``
        keeps the model itself in 16 bits (with an fp32 master copy); ``reduce_dtype`` sends gradients in
        16 bits (summed in fp32).
        """
        compute = dtype_from_name(AUTOCAST_OF.get(name, name) if isinstance(name, str) else name)
        return cls(
            param_dtype=compute if master_weights else torch.float32,
            compute_dtype=compute,
            reduce_dtype=torch.float32 if reduce_dtype is None else dtype_from_name(reduce_dtype),
        )

    @property
    def name(self) -> str:
        return _NAMES[self.compute_dtype]

    @property
    def loss_scaling(self) -> bool:
        """fp16 needs a loss scaler; bf16 (fp32's exponent range) and fp32 do not."""
        return torch.float16 in (self.compute_dtype, self.param_dtype)

    @property
    def master_weights(self) -> bool:
        return self.param_dtype != torch.float32

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """The forward pass's context: ``torch.autocast`` to ``compute_dtype`` on the autocast path.

        A no-op for fp32, and for 16-bit weights (they already compute in 16 bits).
        """
        if self.compute_dtype == torch.float32 or self.master_weights:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.compute_dtype)

    def make_scaler(self, **kwargs: Any) -> DynamicLossScaler | None:
        """A ``DynamicLossScaler`` for fp16, None otherwise (``kwargs`` go to the scaler)."""
        return DynamicLossScaler(**kwargs) if self.loss_scaling else None
