"""``python -m bench.doctor_overhead --quick`` runs end to end (a smoke test: a benchmark is never judged by the suite)."""

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
