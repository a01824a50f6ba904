"""``python -m refimpl.train``: the trainer's command line (``refimpl.train.cli.main``)."""

import sys

from refimpl.train.cli import main

sys.exit(main())
