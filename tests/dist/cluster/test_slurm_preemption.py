"""Preemption under a real scheduler (issue 31 item 2): ``ddp_tuned`` against stock ``ddp``, 2 nodes of the SLURM lab.

The module runs ``python -m bench.cluster_preemption --quick`` on its cluster (the same driver and
analysis that write ``bench/results/cluster_preemption.json`` and the table in docs/cluster.md):
jobs of ``tests/scripts/cluster_fit.py`` with ``--requeue``, preempted

* by their time limit (``--time=1 --signal=USR1@5``), twice in a row before a run completes;
* by ``scancel --signal=USR1`` once past step 10;
* by ``scontrol requeue`` (SIGTERM to every task) once past step 10;

and an uninterrupted run. ``ddp_tuned``: every rank stops after the same step, saves that step, exits
with 128 + the signal, the job requeues, the next run resumes at exactly that step, every loss of
every run equals the uninterrupted run's at the same step, and the job completes; through two
time-limit preemptions in a row too. Stock ``ddp``, the measured reference (not fixed here): on a
plain requeue it saves nothing and starts again from step 0; on SIGUSR1 it saves in the signal
handler while training goes on (the step it resumes at is not always the one it stopped at), and
that save's barrier can deadlock against the other rank's all-reduce (the job then hangs until
cancelled).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench import cluster_preemption
from bench.labs.slurm import Cluster

pytestmark = [pytest.mark.multiprocess]

EXIT_STATUS = {"time_limit": "exit 138", "scancel_usr1": "exit 138", "requeue": "exit 143"}  # 128 + SIGUSR1 / SIGTERM


@pytest.fixture(scope="module")
def result(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("preemption")
    out = root / "cluster_preemption.json"
    code = cluster_preemption.main(["--quick", "--out", str(out), "--work-dir", str(root / "jobs")], cluster=cluster)
    assert code == 0
    payload: dict[str, Any] = json.loads(out.read_text())
    return payload


def _row(result: dict[str, Any], strategy: str, way: str) -> dict[str, Any]:
    rows = [r for r in result["rows"] if r["strategy"] == strategy and r["preempted_by"] == way]
    assert len(rows) == 1, (strategy, way, [(r["strategy"], r["preempted_by"]) for r in result["rows"]])
    return rows[0]


def _describe(row: dict[str, Any]) -> str:
    return json.dumps(
        {k: row[k] for k in ("job_state", "restarts", "attempts", "preemptions", "checkpoints")}, indent=1
    )


@pytest.mark.timeout(480)
@pytest.mark.parametrize("way", cluster_preemption.WAYS)
def test_ddp_tuned_stops_every_rank_at_one_step_saves_it_requeues_and_resumes_exactly(
    result: dict[str, Any], way: str
) -> None:
    row = _row(result, "ddp_tuned", way)
    expected = cluster_preemption.TIME_LIMIT_PREEMPTIONS if way == "time_limit" else 1
    assert row["restarts"] == len(row["preemptions"]) == expected, _describe(row)
    for preemption in row["preemptions"]:
        stopped = preemption["stopped_at"]
        assert preemption["same_step"] and stopped[0] > 0, _describe(row)
        assert preemption["saved_step"] == stopped[0], _describe(row)  # the step every rank stopped after
        assert preemption["resumed_at"] == stopped[0] and preemption["redone_steps"] == 0, _describe(row)
        assert preemption["outcome"] == [EXIT_STATUS[way]] * 2, _describe(row)
    assert row["exact"], "a loss after resuming differs from the uninterrupted run's at the same step"
    assert row["completed"] and row["job_state"] == "COMPLETED", _describe(row)
    if way != "time_limit":
        assert row["signal_to_stopped_s"] is not None and row["signal_to_stopped_s"] < 30


@pytest.mark.timeout(480)
def test_stock_ddp_on_a_plain_requeue_saves_nothing_and_starts_again_from_step_zero(result: dict[str, Any]) -> None:
    row = _row(result, "ddp", "requeue")
    assert row["restarts"] == 1 and row["checkpoints"] == {}, _describe(row)
    (preemption,) = row["preemptions"]
    assert preemption["resumed_at"] == 0, _describe(row)
    if None not in preemption["stopped_at"]:  # None: the rank hung in Lightning's SIGTERM handler, SIGKILLed
        assert preemption["redone_steps"] == max(preemption["stopped_at"]) > 0, _describe(row)


@pytest.mark.timeout(480)
def test_stock_ddp_on_sigusr1_saves_from_its_handler_and_either_redoes_steps_or_hangs(result: dict[str, Any]) -> None:
    """Measured, not fixed: Lightning saves from inside its signal handler, on every rank at whatever point each is
    (the save's barrier can meet the other rank's gradient all-reduce: a deadlock, cancelled by the benchmark),
    while the fit goes on until SLURM's SIGTERM; which of the two happened is in the JSON and the docs."""
    row = _row(result, "ddp", "scancel_usr1")
    assert row["checkpoints"], _describe(row)  # the handler got as far as saving on rank 0
    if row["hung"]:
        assert row["restarts"] == 0 and not row["completed"], _describe(row)
    else:
        assert row["restarts"] >= 1 and row["completed"] and row["exact"], _describe(row)
        (preemption,) = row["preemptions"]
        assert preemption["resumed_at"] == preemption["saved_step"] <= max(preemption["stopped_at"]), _describe(row)


@pytest.mark.timeout(480)
def test_the_report_summarises_every_case_for_the_docs(result: dict[str, Any]) -> None:
    lines = {(line["strategy"], line["preempted_by"]): line for line in result["summary"]}
    assert set(lines) == {("ddp_tuned", way) for way in cluster_preemption.WAYS} | {
        ("ddp", "scancel_usr1"),
        ("ddp", "requeue"),
    }
    ours = [lines[("ddp_tuned", way)] for way in cluster_preemption.WAYS]
    assert all(line["completed"] == line["exact"] == line["runs"] == 1 for line in ours)
    assert result["settings"]["quick"]
