"""``python -m bench.netlab`` runs end to end: a script as two nodes, the sweep and the tuner's benchmark (``--quick``).

Not a timing test (the suite never judges a benchmark's numbers): it checks that every mode
builds its lab, measures the link, trains what it says across it, writes what the docs cite,
and leaves no namespace behind. Needs root for network namespaces: skipped with the reason
where they cannot be made.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.labs.network import lab_unavailable
from bench.netlab_sweep import LOSSY, OPTIONS
from tests.conftest import REPO, SCRIPTS, run_python

pytestmark = [pytest.mark.bench, pytest.mark.multiprocess]


@pytest.fixture(autouse=True)
def _namespaces_or_skip() -> None:
    reason = lab_unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces cannot be made here: {reason}")


def _lab_namespaces() -> set[str]:
    """The network lab's namespaces whose creating process is gone (a lab running beside this test, in another
    test file's worker, owns live ones)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.startswith("nlab-")]
    return {name for name in names if not Path(f"/proc/{name.split('-')[1]}").exists()}


@pytest.mark.timeout(120)
def test_any_script_runs_as_two_nodes(tmp_path: Path) -> None:
    before = _lab_namespaces()
    out = tmp_path / "fit.json"
    script = [str(SCRIPTS / "fit_tiny.py"), "--out", str(out), "--devices", "1", "--num-nodes", "2", "--steps", "3"]
    proc = run_python(
        ["-m", "bench.netlab", "--gbps", "0.5,1", "--probe-seconds", "0.2", "--", *script], cwd=REPO, timeout=110
    )
    assert "netlab: node 0 -> node 1: configured 0.5, measured" in proc.stdout
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["params_per_rank"][0] == report["params_per_rank"][1]
    assert _lab_namespaces() <= before


@pytest.mark.timeout(200)
def test_sweep_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "netlab_sweep.json"
    proc = run_python(["-m", "bench.netlab", "--sweep", "--quick", "--out", str(out)], cwd=REPO, timeout=190)
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert settings["quick"] and settings["options"] == list(OPTIONS) and settings["rates"] == [1.0]
    rows = report["rows"]
    assert [r["option"] for r in rows] == list(OPTIONS) and {r["model"] for r in rows} == {"mlp"}
    for row in rows:
        assert row["step_ms"] > 0 and 0 < row["measured_gbps"] < 1.5, row  # the link's real rate, tbf-bounded
        assert row["eval_loss"] is not None and row["lossy"] == (row["option"] in LOSSY)
        assert row["speedup_vs_ddp"] > 0
    assert all(t["status"] == "done" for t in next(r for r in rows if r["option"] == "auto")["tuning"])
    raw = report["raw"]
    for run in raw["runs"]:
        assert len(run["step_ms"]) == run["steps"] == settings["auto_steps" if run["option"] == "auto" else "steps"]
    assert all(run["steps"] == settings["loss_steps"] for run in raw["losses"])
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "x ddp" in proc.stdout and "loss @ 4 steps" in proc.stdout


@pytest.mark.timeout(200)
def test_the_tuners_benchmark_runs_across_the_lab(tmp_path: Path) -> None:
    args = ["-m", "bench.netlab", "--buckets", "--quick", "--rates", "10", "--models", "mlp"]
    run_python([*args, "--out", str(tmp_path / "x.json")], cwd=REPO, timeout=190)
    report = json.loads((tmp_path / "netlab_buckets_10gbps.json").read_text())
    link = report["settings"]["link"]
    assert link["configured_gbps"] == 10 and all(0 < g < 15 for g in link["measured_gbps"])
    (entry,) = report["models"]
    assert entry["auto"]["status"] == ["done"]
    assert {"total_vs_default_1pct", "repeat_consistency"} <= set(entry["targets"])
    for target in entry["targets"].values():
        assert target["met"] == (target["ratio"] <= target["limit"])
    assert (tmp_path / "netlab_buckets_10gbps.png").exists()
