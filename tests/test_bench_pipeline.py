"""``python -m bench.pipeline --quick`` runs end to end (tiny settings) and writes the JSON the README cites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python


pytestmark = pytest.mark.bench


@pytest.mark.timeout(200)
def test_pipeline_bench_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    proc = run_python(["-m", "bench.pipeline", "--quick", "--out", str(out)], cwd=REPO, timeout=180)
    report = json.loads(out.read_text())
    configs = [row["config"] for row in report["results"]]
    assert configs == ["unsplit, 1 core", "unsplit, 2 threads", "pipeline M=1", "pipeline M=2"]
    for row in report["results"]:
        assert row["step_ms"] > 0 and row["samples_per_s"] > 0 and len(row["step_ms_rounds"]) == 1
        if row["microbatches"]:
            assert row["gpipe_bound"] == pytest.approx(row["microbatches"] * 2 / (row["microbatches"] + 1))
            assert sum(row["stage_sizes"]) == 8 and len(row["stage_sizes"]) == 2
    assert report["results"][0]["speedup"] == 1.0
    assert report["target"]["microbatches"] == 8 and report["target"]["speedup"] is None  # --quick runs M = 1, 2 only
    assert "Pipeline throughput" in proc.stdout
