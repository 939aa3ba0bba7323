"""``lightning-mgpu doctor --selftest`` (issue 18 item 7): every CUDA path's own code runs for real on CPU stand-ins.

``--selftest-device cpu``, a process per path. Without a GPU, and the report's logic with a fake
runner: tests/unit/cli/test_doctor_selftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_mgpu.cli.workers.selftest import PATHS
from tests.conftest import REPO, cpu_env, run_python


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_every_paths_code_runs_on_cpu_stand_ins(tmp_path: Path) -> None:
    proc = run_python(
        ["-m", "lightning_mgpu.cli", "doctor", "--selftest", "--selftest-device", "cpu", "--json"],
        cwd=REPO,
        timeout=540,
        env=cpu_env(),
        check=False,
    )
    report = json.loads(proc.stdout)
    failed = {c["name"]: c["value"] for c in report["checks"] if c["status"] != "ok"}
    assert not failed, failed
    assert [c["name"] for c in report["checks"]] == list(PATHS)
    assert proc.returncode == 0
