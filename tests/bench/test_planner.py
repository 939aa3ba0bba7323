"""``python -m bench.planner --quick`` runs end to end, and its report says the planner is exact.

Not a timing test (a benchmark is never judged by the suite): it checks that the script
runs from the repository root, that ``partition`` hit the DP optimum in every random case and every
model row, that no heuristic beat the optimum (which would mean the reference is wrong),
and that the JSON holds what the lead reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import REPO as REPO_ROOT

METHODS = {"ours", "dp", "blockpartition", "ds_params", "params_minmax", "uniform"}
DISTRIBUTIONS = {"uniform", "lognormal", "few_huge", "lognormal+cuts"}

pytestmark = pytest.mark.bench


@pytest.mark.timeout(180)
def test_planner_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "planner.json"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.planner", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads(out.read_text())

    random_cases = report["random"]
    assert random_cases["cases"] == report["settings"]["cases"] == 100
    assert set(random_cases["by_distribution"]) == DISTRIBUTIONS
    for summary in [*random_cases["by_distribution"].values(), random_cases["overall"]]:
        assert set(summary) == METHODS
        # Our planner is exactly optimal, everywhere.
        assert summary["ours"]["optimal_share"] == 1.0
        assert summary["ours"]["worst_ratio"] == 1.0 and summary["ours"]["invalid"] == 0
        assert summary["dp"]["optimal_share"] == 1.0
        for method, entry in summary.items():
            assert entry["worst_ratio"] >= entry["mean_ratio"] >= 1.0, method
            assert 0.0 <= entry["optimal_share"] <= 1.0
    # The comparison has teeth: the heuristics are not all optimal.
    overall = random_cases["overall"]
    assert min(overall[m]["optimal_share"] for m in ("blockpartition", "ds_params", "uniform")) < 1.0

    models = report["models"]
    sources = {row["model"]: row["source"] for row in models}
    assert sources == {
        "char-LM transformer (recipes/char_lm)": "profiled",
        "CNN (recipes/image_classifier)": "profiled",
        "8M MLP (bench/models.py)": "profiled",
        "transformer (GPT-2-medium-like)": "synthetic",
        "cnn (ResNet-50-like)": "synthetic",
        "mlp (one huge layer)": "synthetic",
    }
    for row in models:
        assert row["ratio"]["ours"] == 1.0
        assert all(ratio >= 1.0 for ratio in row["ratio"].values())
        assert sum(row["sizes"]["ours"]) == row["layers"] and len(row["sizes"]["ours"]) == row["k"]

    timing = report["timing"]
    assert timing["layers"] == 1000 and timing["k"] == 8 and timing["runs"] >= 1
    assert all(entry["min_s"] <= entry["median_s"] <= entry["max_s"] for entry in timing["inputs"].values())
    assert timing["met"] == (max(e["median_s"] for e in timing["inputs"].values()) < timing["target_s"])

    assert report["ours_always_optimal"] is True
    assert "optimal in every case" in completed.stdout
