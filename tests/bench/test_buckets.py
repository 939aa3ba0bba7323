"""``python -m bench.buckets --quick`` runs end to end: three models, every distinct layout, "auto".

Not a timing test (the suite never judges a benchmark's numbers): it checks that the
script trains what it says, that the layouts it predicts are the ones DDP built, that
"auto" tuned and trained every step, and that the JSON and the figure hold what the
README reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python

MLP_PARAMETERS = 8_656_128


pytestmark = pytest.mark.bench


@pytest.mark.multiprocess
@pytest.mark.timeout(170)
def test_buckets_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "buckets.json"
    proc = run_python(["-m", "bench.buckets", "--quick", "--out", str(out)], cwd=REPO, timeout=160)
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert settings["quick"] and settings["models"] == ["mlp", "cnn", "char_lm"]
    assert settings["parameters"]["mlp"] == MLP_PARAMETERS
    assert report["machine"]["world_size"] == 2 and report["machine"]["backend"] == "gloo"
    for entry in report["models"]:
        sweep = entry["sweep"]
        assert len(sweep) >= 3 and sum(point["is_default"] for point in sweep) == 1
        assert all(point["built_matches_prediction"] for point in sweep), entry["model"]
        assert all(point["step_ms"] > 0 for point in sweep)
        auto = entry["auto"]
        assert auto["status"] == ["done"]
        assert auto["chosen_mb"][0] in {point["cap_mb"] for point in sweep}
        assert auto["tuned_step_ms"] > 0 and auto["total_s"] > 0 and entry["default"]["total_s"] > 0
        for target in entry["targets"].values():
            assert target["met"] == (target["ratio"] <= target["limit"])
    runs = report["runs"]
    long_runs = [r for r in runs if r["bucket_cap_mb"] in (None, "auto")]
    assert len(long_runs) == 6 and all(r["steps"] == settings["run_steps"] for r in long_runs)
    assert all(len(r["step_ms"]) == r["steps"] for r in runs)  # tuning steps are training steps
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "tuned/best fixed" in proc.stdout and "char_lm" in proc.stdout
