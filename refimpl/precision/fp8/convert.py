"""``convert_to_float8``: swap a model's ``nn.Linear`` layers for ``Float8Linear`` in place (chapter 10).

torchao's ``convert_to_float8_training(model, config=..., module_filter_fn=...)`` walks the model and
replaces every ``nn.Linear`` the filter accepts by its ``Float8Linear``, which keeps the same ``weight``
and ``bias`` Parameter objects: an optimizer built before the swap, the state dict's names and anything
tied to a weight (the GPT's output layer and word embedding) are untouched.

What stays in high precision by default, and why:

* the **first and last** linear layers in the model's order (``first_and_last_linear``). The input
  projection sees the raw embeddings and the last one the logits, whose softmax turns small relative
  errors into large probability errors; both are small parts of the FLOPs of a deep model. torchao's
  examples filter the last layer out (``module_filter_fn``), torchtitan keeps ``output`` in bf16
  (``filter_fqns=["output"]``), Micikevicius et al. 2022 (section 4) keep the first and last layers in
  higher precision;
* layers whose ``in_features`` or ``out_features`` is not a multiple of 16, which ``torch._scaled_mm``
  refuses on CUDA (``refimpl.precision.fp8.float8_linear.check_float8_shape``; torchao's
  ``_auto_filter_for_recipe`` skips them too);
* ``nn.MultiheadAttention``'s ``out_proj`` (``NonDynamicallyQuantizableLinear``): its parent reads
  ``out_proj.weight`` directly and never calls its ``forward``, so a swap would change nothing.

Each skip is reported with its reason (``Float8Conversion``). ``module_filter_fn(module, name)``
(torchao's name), when given, is asked about the layers that pass these checks (name as in
``named_modules``); ``keep_first_last=False`` converts the first and last layers too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from refimpl.precision.fp8.float8_linear import ALIGN, Float8Config, Float8Linear
from refimpl.precision.fp8.scaling import Scaling

__all__ = ["Float8Conversion", "convert_to_float8", "first_and_last_linear"]


@dataclass(kw_only=True)
class Float8Conversion:
    """What ``convert_to_float8`` did: the converted layers' names and each skipped layer's reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and not isinstance(module, Float8Linear)


def _linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """``(name, parent, attribute, layer)`` of every ``nn.Linear`` below ``model``, in module order (a
    layer registered under two names appears under each)."""
    out = []
    for name, module in model.named_modules(remove_duplicate=False):
        if name and _is_linear(module):
            parent_name, _, attribute = name.rpartition(".")
            out.append((name, model.get_submodule(parent_name), attribute, module))
    return out


def first_and_last_linear(model: nn.Module) -> tuple[str, ...]:
    """The names of the first and the last ``nn.Linear`` whose ``forward`` runs (``nn.MultiheadAttention``'s
    ``out_proj`` does not count), in ``model.named_modules()`` order."""
    names = [name for name, parent, _, _ in _linears(model) if not isinstance(parent, nn.MultiheadAttention)]
    return tuple(dict.fromkeys(names[:1] + names[-1:]))


def convert_to_float8(model: nn.Module, *, scaling: Scaling = "tensorwise",
                      config: Float8Config | None = None,
                      module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                      keep_first_last: bool = True) -> Float8Conversion:
    """Swap ``model``'s ``nn.Linear`` layers for ``Float8Linear`` in place (module docstring for what
    is skipped); ``config`` defaults to torchao's recipe named ``scaling``."""
    if _is_linear(model):
        raise ValueError("the model itself is an nn.Linear: nothing holds it to swap it in place; "
                         "use Float8Linear.from_linear(model)")
    config = config if config is not None else Float8Config.recipe(scaling)
    ends = first_and_last_linear(model) if keep_first_last else ()
    report = Float8Conversion()
    swaps = []
    for name, parent, attribute, linear in _linears(model):
        reason = _skip_reason(linear, name, parent, ends, module_filter_fn)
        if reason is None:
            swaps.append((parent, attribute, linear))
            report.converted.append(name)
        else:
            report.skipped[name] = reason
    for parent, attribute, linear in swaps:  # after the walk: the walk must not see the new modules
        setattr(parent, attribute, Float8Linear.from_linear(linear, config=config))
    return report


def _skip_reason(linear: nn.Linear, name: str, parent: nn.Module, ends: tuple[str, ...],
                 module_filter_fn: Callable[[nn.Module, str], bool] | None) -> str | None:
    if isinstance(parent, nn.MultiheadAttention):
        return "read directly by nn.MultiheadAttention (its forward is never called)"
    if linear.in_features % ALIGN or linear.out_features % ALIGN:
        return (f"weight shape [{linear.out_features}, {linear.in_features}] is not a multiple of {ALIGN} "
                "(torch._scaled_mm on CUDA)")
    if name in ends:
        return "first or last linear layer: kept in high precision"
    if module_filter_fn is not None and not module_filter_fn(linear, name):
        return "refused by module_filter_fn"
    return None
