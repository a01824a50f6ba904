"""The device lint: what CUDA and NCCL would refuse, found on a CPU run over gloo (``REFIMPL_DEVICE_LINT=1``).

On a laptop every tensor lives on the CPU and gloo takes them all, so code that will fail on the first
GPU run passes every CPU test. The lint runs the code under two modes of torch's own extension points and
checks, on the CPU, the rules that CUDA and NCCL impose (docs/ARCHITECTURE.md, "GPUs"; README, "Running
on GPUs"):

- **host tensors** (``torch.overrides.TorchFunctionMode``): a tensor made by a factory without
  ``device=`` (``torch.tensor``, ``torch.zeros``, ``torch.from_numpy``, ...: on a GPU run it lands on the
  CPU), made with ``device="cpu"``, or moved by ``.cpu()`` / ``.to("cpu")`` is *tagged* with the place
  that made it; a result all of whose tensor inputs are tagged is tagged too (CPU in, CPU out), one with an
  untagged (device) input is not. ``device=<a torch.device>`` and ``.to(<a torch.device>)`` count as the
  run's device: on a CPU run ``ctx.device`` *is* the CPU, and the lint cannot tell it from ``cuda:0``;
- **collectives** (``torch.utils._python_dispatch.TorchDispatchMode``, which sees every ``c10d`` and
  ``_c10d_functional`` op whatever called it): a tagged tensor on a group other than a private one
  (``PRIVATE_GROUP_DESC``, e.g. the checkpointer's gloo group) is refused (NCCL: "No backend type
  associated with device type cpu"); so is a non-contiguous tensor, and a float8 tensor in a reduction;
- **fp8 GEMMs**: ``torch._scaled_mm`` as sm90 takes it: ``a`` row-major, ``b`` column-major, K and N
  multiples of 16, float32 scales, both 0-d/one element (tensorwise) or ``[M, 1]`` and ``[1, N]``
  contiguous (rowwise), not e5m2 x e5m2;
- **grouped GEMMs** (both rules in ``refimpl.distributed.kernel_rules``): ``torch._grouped_mm`` as CUDA
  takes it: operands in autocast's dtype under autocast
  (autocast does not cast it), 16-byte aligned data and strides, int32 offsets (outside autocast CUDA
  takes other dtypes on a per-group fallback that reads the offsets on the host; refimpl's experts loop
  over the experts themselves there, on a GPU only, so the lint does not count it);
- **host syncs**: every call that makes the CPU wait for the device on a GPU (``item``, ``tolist``,
  ``bool``/``int``/``float`` of a tensor, ``.cpu()``, ``numpy``, ``nonzero``, a boolean-mask index, ...:
  ``refimpl.distributed.host_syncs.sync_name``, forward and backward)
  on an untagged tensor is counted (not inside torch's object collectives: host pickles), per step when
  the lint is the trainer's hooks (``DeviceLint.before_step``); host tensors cost no sync.

``REFIMPL_DEVICE_LINT=1`` in the environment turns it on for ``python -m refimpl.train`` (the whole run,
setup included) and for the notebooks' rank engines (every ``%%px`` cell); a violation raises
``DeviceLintError`` at the call, as CUDA would, with the place that made the tensor. In code::

    with DeviceLint() as lint:          # raise_at_once=False: collect instead
        train(config, ctx, options, hooks=lint)
    lint.steps_syncs                    # host syncs of each step

What it cannot see: code that sets ``torch.set_default_device``; a tensor moved with ``.to(t.device)``
where ``t`` is itself a host tensor; C++ code that makes host tensors (none of torch's collectives does).
It is an emulation: a clean lint makes a first GPU run likely, not certain (bench/gpu/check.py is the
check on a GPU).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from refimpl.distributed.host_syncs import MAY_SYNC, sync_name
from refimpl.distributed.kernel_rules import autocast_dtype, grouped_mm_problems, scaled_mm_problems

__all__ = ["DEVICE_LINT_ENV", "PRIVATE_GROUP_DESC", "DeviceLint", "DeviceLintError", "Violation",
           "device_lint_enabled", "private_group"]

DEVICE_LINT_ENV = "REFIMPL_DEVICE_LINT"
PRIVATE_GROUP_DESC = "refimpl_private_gloo"
"""The ``group_desc`` of a gloo group that takes host tensors on purpose (made by ``private_group``)."""

_TAG = "_refimpl_host_origin"  # attribute a host tensor carries: where it was made
_FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
_REDUCTIONS = {"allreduce_", "allreduce_coalesced_", "reduce_", "reduce_scatter_", "_reduce_scatter_base_",
               "reduce_scatter_tensor_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
               "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"}
_SYNC_METHODS = {"tolist", "numpy", "cpu"}  # host reads that do not reach the dispatcher on a CPU tensor
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}  # _c10d_functional ops that take no group
_SHAPE_OF_OTHER = {"view_as", "reshape_as", "expand_as"}
_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
         "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}


def device_lint_enabled() -> bool:
    """Whether ``REFIMPL_DEVICE_LINT`` asks for the lint (any value but empty or 0)."""
    return os.environ.get(DEVICE_LINT_ENV, "0") not in ("", "0")


def private_group(ranks: list[int] | None = None, **kwargs: Any):
    """A gloo group for host-side control traffic (``dist.new_group(backend="gloo")``) that the lint lets
    take host tensors: the one kind of group that does so on a GPU run too."""
    return dist.new_group(ranks, backend="gloo", group_desc=PRIVATE_GROUP_DESC, **kwargs)


class DeviceLintError(RuntimeError):
    """A call that CUDA or NCCL would refuse (the message names the rule, the op and where the tensor was
    made)."""


@dataclass(frozen=True, kw_only=True)
class Violation:
    """One refused call: ``rule`` (host-tensor, contiguity, float8-reduction, scaled-mm, grouped-mm),
    ``op`` (the torch op), ``detail`` and ``origin`` (file:line that made the host tensor, or called)."""

    rule: str
    op: str
    detail: str
    origin: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.op}: {self.detail} (at {self.origin})"


def _caller() -> str:
    """file:line of the first frame outside torch and this module (where the user's code made the call)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and name != __file__ and "contextlib" not in name:
            return f"{os.path.relpath(name) if name.startswith(os.getcwd()) else name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _in_object_collective() -> bool:
    """Whether torch's object collectives (``all_gather_object``, ...) are making the tensor: they pickle into
    a host tensor and move it to the group's device themselves (``torch.cuda.current_device()`` on NCCL)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.endswith("overrides.py")):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.endswith("distributed_c10d.py")


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _flat(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments and in their lists and tuples, one level down (fast: the lint
    runs this on every torch call)."""
    found = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += [b for b in a if isinstance(b, torch.Tensor)]
    return found


def _tag(out: Any, origin: str) -> None:
    for t in _tensors(out):
        try:
            setattr(t, _TAG, origin)
        except (AttributeError, RuntimeError):  # a tensor subclass without __dict__
            pass


def _untag(out: Any) -> None:
    for t in _tensors(out):
        if getattr(t, _TAG, None) is not None:
            setattr(t, _TAG, None)


def origin_of(t: torch.Tensor) -> str | None:
    """Where a host tensor was made (file:line), None for a tensor on the run's device."""
    return getattr(t, _TAG, None)


def _names_host(device: Any) -> bool:
    """A ``device=`` argument that names the CPU in so many words (a string): a ``torch.device`` object is
    taken for the run's device (module docstring)."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


class _HostTensors(TorchFunctionMode):
    """Tags host tensors, counts the host reads that bypass the dispatcher on CPU (``tolist``, ``numpy``,
    ``cpu``) and checks the grouped GEMMs (module docstring)."""

    def __init__(self, lint: DeviceLint) -> None:
        super().__init__()
        self.lint = lint
        self.names: dict[Any, str] = {}  # torch function -> its name (asked on every call)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload):  # an aten op the dispatch mode below re-dispatches (its
            return func(*args, **kwargs)            # factories run below the user's call, on its device)
        name = self.names.get(func)
        if name is None:
            name = self.names[func] = getattr(func, "__name__", "") or str(func)
        if name == "__get__":  # an attribute (shape, dtype, grad, ...): nothing made, nothing waited for
            return func(*args, **kwargs)
        inputs = _flat(args, kwargs)
        if name in _SYNC_METHODS and origin_of(inputs[0]) is None and not _in_object_collective():
            self.lint.count_sync(f"{name} at {_caller()}")
        if name == "_grouped_mm":  # here, above autocast's dispatch key, autocast's state is visible
            self._grouped_mm(args, kwargs)
        out = func(*args, **kwargs)
        if not isinstance(out, (torch.Tensor, list, tuple)):
            return out
        if name == "cpu" or (name == "to" and _names_host(_to_device(args, kwargs))):
            if not _in_object_collective():
                if isinstance(out, torch.Tensor) and any(out is t for t in inputs):
                    out = out.clone()  # a copy, as from a GPU (on the CPU it returns the tensor itself)
                _tag(out, _caller())
        elif name == "cuda" or (name == "to" and _to_device(args, kwargs) is not None):
            _untag(out)  # on the run's device now (on a CPU run ``to(ctx.device)`` returns the tensor itself)
        elif not any(out is t for t in inputs):  # in place, or self: keeps its own tag
            self._classify(name, kwargs, inputs, out)
        return out

    def _grouped_mm(self, args, kwargs) -> None:
        a, b = args[0], args[1]
        for problem in grouped_mm_problems(a, b, _arg(args, kwargs, 2, "offs"), autocast=autocast_dtype(a)):
            self.lint.flag("grouped-mm", "torch._grouped_mm", problem, _caller())

    def _classify(self, name: str, kwargs, inputs: list[torch.Tensor], out) -> None:
        device = kwargs.get("device")
        if not inputs or (name in _LIKE and "device" in kwargs):
            if (device is None or _names_host(device)) and not _in_object_collective():
                _tag(out, _caller())  # made on the default device: the CPU
        elif name in _SHAPE_OF_OTHER:  # the other tensor gives only a shape: the result stays where self is
            if origin_of(inputs[0]) is not None:
                _tag(out, origin_of(inputs[0]) or "?")
        elif all(origin_of(t) is not None for t in inputs):
            _tag(out, origin_of(inputs[0]) or "?")


def _to_device(args, kwargs) -> Any:
    """The device of a ``Tensor.to`` call, or None (a dtype-only ``to``)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return a
    return None


class _Collectives(TorchDispatchMode):
    """Checks every ``c10d`` / ``_c10d_functional`` op and the fp8 GEMMs, counts the ops that wait for the
    device (module docstring)."""

    def __init__(self, lint: DeviceLint) -> None:
        super().__init__()
        self.lint = lint
        self.kinds: dict[Any, str] = {}  # op -> "collective", "scaled_mm", "sync" or "" (asked on every op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = _kind(func)
        if kind == "":
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if kind == "collective":
            self._collective(name, args)
        elif kind == "scaled_mm":
            for problem in scaled_mm_problems(*args[:4]):
                self.lint.flag("scaled-mm", "torch._scaled_mm", problem, _caller())
        else:
            self._sync(func, args, kwargs)
        return func(*args, **kwargs)

    def _sync(self, func, args, kwargs) -> None:
        """An op that waits for the device (``refimpl.distributed.host_syncs.sync_name``: ``item``,
        ``bool``, ``nonzero``, a boolean mask, ...) on a device tensor: counted. Not here: a tensor made
        from Python data (a copy to the device, no read) and a copy to the CPU (``.cpu()`` and
        ``.to("cpu")`` are counted where they are called: on a CPU run ``to(ctx.device)`` copies "to the
        CPU" too)."""
        what = sync_name(func, args, kwargs)
        first = next(iter(_flat(args, {})), None)
        if (what is not None and what not in ("host tensor", "to cpu") and first is not None
                and origin_of(first) is None and not _in_object_collective()):
            self.lint.count_sync(f"{what} at {_caller()}")

    def _collective(self, name: str, args) -> None:
        tensors = list(_tensors(args))
        if not tensors or _is_private(args):
            return
        for t in tensors:
            where = origin_of(t)
            if where is not None:
                self.lint.flag("host-tensor", name, f"a CPU tensor {tuple(t.shape)} {t.dtype} on a device "
                               "group (make it with device=ctx.device)", where)
            elif not t.is_contiguous():
                self.lint.flag("contiguity", name, f"a non-contiguous tensor {tuple(t.shape)}", _caller())
            elif t.dtype in _FLOAT8 and name in _REDUCTIONS:
                self.lint.flag("float8-reduction", name, f"a {t.dtype} reduction (NCCL cannot sum float8; "
                               "gather the bytes, reduce in float32)", _caller())


def _kind(func: Any) -> str:
    namespace, name = func.namespace, func._schema.name.split("::")[-1]
    if namespace == "c10d" or (namespace == "_c10d_functional" and name not in _NOT_COLLECTIVES):
        return "collective"
    if name == "_scaled_mm":
        return "scaled_mm"
    return "sync" if func.overloadpacket in MAY_SYNC else ""


def _arg(args, kwargs, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _is_private(args) -> bool:
    """Whether the op's process group is a private gloo group (``private_group``)."""
    for a in args:
        group = None
        if type(a).__name__ == "ScriptObject":
            try:
                group = dist.ProcessGroup.unbox(a)
            except RuntimeError:  # a ReduceOp or other boxed argument
                continue
        elif isinstance(a, str):  # _c10d_functional's group name (its reduce op, "sum", resolves to none)
            try:
                group = dist.distributed_c10d._resolve_process_group(dist.distributed_c10d.GroupName(a))
            except (ValueError, RuntimeError, KeyError):
                continue
        if group is not None:
            return group.group_desc == PRIVATE_GROUP_DESC
    return False


class DeviceLint:
    """The lint as a context manager (module docstring) and as the trainer's hooks (``before_step``).

    ``raise_at_once``: raise ``DeviceLintError`` at the first violation (as CUDA would), or collect
    them all in ``violations`` (each place once). ``syncs``: host syncs counted so far; ``steps_syncs``:
    those of each trainer step when the lint is the trainer's hooks (``before_step``)."""

    # the trainer's other points (refimpl.train.hooks.Hooks): not the lint's
    around_step = after_first_forward = after_first_loss = before_optimizer_step = gradient_probe = None
    after_gradient_probe = before_checkpoint = on_failure = clock = None

    def __init__(self, *, raise_at_once: bool = True) -> None:
        self.raise_at_once = raise_at_once
        self.violations: list[Violation] = []
        self.syncs = 0
        self.sync_sites: Counter[str] = Counter()
        self.steps_syncs: list[int] = []
        self._stack: ExitStack | None = None
        self._step_start: int | None = None

    def count_sync(self, site: str) -> None:
        """One host sync, at ``site`` ("item at refimpl/train/loop.py:190"): counted in ``syncs`` and
        ``sync_sites``."""
        self.syncs += 1
        self.sync_sites[site] += 1

    def flag(self, rule: str, op: str, detail: str, origin: str) -> None:
        violation = Violation(rule=rule, op=op, detail=detail, origin=origin)
        if violation in self.violations:
            return
        self.violations.append(violation)
        if self.raise_at_once:
            raise DeviceLintError(f"device lint: {violation} (REFIMPL_DEVICE_LINT; README, Running on GPUs)")

    def __enter__(self) -> DeviceLint:
        self._stack = ExitStack()
        self._stack.enter_context(_HostTensors(self))
        self._stack.enter_context(_Collectives(self))
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None
        self._close_step()
        self._stack.close()
        self._stack = None

    @property
    def before_step(self) -> Callable[[int, Any], None]:
        """The trainer's ``before_step`` hook: closes the previous step's count of host syncs (a step runs
        from one ``before_step`` to the next: its forwards, backwards, optimizer step, loss and record, and
        a checkpoint when one is due; the last step is closed when the lint exits)."""

        def mark(step: int, setup: Any) -> None:
            self._close_step()
            self._step_start = self.syncs

        return mark

    def _close_step(self) -> None:
        if self._step_start is not None:
            self.steps_syncs.append(self.syncs - self._step_start)
            self._step_start = None

    def report(self) -> str:
        """One line per violation, and the host syncs per step."""
        lines = [f"device lint: {len(self.violations)} violation(s)", *map(str, self.violations)]
        if self.steps_syncs:
            lines.append(f"host syncs per step: {self.steps_syncs}; where (all steps):")
            lines += [f"  {n} x {site}" for site, n in self.sync_sites.most_common()]
        return "\n".join(lines)
