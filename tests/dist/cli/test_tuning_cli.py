"""``lightning-mgpu tune``: a real 2-rank sweep.

Bad input, answered before anything starts: tests/unit/cli/test_tuning_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python
from tests.helpers.cli import TARGET


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sweep_prints_the_table_and_writes_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    args = ["-m", "lightning_mgpu.cli", "tune", TARGET, "--sizes", "0.25,1", "--rounds", "2", "--measure", "2"]
    proc = run_python([*args, "--out-dir", str(out)], cwd=REPO, timeout=100)
    assert "bucket size -> step time (2 ranks, gloo)" in proc.stdout
    assert "recommended:" in proc.stdout and "25 (DDP default)" in proc.stdout
    result = json.loads((out / "tune.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    record = result["tuning"]
    assert record["status"] == "done" and record["rounds"] == 2 and record["measure"] == 2
    candidates = record["candidates"]
    assert [c["cap_mb"] for c in candidates] == [25.0, 0.25, 1.0]
    # 2 rounds of 2 steps; more rounds for the default and the closest layouts when the decision is open (issue 14)
    assert all(c["steps"] == 2 * len(c["round_ms"]) >= 4 and c["step_ms"] > 0 for c in candidates)
    assert all(c["built_bytes"] == c["bucket_bytes"] for c in candidates)
    assert record["outcome"] in ("faster", "not faster", "too noisy")
    assert sum(candidates[0]["bucket_bytes"]) == result["gradient_bytes"]
    assert record["chosen_mb"] in (25.0, 0.25, 1.0)
    png = (out / "tune.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
