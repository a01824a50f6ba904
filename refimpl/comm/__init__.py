"""Communication, made visible: traced ``torch.distributed`` calls and collectives built from point-to-point.

* :mod:`refimpl.comm.ops`: the calls refimpl makes, recorded by a tracer when one is active;
* :mod:`refimpl.comm.tracer`: :class:`CommTracer`, the record of every call (chapter 02).
"""

from refimpl.comm.tracer import CommEvent, CommTracer, OpTotal, wire_bytes

__all__ = ["CommEvent", "CommTracer", "OpTotal", "wire_bytes"]
