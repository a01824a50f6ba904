"""The suite's one spawn timeout: the bound of one ``run_ranks`` (or ``run_folded``) spawn in a test.

``SPAWN_TIMEOUT_S`` bounds one spawn of a test module's rank functions: 2 to 8 fresh ranks importing torch,
building a tiny model and running the module's functions on the 2 loaded cores the suite was measured on
(the most of the modules' own bounds before there was one: 120, 180 or 240 s). A module whose spawn does more
(the trainer at every layout of the module, several steps each) says so with an explicit multiple of it
(``2 * timeouts.SPAWN_TIMEOUT_S`` and why, beside it). A test's pytest limit is built on it
(``@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)``), and tests/conftest.py scales those limits by
``REFIMPL_TEST_TIMEOUT_SCALE``; the bound handed to ``run_ranks`` stays as written (the test's design).
"""

from __future__ import annotations

SPAWN_TIMEOUT_S = 240
