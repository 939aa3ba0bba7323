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


def test_the_launch_path_tests_start_their_launches_cold(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Failures and preemption launch through tests/scripts/fail_harness.py: as a user's shell starts them."""
    from tests.scripts import fail_harness

    asked: dict[str, object] = {}

    class Started(Exception):
        pass

    def start(command: object, **options: object) -> None:
        asked.update(options)
        raise Started

    monkeypatch.setattr(fail_harness.warm, "start", start)
    with pytest.raises(Started):
        fail_harness.launch("probe", tmp_path / "out", ["--steps", "1"])
    assert asked.get("cold") is True
