"""``python -m bench.overhead --quick`` runs end to end and reports three comparable configurations.

Not a timing test (a benchmark is never judged by the suite): it checks that the script
launches raw torch DDP, Lightning ``ddp`` and ``ddp_tuned`` with 2 gloo ranks, that they
used the same bucket layout and computed the same thing, and that the JSON holds what
the lead reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO as REPO_ROOT, run_python

CONFIGS = {"raw", "ddp", "ddp_tuned"}
MLP_PARAMETERS = 8_656_128


@pytest.mark.bench
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_overhead_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.overhead", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        # six interpreters importing Lightning: ~45 s on an idle 2-core machine, over 110 s in CI beside
        # the other xdist worker and mypy; the limit only guards against a hang
        timeout=280,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads(out.read_text())

    assert report["settings"]["parameters"] == MLP_PARAMETERS
    assert report["machine"]["world_size"] == 2 and report["machine"]["backend"] == "gloo"
    launches = report["launches"]
    assert {launch["config"] for launch in launches} == CONFIGS
    assert len(launches) == report["settings"]["rounds"] * len(CONFIGS)
    for launch in launches:
        assert launch["world_size"] == 2
        assert len(launch["step_ms"]) == report["settings"]["steps"]
        assert all(ms > 0 for ms in launch["step_ms"])
        assert launch["step"]["median"] > 0
    assert {launch["strategy_class"] for launch in launches if launch["config"] != "raw"} == {
        "DDPStrategy",
        "TunedDDPStrategy",
    }

    # Same buckets everywhere: DDP's default 1 MiB first bucket (the last layer), then the rest.
    layouts = [launch["buckets"] for launch in launches]
    assert all(layout == layouts[0] for layout in layouts)
    assert report["bucket_layout"] == layouts[0] and layouts[0]["rebuilt"]
    assert sum(layouts[0]["bucket_bytes"]) == MLP_PARAMETERS * 4
    assert len(layouts[0]["bucket_bytes"]) == 2 and layouts[0]["bucket_bytes"][0] == (256 * 1024 + 256) * 4

    # Same model, data, order and arithmetic: bit-identical final loss in every launch.
    assert report["same_final_loss"] is True
    assert len(set(report["final_losses"].values())) == 1

    summary = report["summary"]
    assert set(summary) == CONFIGS
    assert all(entry["step_ms_median"] > 0 for entry in summary.values())
    assert set(report["targets"]) == {"ddp_tuned/ddp", "ddp_tuned/raw"}
    for target in report["targets"].values():
        assert target["met"] == (target["ratio"] <= target["limit"])
    assert "ddp_tuned" in completed.stdout and "× raw" in completed.stdout


@pytest.mark.bench
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_profiler_overhead_quick_run(tmp_path: Path) -> None:
    """``python -m bench.profiler_overhead`` alternates fits with and without the profiler inside one launch."""
    out = tmp_path / "profiler_overhead.json"
    command = ["-m", "bench.profiler_overhead", "--quick", "--rounds", "2", "--breakdown", "--out", str(out)]
    completed = run_python(command, cwd=REPO_ROOT, timeout=110)
    report = json.loads(out.read_text())
    fits = report["fits"]
    # 2 kept rounds (the warm-up round is dropped), ABC CBA order within the one launch
    order = ["ddp_tuned", "ddp_tuned+hook", "ddp_tuned+profiler_all", "ddp_tuned+profiler"]
    assert [(f["round"], f["config"]) for f in fits] == [(0, c) for c in order] + [(1, c) for c in order[::-1]]
    assert [tuple(f["lightning_callbacks"]) for f in fits[:4]] == [
        ("TimeEachStep",),
        ("TimeEachStep", "HookOnly"),
        ("TimeEachStep", "CommProfiler"),
        ("TimeEachStep", "CommProfiler"),
    ]
    assert set(report["breakdown"]) == {
        "ddp_tuned+profiler_all/ddp_tuned",
        "ddp_tuned+hook/ddp_tuned",
        "ddp_tuned+profiler_all/ddp_tuned+hook",
    }
    # The profiler's hook path (1/n on the loss) trains bit for bit like DDP's built-in all-reduce.
    assert report["same_final_loss"] is True and len({f["final_loss"] for f in fits}) == 1
    assert all(f["iteration"]["n"] == 9 and f["cpu_iteration"]["median"] > 0 for f in fits)
    target = report["targets"]["ddp_tuned+profiler/ddp_tuned"]
    assert target["limit"] == 1.03 and len(target["ratio_per_round"]) == 2
    assert target["ci95"][0] <= target["ratio"] <= target["ci95"][1]
    assert target["met"] == (target["ratio"] <= target["limit"])
    assert "CommProfiler cost, the same run interleaved" in completed.stdout


@pytest.mark.bench
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_profiler_overhead_separate_launches_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "profiler_overhead.json"
    completed = run_python(
        ["-m", "bench.profiler_overhead", "--method", "launches", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        # six interpreters importing Lightning: ~45 s on an idle 2-core machine, over 110 s in CI beside
        # the other xdist worker and mypy; the limit only guards against a hang
        timeout=280,
    )
    report = json.loads(out.read_text())
    assert {launch["config"] for launch in report["launches"]} == {"ddp_tuned", "ddp_tuned+profiler"}
    assert report["same_final_loss"] is True
    target = report["targets"]["ddp_tuned+profiler/ddp_tuned"]
    assert target["measure"] == "iteration" and target["met"] == (target["ratio"] <= target["limit"])
    assert "CommProfiler cost, separate launches" in completed.stdout
