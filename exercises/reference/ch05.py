"""refimpl's answers to the exercises of chapter 05, under the exercise's names and signatures.

The grader's self-test grades this module and expects full marks (tests/course/cli/test_exercises.py).
"""

from __future__ import annotations

from refimpl.parallel.activation_checkpoint import checkpoint_block
from refimpl.precision.loss_scaler import overflow_on_any_rank, update_scale

__all__ = ["checkpoint_block", "overflow_on_any_rank", "update_scale"]
