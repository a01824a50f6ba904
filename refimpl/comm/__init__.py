"""Communication, made visible: traced ``torch.distributed`` calls and collectives built from point-to-point.

* :mod:`refimpl.comm.ops`: the calls refimpl makes, recorded by a tracer when one is active;
* :mod:`refimpl.comm.tracer`: :class:`CommTracer`, the record of every call (chapter 02): payload and
  point-to-point bytes measured, the wire bytes of ``torch.distributed`` collectives modelled (ring);
* :mod:`refimpl.comm.ring`: ring reduce-scatter / all-gather / all-reduce from ``isend``/``irecv``, and the
  naive all-reduce through rank 0 they beat (chapter 02);
* :mod:`refimpl.comm.cost_model`: measured latency and bandwidth, the alpha-beta model (chapter 02);
* :mod:`refimpl.comm.pictures`: who holds what before/after a collective, and a timeline of traced events.
"""

from refimpl.comm.cost_model import AlphaBeta, Timings, fit_alpha_beta, measure_collective, measure_p2p
from refimpl.comm.pictures import plot_timeline, plot_who_holds_what
from refimpl.comm.ring import (
    chunk_sizes,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_bytes_sent,
    ring_reduce_scatter,
)
from refimpl.comm.tracer import CommEvent, CommTracer, OpTotal, wire_bytes

__all__ = [
    "AlphaBeta",
    "CommEvent",
    "CommTracer",
    "OpTotal",
    "Timings",
    "chunk_sizes",
    "fit_alpha_beta",
    "measure_collective",
    "measure_p2p",
    "naive_all_reduce",
    "plot_timeline",
    "plot_who_holds_what",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_bytes_sent",
    "ring_reduce_scatter",
    "wire_bytes",
]
