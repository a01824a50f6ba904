"""refimpl's answers to the exercises of chapter 09, under the exercise's names and signatures.

All are refimpl's own functions (``refimpl.parallel.expert_parallel``: the router's loss and capacity,
the dispatch bookkeeping). The grader's self-test grades this module and expects full marks
(tests/test_exercises.py).
"""

from __future__ import annotations

from refimpl.parallel.expert_parallel.dispatch import (
    SortPlan,
    combine,
    expert_major_order,
    rank_splits,
    sort_by_expert,
)
from refimpl.parallel.expert_parallel.router import capacity_keep, expert_capacity, load_balancing_loss

__all__ = ["SortPlan", "capacity_keep", "combine", "expert_capacity", "expert_major_order",
           "load_balancing_loss", "rank_splits", "sort_by_expert"]
