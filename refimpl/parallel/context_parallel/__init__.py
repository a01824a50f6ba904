"""Context parallelism: the sequence split across ranks, attention computed across them (chapter 07).

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"; Brandon et al. 2023
("striped attention", causal load balance); Jacobs et al. 2023, "DeepSpeed Ulysses" (all-to-all sequence
parallelism). One concept per file:

* :mod:`~refimpl.parallel.context_parallel.context_parallel_communications`: the ring's K/V exchange with
  plain ``isend`` / ``irecv`` (through :mod:`refimpl.comm.ops`, so the tracer sees them);
* :mod:`~refimpl.parallel.context_parallel.ring_attention`: ring attention as an autograd Function, partial
  outputs merged by their log-sum-exp, backward a ring too; the zig-zag split for causal balance;
* :mod:`~refimpl.parallel.context_parallel.ulysses`: the all-to-all that turns sequence shards into head
  shards and back.

Still to come for chapter 07 (issue 13): ``apply_context_parallel`` for refimpl's GPT, the trainer's
``--cp``, the chapter, exercises and benchmark.
"""
