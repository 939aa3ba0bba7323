"""``python -m bench.soak --quick``: the soak benchmark runs, samples both ranks and writes its report, and the hang
watch stayed quiet through its checkpoint saves and validation (a smoke test; the 20,000-step run itself is not part
of the suite)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python

pytestmark = [pytest.mark.bench, pytest.mark.multiprocess, pytest.mark.timeout(150)]


def test_quick_soak_reports_rss_of_both_ranks(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = run_python(["-m", "bench.soak", "--quick", "--out", str(out)], cwd=REPO, timeout=120)
    result = json.loads(out.read_text())
    assert result["steps"] == 400 and result["verdict"].startswith("no verdict")  # too short to judge
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        steps = [s["step"] for s in rank["samples"]]
        assert steps[0] == 1 and steps[-1] == 400 and steps == sorted(steps) and len(steps) >= 8
        assert all(s["rss_mib"] > 50 and s["gc_objects"] > 1000 for s in rank["samples"])
        assert rank["end_rss_mib"] == rank["samples"][-1]["rss_mib"] and rank["peak_rss_mib"] >= rank["end_rss_mib"]
    # The hang watch was on at its default all along, through checkpoint saves and validation, and never fired.
    watch = result["watch"]
    assert watch["hang_timeout_s"] == [300.0, 300.0] and min(watch["beats"]) > 0 and watch["hang_reports"] == 0
    assert (watch["checkpoint_every_steps"], watch["validation_every_steps"]) == (50, 100)
    assert "HANG" not in proc.stdout + proc.stderr
    assert "soak: 400 steps, 2 ranks, CommProfiler + DistributedDoctor" in proc.stdout
    assert "RSS MiB r0" in proc.stdout and "RSS MiB r1" in proc.stdout
    assert not list(tmp_path.glob("*.tmp"))
