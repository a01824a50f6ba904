"""A step's time on a link: its compute plus the communication nothing hides (chapters 03 and 04), the
planner's time model, checked against the shaped link (``refimpl.parallel.overlap``,
tests/ranks/cli/test_overlap.py).

A step is a **program**, its operations in the order the rank issues them: ``Compute`` pieces (seconds:
FLOPs over the rate the cores reach) and ``Collective`` s (seconds: their bytes over the link). Two
streams run it, as on a GPU (the compute stream and NCCL's) or on the CPU behind a slow link (the cores
and gloo's thread):

* the compute runs its pieces in order; a piece that reads a collective's result (``needs``) waits for it;
* each collective starts once the program has reached it and the link is free (one at a time, in issue
  order), and lasts ``seconds``; a ``blocking`` one (waited for as soon as it is issued, e.g. ZeRO-3's
  reduce-scatter inside backward) stops the compute until it is done;
* the step ends when both streams are done (the last collectives are waited for at its end).

``schedule(program)`` gives the ``StepTime``: the total, the compute, the communication and, per collective,
the part of it during which no compute ran (``exposed``): the rest is what the model **assumes hidden**.
``serialized=True`` is the control every overlap of the course is timed against (``wait()`` before the
compute the transfer could hide behind): every collective blocking, ``T = sum compute + sum comm``.

The link: ``link_seconds``. A collective in which each of ``n`` ranks sends ``B`` bytes (the ring model,
``refimpl.planner.communication.wire_bytes``) takes ``B / rate`` where each rank has its own link (GPUs on
NVLink or one NIC each), and ``n B / rate`` behind the course's shaped loopback, one queue every rank's
traffic crosses (``refimpl.launch.shaped_link``): two ranks all-reducing 16 MB at 400 Mbit/s take
``2 x 16 MB x 8 / 4e8 = 0.64 s`` there.

The programs of two layouts, as the course's overlap workers run them: ``data_parallel_program`` (the
bucketed all-reduce launched from the gradient hook, chapter 03) and ``zero3_program`` (ZeRO-3's
all-gathers with and without prefetch, its reduce-scatters blocking in backward, chapter 04);
``layer_stack_step`` predicts both variants of a worker of ``refimpl.parallel.overlap`` from its shapes,
its measured compute and the link's rate. Measured against the shaped link in tests/ranks/cli/test_overlap.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from refimpl.comm.tracer import wire_bytes

__all__ = ["WIRE_OP", "Collective", "Compute", "StepTime", "data_parallel_program", "layer_stack_step",
           "link_seconds", "prediction_error", "schedule", "zero3_program"]


@dataclass(frozen=True, kw_only=True)
class Compute:
    """A piece of the compute stream: ``seconds``, after the collectives it reads (``needs``, by name)."""

    name: str
    seconds: float
    needs: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Collective:
    """A transfer on the link: ``seconds`` of it; ``blocking``: waited for as soon as it is issued."""

    name: str
    seconds: float
    blocking: bool = False


Program = Sequence[Compute | Collective]


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """What ``schedule`` predicts: ``seconds`` in all, of which ``compute_s`` compute; ``comm_s`` the
    collectives' time on the link; ``exposed`` each collective's seconds during which no compute ran (the
    part the step waits for), by name; ``hidden`` the collectives the model assumes entirely hidden."""

    seconds: float
    compute_s: float
    comm_s: float
    exposed: dict[str, float] = field(default_factory=dict)

    @property
    def exposed_s(self) -> float:
        return self.seconds - self.compute_s

    @property
    def hidden(self) -> tuple[str, ...]:
        return tuple(name for name, s in self.exposed.items() if s <= 1e-12)


def link_seconds(bytes_per_rank: float, *, ranks: int, rate_bits_per_s: float, shared: bool) -> float:
    """Seconds of a collective in which each of ``ranks`` sends ``bytes_per_rank``, at ``rate`` per link;
    ``shared``: one link for all of them (the shaped loopback), else one each (module docstring)."""
    return bytes_per_rank * (ranks if shared else 1) * 8 / rate_bits_per_s


def schedule(program: Program, *, serialized: bool = False) -> StepTime:
    """The two-stream schedule of ``program`` (module docstring); ``serialized``: every collective
    blocking."""
    cpu = link = 0.0  # when the compute stream, the link are next free
    ends: dict[str, float] = {}
    busy: list[tuple[float, float]] = []  # the compute's intervals
    spans: dict[str, tuple[float, float]] = {}
    for op in program:
        if isinstance(op, Collective):
            start = max(cpu, link)
            link = ends[op.name] = start + op.seconds
            spans[op.name] = (start, link)
            if op.blocking or serialized:
                cpu = link
        else:
            start = max([cpu, *(ends[n] for n in op.needs)])
            cpu = start + op.seconds
            busy.append((start, cpu))
    total = max(cpu, link)
    exposed = {name: (b - a) - sum(max(0.0, min(b, e) - max(a, s)) for s, e in busy)
               for name, (a, b) in spans.items()}
    return StepTime(seconds=total, compute_s=sum(e - s for s, e in busy),
                    comm_s=sum(b - a for a, b in spans.values()), exposed=exposed)


def data_parallel_program(*, forward_s: Sequence[float], backward_s: Sequence[float],
                          all_reduce_s: Sequence[float]) -> list[Compute | Collective]:
    """Data parallelism with one bucket per layer (chapter 03): the forward of every layer, then each
    layer's backward, last layer first, its bucket's all-reduce launched from the gradient hook as soon as
    it ends and waited for at the end of backward. Per layer, in forward order: its forward, backward and
    all-reduce seconds."""
    program: list[Compute | Collective] = [Compute(name=f"F{i}", seconds=s) for i, s in enumerate(forward_s)]
    for i in reversed(range(len(backward_s))):
        program += [Compute(name=f"B{i}", seconds=backward_s[i]),
                    Collective(name=f"all-reduce {i}", seconds=all_reduce_s[i])]
    return program


def zero3_program(*, forward_s: Sequence[float], backward_s: Sequence[float], all_gather_s: Sequence[float],
                  reduce_scatter_s: Sequence[float], prefetch: bool) -> list[Compute | Collective]:
    """ZeRO-3 with one unit per layer (chapter 04, ``refimpl.parallel.zero.FullyShardedDataParallel``):
    each unit all-gathered before its forward and again before its backward (last unit first), its
    gradients reduce-scattered as soon as its backward ends (blocking). With ``prefetch`` the next unit's
    all-gather is issued as soon as the current one is in, before the current unit computes; without, each
    is issued when it is needed."""
    n = len(forward_s)
    program: list[Compute | Collective] = []
    for phase, order in (("F", list(range(n))), ("B", list(range(n - 1, -1, -1)))):
        for k, i in enumerate(order):
            gather = f"all-gather {phase}{i}"
            if not prefetch or k == 0:
                program.append(Collective(name=gather, seconds=all_gather_s[i]))
            if prefetch and k + 1 < len(order):  # the next unit's, behind this unit's compute
                program.append(Collective(name=f"all-gather {phase}{order[k + 1]}",
                                          seconds=all_gather_s[order[k + 1]]))
            if phase == "F":
                program.append(Compute(name=f"F{i}", seconds=forward_s[i], needs=(gather,)))
            else:
                program += [Compute(name=f"B{i}", seconds=backward_s[i], needs=(gather,)),
                            Collective(name=f"reduce-scatter {i}", seconds=reduce_scatter_s[i],
                                       blocking=True)]
    return program


# What a backend runs for an op where it is not the ring: gloo (torch 2.13) has no reduce-scatter of its
# own and sends an all-reduce's bytes for one (measured on the 1 Gbit/s shaped link, 2 ranks, 4 MiB:
# reduce_scatter_tensor 69.7 ms, all_reduce 68.6 ms, all_gather_into_tensor 35.8 ms; the ring model
# gives 67.1, 33.6 and 33.6)
WIRE_OP = {"gloo": {"reduce_scatter": "all_reduce"}}


def layer_stack_step(layout: str, *, layers: int, width: int, compute_s: float, rate_bits_per_s: float,
                     ranks: int = 2, element_size: int = 4, shared_link: bool = True,
                     backend: str = "gloo") -> dict[str, StepTime]:
    """The overlapped and the serialized step of a stack of ``layers`` bias-free ``Linear(width, width)``
    trained on ``ranks`` under ``layout`` ``"dp"`` (one bucket per layer, ``data_parallel_program``) or
    ``"zero3"`` (one unit per layer, ``zero3_program``; serialized: without prefetch), as the workers of
    ``refimpl.parallel.overlap`` run them. ``compute_s``: the step without communication (measured), split
    by FLOPs: a layer's forward ``2 r w^2`` for ``r`` rows, its backward twice that, the first layer's once
    (its input needs no gradient), so ``F = 1``, ``B = 2`` (first ``1``) of ``3 L - 1`` units. A tensor's
    collectives move its ``w^2`` elements (``wire_bytes`` per rank of the op ``backend`` runs,
    ``WIRE_OP``; ``link_seconds`` on the link)."""
    unit = compute_s / (3 * layers - 1)
    forward, backward = [unit] * layers, [unit] + [2 * unit] * (layers - 1)
    nbytes = width * width * element_size

    def on_link(op: str) -> list[float]:
        sent = wire_bytes(WIRE_OP.get(backend, {}).get(op, op), nbytes, ranks)
        return [link_seconds(sent, ranks=ranks, rate_bits_per_s=rate_bits_per_s, shared=shared_link)] * layers

    if layout == "dp":
        program = data_parallel_program(forward_s=forward, backward_s=backward,
                                        all_reduce_s=on_link("all_reduce"))
        return {"overlapped": schedule(program), "serialized": schedule(program, serialized=True)}
    if layout == "zero3":
        terms = {"forward_s": forward, "backward_s": backward, "all_gather_s": on_link("all_gather"),
                 "reduce_scatter_s": on_link("reduce_scatter")}
        return {"overlapped": schedule(zero3_program(**terms, prefetch=True)),
                "serialized": schedule(zero3_program(**terms, prefetch=False))}
    raise ValueError(f"layout {layout!r}: 'dp' or 'zero3'")


def prediction_error(predicted: dict[str, StepTime], measured: dict[str, float]) -> dict[str, float]:
    """Each predicted variant's relative error against its measured seconds: ``predicted / measured - 1``."""
    return {k: predicted[k].seconds / measured[k] - 1 for k in predicted}
