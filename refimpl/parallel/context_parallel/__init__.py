"""Context parallelism: the sequence split across ranks, attention computed across them (chapter 07).

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"; the zig-zag
(load-balanced) split of Megatron-LM's context parallelism and Llama 3 for the causal balance; Jacobs et al.
2023, "DeepSpeed Ulysses" (all-to-all sequence parallelism). One concept per file:

* ``refimpl.parallel.context_parallel.context_parallel_communications``: the ring's K/V exchange with
  plain ``isend`` / ``irecv`` (through ``refimpl.comm.ops``, so the tracer sees them);
* ``refimpl.parallel.context_parallel.sequence_layout``: which chunks of the sequence a rank holds, the
  contiguous and the zig-zag (causal balance) layouts, and the causal work per rank;
* ``refimpl.parallel.context_parallel.ring_attention``: ring attention as an autograd Function, partial
  outputs merged by their log-sum-exp, backward a ring too;
* ``refimpl.parallel.context_parallel.ring_timeline``: the compute and transfer spans of each ring step
  (the overlap, drawn in the chapter);
* ``refimpl.parallel.context_parallel.ulysses``: the all-to-all that turns sequence shards into head
  shards and back;
* ``refimpl.parallel.context_parallel.context_parallel``: ``apply_context_parallel`` for refimpl's
  GPT (attention across the ranks, positions and tokens following the split).

``refimpl.parallel.parallelize.parallelize`` applies it as its step 2 (after tensor parallelism, before
the ``dp x cp`` data-parallel wrapper); the trainer's ``--cp N --cp-method {ring,ulysses}`` runs it.
"""

from __future__ import annotations

from refimpl.parallel.context_parallel.context_parallel import (
    METHODS,
    apply_context_parallel,
    split_for_context_parallel,
)
from refimpl.parallel.context_parallel.context_parallel_communications import RingTransfer, ring_exchange
from refimpl.parallel.context_parallel.ring_attention import merge_partial_attention
from refimpl.parallel.context_parallel.ring_timeline import RingSpan, RingTimeline
from refimpl.parallel.context_parallel.sequence_layout import (
    LAYOUTS,
    causal_work,
    gather_sequence,
    sequence_positions,
    split_sequence,
    zigzag_gather,
    zigzag_split,
)
from refimpl.parallel.context_parallel.ulysses import heads_to_sequence, sequence_to_heads, ulysses_attention

# The function ring_attention is not re-exported here: the name is its module's, and
# ``import refimpl.parallel.context_parallel.ring_attention as ra`` must keep giving the module. Use
# ``from refimpl.parallel.context_parallel.ring_attention import ring_attention``.

__all__ = [
    "LAYOUTS",
    "METHODS",
    "RingSpan",
    "RingTimeline",
    "RingTransfer",
    "apply_context_parallel",
    "causal_work",
    "gather_sequence",
    "heads_to_sequence",
    "merge_partial_attention",
    "ring_exchange",
    "sequence_positions",
    "sequence_to_heads",
    "split_for_context_parallel",
    "split_sequence",
    "ulysses_attention",
    "zigzag_gather",
    "zigzag_split",
]
