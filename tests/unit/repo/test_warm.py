"""The fast lane cannot start a warm process (``tests/warm.py``).

That a warm start is the process a cold ``python ARGS`` would have been: tests/dist/repo/test_warm.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import warm
from tests.conftest import ProcessStartedInFastTest, cpu_env
from tests.helpers import repo

probe = repo.probe  # a fixture, shared with tests/dist/repo/test_warm.py


def test_the_fast_lane_cannot_start_a_warm_process(probe: Path, tmp_path: Path) -> None:
    with pytest.raises(ProcessStartedInFastTest):
        warm.start([sys.executable, str(probe)], cwd=tmp_path, env=cpu_env())
