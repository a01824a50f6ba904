"""Chapter 04's reference answers: refimpl's own implementations, graded like a learner's file."""

from refimpl.parallel.zero import install_unit_hooks, reshard_, sharded_step, unshard_
from refimpl.planner import shard_rows

__all__ = ["install_unit_hooks", "reshard_", "shard_rows", "sharded_step", "unshard_"]
