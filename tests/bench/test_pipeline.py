"""``python -m bench.pipeline --quick`` runs end to end (tiny settings): our schedules and torch's pipelining on
both models, measured peak activations per stage beside the plan's estimate, and the JSON the docs cite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python

pytestmark = pytest.mark.bench


@pytest.mark.timeout(400)
def test_pipeline_bench_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    proc = run_python(["-m", "bench.pipeline", "--quick", "--out", str(out)], cwd=REPO, timeout=380)
    report = json.loads(out.read_text())
    by_model = {name: [r for r in report["results"] if r["model"] == name] for name in ("mlp", "gpt")}
    assert [r["config"] for r in by_model["mlp"]] == [
        "unsplit, 1 core",
        "unsplit, 2 threads",
        "gpipe, loss outside M=1",
        "gpipe M=1",
        "1f1b M=1",
        "zero_bubble M=1",
        "sequential M=2, 1 core",
        "gpipe, loss outside M=2",
        "gpipe M=2",
        "1f1b M=2",
        "zero_bubble M=2",
        "torch gpipe M=1",
        "torch gpipe M=2",
        "torch 1f1b M=2",  # torch's 1F1B refuses M < K
    ]
    assert [r["config"] for r in by_model["gpt"]] == [  # no loss outside: the GPT is not an nn.Sequential
        "unsplit, 1 core",
        "unsplit, 2 threads",
        "gpipe M=1",
        "1f1b M=1",
        "zero_bubble M=1",
        "sequential M=2, 1 core",
        "gpipe M=2",
        "1f1b M=2",
        "zero_bubble M=2",
        "torch gpipe M=1",
        "torch gpipe M=2",
        "torch 1f1b M=2",
    ]
    for rows in by_model.values():
        assert rows[0]["speedup"] == 1.0
        for row in rows:
            assert row["step_ms"] > 0 and row["samples_per_s"] > 0 and len(row["step_ms_rounds"]) == 1
            measured = row["peak_activation_bytes"]
            ours = row["engine"] == "ours"
            assert (row["cpu_ms_per_step"] > 0) if ours else (row["cpu_ms_per_step"] is None)
            if row["schedule"] is None:  # the unsplit model, whole batch or micro-batches in turn: one "stage"
                assert len(measured) == 1 and measured[0] > 0
                assert row["gpipe_bound"] is None and row["two_core_ceiling"] is None
                continue
            sequential = (
                next(r for r in rows if r["config"] == f"sequential M={row['microbatches']}, 1 core")
                if (row["microbatches"] > 1)
                else None
            )
            want = 2.0 if sequential is None else 2 * rows[0]["step_ms"] / sequential["step_ms"]
            assert row["two_core_ceiling"] == pytest.approx(want)
            assert row["gpipe_bound"] == pytest.approx(row["microbatches"] * 2 / (row["microbatches"] + 1))
            assert len(row["stage_sizes"]) == 2 and len(measured) == 2 and min(measured) > 0
            # the plan's estimate is one micro-batch's saved activations x the micro-batches in flight: the
            # measured peak of a real step is that, give or take the engines' own tensors at the cut
            estimate = row["estimated_activation_bytes"]
            assert len(estimate) == 2
            for got, want in zip(measured, estimate):
                assert 0.5 * want <= got <= 2 * want, (row["config"], measured, estimate)
    mlp = {r["config"]: r for r in by_model["mlp"]}
    assert all(sum(mlp[c]["stage_sizes"]) == 8 for c in mlp if mlp[c]["schedule"])
    # at M = 2 the last stage of 1F1B holds one micro-batch, GPipe's two: measured, not estimated
    assert mlp["1f1b M=2"]["peak_activation_bytes"][1] < 0.75 * mlp["gpipe M=2"]["peak_activation_bytes"][1]
    assert mlp["torch 1f1b M=2"]["peak_activation_bytes"][1] < 0.75 * mlp["torch gpipe M=2"]["peak_activation_bytes"][1]
    assert set(report["targets"]) >= {
        "zero_bubble_speedup",
        "1f1b_memory_vs_gpipe",
        "1f1b_throughput_vs_gpipe",
        "mlp_gpipe_vs_torch",
        "gpt_1f1b_vs_torch",
    }
    assert all(t["got"] is None for t in report["targets"].values())  # --quick runs M = 1, 2 only
    assert "Pipeline, mlp" in proc.stdout and "Pipeline, gpt" in proc.stdout and "(no M=8 in this run)" in proc.stdout
