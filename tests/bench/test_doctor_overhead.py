"""``python -m bench.doctor_overhead --quick`` runs end to end, for each subject: the doctor, and (``--subject watch``)
``ddp_tuned`` with and without the hang watch, ABBA in one launch (smoke tests: a benchmark is never judged by the
suite)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, cpu_env, run_python


pytestmark = pytest.mark.bench


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_doctor_overhead_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "doctor_overhead.json"
    env = cpu_env()
    env.pop("OMP_NUM_THREADS")  # the benchmark pins threads per rank itself
    command = ["-m", "bench.doctor_overhead", "--quick", "--model", "tiny", "--out", str(out)]
    proc = run_python(command, cwd=REPO, timeout=110, env=env)
    report = json.loads(out.read_text())
    assert report["machine"]["world_size"] == 2 and report["machine"]["backend"] == "gloo"
    assert [fit["config"] for fit in report["fits"]] == ["ddp_tuned", "ddp_tuned+doctor"]  # one pair
    assert set(report["summary"]) == {"ddp_tuned", "ddp_tuned+doctor"}
    assert len(report["ratio_iteration_per_pair"]) == 1 and report["ratio_iteration"] > 0
    # The doctor really ran (its checks and hooks were timed) and found nothing wrong with a correct run.
    assert {"epoch_start", "periodic", "epoch_end", "train_end"} <= set(report["check_ms"])
    assert set(report["hook_us_per_batch"]) == {"on_train_batch_start", "on_after_backward", "on_train_batch_end"}
    assert report["doctor_findings"] == []
    assert "with / without, median over pairs" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_watch_overhead_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "watch_overhead.json"
    env = cpu_env()
    env.pop("OMP_NUM_THREADS")  # the benchmark pins threads per rank itself
    command = ["-m", "bench.doctor_overhead", "--subject", "watch", "--quick", "--model", "tiny", "--out", str(out)]
    command += ["--pairs", "2"]  # ABBA: an unwatched fit after a watched one
    proc = run_python(command, cwd=REPO, timeout=110, env=env)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "watch_overhead" and report["subject"] == "watch" and report["stat"] == "mean"
    assert report["machine"]["world_size"] == 2 and report["settings"]["quick"] is True
    configs = [fit["config"] for fit in report["fits"]]
    assert configs == ["ddp_tuned+unwatched", "ddp_tuned", "ddp_tuned", "ddp_tuned+unwatched"]
    # It compares what it says: the watch published during every watched fit, and never during an unwatched one
    # (not even the last, after two watched fits whose thread would tick on while the process group lives).
    beats = [fit["watch_beats"] for fit in report["fits"]]
    assert beats[0] == beats[3] == 0 and min(beats[1], beats[2]) >= 1, beats
    assert not report["fits"][3]["watch_ticking_before"]  # fits too short for a tick: the thread itself is checked
    assert len(report["ratio_iteration_per_pair"]) == 2 and report["ratio_iteration"] > 0 and report["limit"] == 1.01
    assert "check_ms" not in report  # the doctor's own figures belong to --subject doctor
    assert "with / without, median over pairs of per-fit means" in proc.stdout
