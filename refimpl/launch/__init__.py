"""Starting ranks: for tests and graders (``run_ranks``), from a notebook (``start_ranks``), and
commands from a cell (``run_command``); ``refimpl.launch.reaper`` makes sure notebook ranks die with
their kernel. Scripts use ``torchrun``. See docs/ARCHITECTURE.md, "Running many ranks".
"""

from refimpl.launch.command import CommandFailed, run_command
from refimpl.launch.notebook import RankError, Ranks, start_ranks
from refimpl.launch.run_ranks import RankFailed, free_port, run_ranks

__all__ = ["CommandFailed", "RankError", "RankFailed", "Ranks", "free_port", "run_command", "run_ranks",
           "start_ranks"]
