"""The helper ``refimpl.launch.shaped_link`` starts inside its private network namespace (``unshare -rn
python -m refimpl.launch.shaped_helper REQUEST REPLY RATE``): it shapes the namespace's loopback, runs
``refimpl.launch.run_ranks`` there and pickles back ``("ok", results)`` or ``("error", rank, message)``.
A module of its own so that ``refimpl.launch.shaped_link``, which ``run_ranks`` calls, does not
import ``run_ranks`` back.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from refimpl.distributed.env import exit_with_process
from refimpl.launch.run_ranks import RankFailed, run_ranks
from refimpl.launch.shaped_link import shape_loopback

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Shape the loopback, run the ranks, pickle what they returned (or which rank failed, and how)."""
    request, reply, rate = (argv or sys.argv[1:])[:3]
    fn, world_size, args, kwargs, caller = pickle.loads(Path(request).read_bytes())
    exit_with_process(caller)  # the caller gone (a test timed out): so is this helper, and its ranks
    shape_loopback(rate)
    try:
        result: tuple = ("ok", run_ranks(fn, world_size, *args, **kwargs))
    except RankFailed as failed:
        result = ("error", failed.rank, str(failed))
    Path(reply).write_bytes(pickle.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
