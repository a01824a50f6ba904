"""Communication, made visible: traced ``torch.distributed`` calls and collectives built from point-to-point.

* ``refimpl.comm.ops``: the calls refimpl makes, recorded by a tracer when one is active;
* ``refimpl.comm.tracer``: ``CommTracer``, the record of every call (chapter 02): payload and
  point-to-point bytes measured, the wire bytes of ``torch.distributed`` collectives modelled (ring);
* ``refimpl.comm.ring``: ring reduce-scatter / all-gather / all-reduce from ``isend``/``irecv``, and the
  naive all-reduce through rank 0 they beat (chapter 02);
* ``refimpl.comm.pictures``: who holds what before/after a collective, and a timeline of traced events.

Measured latency and bandwidth are in ``refimpl.measure.collective_timing``, the alpha-beta model fitted
to them and the exact ring byte counts in ``refimpl.planner`` (chapter 02).
"""

from refimpl.comm.pictures import plot_timeline, plot_who_holds_what
from refimpl.comm.ring import (
    chunk_sizes,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from refimpl.comm.tracer import CommEvent, CommTracer, OpTotal, wire_bytes

__all__ = [
    "CommEvent",
    "CommTracer",
    "OpTotal",
    "chunk_sizes",
    "naive_all_reduce",
    "plot_timeline",
    "plot_who_holds_what",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "wire_bytes",
]
