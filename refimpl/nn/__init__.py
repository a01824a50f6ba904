"""Layers below the parallel techniques: the one linear seam (``refimpl.nn.linear``)."""

from refimpl.nn.linear import Linear, SequenceGather, linear_with_grad

__all__ = ["Linear", "SequenceGather", "linear_with_grad"]
