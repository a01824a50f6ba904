"""refimpl's answers to the exercises of chapter 02, under the exercise's names and signatures.

The grader's self-test grades this module and expects full marks (tests/course/cli/test_exercises.py).
"""

from __future__ import annotations

from refimpl.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = ["ring_all_gather", "ring_all_reduce", "ring_reduce_scatter"]
