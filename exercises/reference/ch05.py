"""refimpl's answers to the exercises of chapter 05, under the exercise's names and signatures.

The grader's self-test grades this module and expects full marks (tests/test_exercises.py).
"""

from __future__ import annotations

from refimpl.loss_scaler import overflow_on_any_rank, update_scale
from refimpl.parallel.activation_checkpoint import checkpoint_block

__all__ = ["checkpoint_block", "overflow_on_any_rank", "update_scale"]
