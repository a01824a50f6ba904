"""What one rank of ring attention did when (chapter 07): compute and transfer spans of each ring step.

Ring attention (Liu et al. 2023) hides the K/V transfer of step ``k + 1`` behind the attention of the block
of step ``k``: at each step a rank posts the exchange (``refimpl.parallel.context_parallel.
context_parallel_communications.ring_exchange``), computes with the block it holds, then waits. Pass a
``RingTimeline`` to ``refimpl.parallel.context_parallel.ring_attention.ring_attention``
(``timeline=``) and its forward records, per step, the compute span (the blocks' attention and merge) and the
transfer span (from posting the exchange to the end of its ``wait``), in seconds of the clock of
``refimpl.comm.CommTracer`` (``refimpl.comm.tracer.now``). The exposed transfer of a step is the part
of its span after its compute ended: what the overlap did not hide.

On CUDA a span's ends are events on the current stream, not CPU times: the attention's kernels are launched
and return before they ran, and NCCL's ``wait()`` only makes the stream wait for the exchange, so the
transfer's end completes when both the exchange and the step's compute are done. A span holds the stamps
and reads them as seconds (``refimpl.comm.device_clock.StampField``), after one synchronize at the
first read (after the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refimpl.comm.device_clock import Stamp, StampField

__all__ = ["RingSpan", "RingTimeline"]


@dataclass(frozen=True, kw_only=True)
class RingSpan:
    """One span: ``kind`` ``"compute"`` or ``"transfer"`` of ring step ``step``, from ``start`` to ``end``
    (stamps, read as seconds)."""

    kind: str
    step: int
    start: StampField[float] = StampField()
    end: StampField[float] = StampField()


@dataclass
class RingTimeline:
    """The spans one rank recorded in one ring-attention forward (``spans``, in the order they ended)."""

    spans: list[RingSpan] = field(default_factory=list)

    def add(self, kind: str, step: int, start: Stamp, end: Stamp) -> None:
        if kind not in ("compute", "transfer"):
            raise ValueError(f"a ring span is 'compute' or 'transfer', got {kind!r}")
        self.spans.append(RingSpan(kind=kind, step=step, start=start, end=end))

    def of(self, kind: str) -> list[RingSpan]:
        return [s for s in self.spans if s.kind == kind]

    def exposed_transfer_seconds(self) -> float:
        """Transfer time not hidden by the compute of the same step (after that compute ended)."""
        done = {s.step: s.end for s in self.of("compute")}
        return sum(max(0.0, s.end - max(s.start, done.get(s.step, s.start))) for s in self.of("transfer"))
