"""``--precision fp8``: the model's linear layers get fp8 GEMMs, in place (chapter 10).

torchao's ``convert_to_float8_training`` as torchtitan applies it (its ``Float8Converter``, then
``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` under tensor parallelism): the run keeps bf16
autocast for everything else (``refimpl.precision.MixedPrecisionPolicy`` ``from_name("fp8")`` is
bf16's), and each converted linear runs its three GEMMs in fp8 with dynamic scales
(``refimpl.precision.fp8.float8_linear``: ``x W^T`` e4m3 x e4m3, ``g W`` and ``g^T x`` e5m2 x e4m3 under
the tensorwise recipe; e4m3 and power-of-two per-row scales under rowwise).

What is converted: every linear layer that ``module_filter_fn`` accepts (torchao's ``module_filter_fn``:
visible and changeable; by default the model's declared ``float8_filter``, else every ``nn.Linear``). The
course GPT declares ``seam_layers``, the layers that go through the one linear seam
(``refimpl.nn.linear``), i.e. its dense linears:

* a ``refimpl.nn.Linear`` becomes a ``refimpl.precision.fp8.Float8Linear`` holding the same
  ``weight`` and ``bias`` Parameters (optimizer, state dict and placements see no change);
* a tensor-parallel layer (``ColumnParallelLinear`` / ``RowParallelLinear``: it has ``matmul``,
  ``split_features`` and ``tp_group``) keeps its class and gets the fp8 product as its seam ``matmul``
  (``refimpl.precision.fp8.Float8Matmul``, all three GEMMs, under sequence parallelism and zbh1
  too), with ``refimpl.precision.fp8.sharded_scales.ShardedScales`` over ``tp_group``, so its
  shard is cast with the whole layer's scales, those of one device.

What stays in bf16, each with its reason in the returned ``Float8Conversion``:

* the first and last linear of the plain model (``keep``: the caller takes
  ``refimpl.precision.fp8.convert.first_and_last_linear`` before tensor parallelism replaced the
  modules; Micikevicius et al. 2022, section 4; torchtitan keeps ``output`` in bf16);
* a layer whose weight ``[out, in]`` is not a multiple of 16 in both dims (``torch._scaled_mm`` on CUDA);
  a tensor-parallel shard that is not while its whole layer is, is refused (``ValueError``): skipping it
  on some layouts only would make the run differ from one device's;
* what the filter refuses; for the GPT, what does not go through the seam: torch's own ``nn.Linear`` (a
  mixture-of-experts router's ``gate``, the looped experts) and the grouped experts' 3-D weights (chapter
  09). An MoE model's attention and dense MLPs are converted, its routers and experts are not.
* ``nn.MultiheadAttention``'s ``out_proj`` (its parent reads the weight, never calls the layer).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from torch import nn

from refimpl.nn.linear import Linear
from refimpl.precision.fp8.convert import Float8Conversion
from refimpl.precision.fp8.float8_linear import (
    ALIGN,
    Float8Config,
    Float8Linear,
    Float8Matmul,
)
from refimpl.precision.fp8.scaling import Scaling
from refimpl.precision.fp8.sharded_scales import ShardedScales

__all__ = ["apply_float8_training", "float8_layers", "seam_layers"]


def _is_tensor_parallel(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("matmul", "split_features", "tp_group", "weight"))


def _aligned(out_features: int, in_features: int) -> bool:
    return not (out_features % ALIGN or in_features % ALIGN)


def seam_layers(module: nn.Module, name: str) -> bool:
    """The default filter: the layers of the linear seam (a ``refimpl.nn.Linear`` or a tensor-parallel
    layer); torch's own ``nn.Linear`` (an MoE router's gate) stays in bf16."""
    return _is_tensor_parallel(module) or isinstance(module, Linear)


def _candidate(module: nn.Module) -> bool:
    return _is_tensor_parallel(module) or (isinstance(module, nn.Linear)
                                           and not isinstance(module, Float8Linear))


def apply_float8_training(model: nn.Module, *, scaling: Scaling = "tensorwise", keep: Collection[str] = (),
                          config: Float8Config | None = None,
                          module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                          ) -> Float8Conversion:
    """Give ``model``'s linear layers fp8 GEMMs in place (module docstring), except those named in ``keep``
    (names as in ``model.named_modules()``) and those ``module_filter_fn(module, name)`` refuses
    (torchao's ``module_filter_fn``; None: the model's declared ``float8_filter``, else every linear, an
    ``nn.Linear`` of any kind or a tensor-parallel layer); ``config`` defaults to torchao's recipe named
    ``scaling``. Returns the converted layers' names and each kept layer's reason."""
    config = config if config is not None else Float8Config.recipe(scaling)
    if module_filter_fn is None:
        module_filter_fn = getattr(model, "float8_filter", None)
    report, swaps = Float8Conversion(), []
    for name, module in model.named_modules():
        if not _candidate(module) or isinstance(_parent(model, name), nn.MultiheadAttention):
            continue
        tensor_parallel = _is_tensor_parallel(module)
        whole = (module.out_features, module.in_features)
        if module_filter_fn is not None and not module_filter_fn(module, name):
            report.skipped[name] = "refused by module_filter_fn: kept in bf16"
        elif name in keep:
            report.skipped[name] = "first or last linear layer: kept in bf16"
        elif not _aligned(*whole):
            report.skipped[name] = (f"weight shape [{whole[0]}, {whole[1]}] is not a multiple of {ALIGN} "
                                    "(torch._scaled_mm on CUDA): kept in bf16")
        elif tensor_parallel:
            local = tuple(module.weight.shape)
            if not _aligned(*local):
                raise ValueError(
                    f"--precision fp8: {name}'s tensor-parallel block of its [{whole[0]}, {whole[1]}] weight "
                    f"is [{local[0]}, {local[1]}] on this rank, not a multiple of {ALIGN} (torch._scaled_mm "
                    f"on CUDA); use a --hidden-size whose blocks stay multiples of {ALIGN} or a smaller --tp")
            sharded = ShardedScales(group=module.tp_group, split=module.split_features)
            module.matmul = Float8Matmul(config=config, sharded=sharded)
            report.converted.append(name)
        else:
            swaps.append(name)
            report.converted.append(name)
    for name in swaps:  # after the walk: the walk must not see the new modules
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attribute, Float8Linear.from_linear(getattr(parent, attribute), config=config))
    return report


def _parent(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


def float8_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s layers whose GEMMs run in fp8 (a Float8Linear, or a seam layer whose
    ``matmul`` is the fp8 product): what a test or a log checks after ``apply_float8_training``."""
    def fp8(module: nn.Module) -> bool:
        return isinstance(module, Float8Linear) or isinstance(getattr(module, "matmul", None), Float8Matmul)
    return [name for name, module in model.named_modules() if fp8(module)]
