"""Hung jobs, for real: each ends within 50 s of its stall, every rank non-zero, one report naming the right rank and line.

``tests/scripts/hang_fit.py`` on 2 (and 4) gloo ranks under Lightning's own launcher, ``hang_timeout=20``
and torch's 30-minute collective timeout (so nothing but the watch can end a hang): a barrier under a rank
condition, ``sync_dist=True`` logged by one rank, uneven batches (the first three also on 4 ranks), one
rank sleeping in ``training_step``, one rank validating long after the other went back to training, a
rank killed with SIGKILL, a rank stuck in its data loader; the barrier again under stock
``strategy="ddp"`` with ``DistributedDoctor(hang_timeout=20)``, and preempted (SIGTERM to the job while
every rank is blocked); and a clean fit whose one step takes longer than the timeout (working), which
must end normally. And the barrier across the network lab's two namespaces ("nodes" joined by a
shaped link, one ``torchrun`` each, the rendezvous store on node 0's agent): the watch relies on the
store and the environment only (skipped where namespaces cannot be made).

Every launch of the module starts at once, each in its own session with its own rendezvous (most of a
launch is importing, then waiting 20 s for the timeout: they overlap), once per module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from bench.harness.launch import NodeRun, run
from bench.labs.network import Lab, LabError, lab_unavailable
from docs import hang_tables
from tests.scripts.fail_harness import Job, launch_all
from tests.scripts.hang_fit import site_line

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "hang_fit.py"
HANG_TIMEOUT = 20
LATENCY_LIMIT_S = 50.0
"""Stall to the end of the whole job (every process gone)."""
HANG_EXIT = 124


# name: flags, ranks, (cause, culprits, the scenario whose line the report must name), the exit status
SCENARIOS: dict[str, tuple[tuple[str, ...], int, tuple[str, list[int], Optional[str]], int]] = {
    "barrier": (("--scenario", "barrier"), 2, ("collective-mismatch", [0], "barrier"), HANG_EXIT),
    "sync_dist": (("--scenario", "sync_dist"), 2, ("collective-mismatch", [0], "sync_dist"), HANG_EXIT),
    "uneven": (("--scenario", "uneven"), 2, ("uneven-batches", [1], "uneven"), HANG_EXIT),
    "barrier-4": (("--scenario", "barrier", "--ranks", "4"), 4, ("collective-mismatch", [0], "barrier"), HANG_EXIT),
    "sync_dist-4": (
        ("--scenario", "sync_dist", "--ranks", "4"),
        4,
        ("collective-mismatch", [0], "sync_dist"),
        HANG_EXIT,
    ),
    "uneven-4": (("--scenario", "uneven", "--ranks", "4"), 4, ("uneven-batches", [1], "uneven"), HANG_EXIT),
    "sleep": (("--scenario", "sleep"), 2, ("stuck-outside-collective", [1], "sleep"), HANG_EXIT),
    "validation": (("--scenario", "validation"), 2, ("rank-elsewhere", [1], "validation"), HANG_EXIT),
    "sigkill": (("--scenario", "sigkill"), 2, ("rank-died", [1], "sigkill"), 1),
    "loader": (("--scenario", "loader"), 2, ("stuck-outside-collective", [1], "loader"), HANG_EXIT),
    "stock-barrier": (("--scenario", "barrier", "--stock"), 2, ("collective-mismatch", [0], "barrier"), HANG_EXIT),
    "preempted": (
        ("--scenario", "barrier", "--sigterm-after", "3"),
        2,
        ("collective-mismatch", [0], "barrier"),
        128 + signal.SIGTERM,
    ),
}
SLOW_STEP_S = HANG_TIMEOUT + 4  # longer than the timeout, working all along: must not fire
_STALL = re.compile(r"\[hang_fit\] rank (\d+) stalls \((\w+)\) at ([0-9.]+)")
_SIGTERM = re.compile(r"\[hang_fit\] rank \d+ sends SIGTERM to the job at ([0-9.]+)")
_EXIT = re.compile(r"\[lightning_mgpu\] rank (\d+): the job hangs .*exiting with status (\d+) at ([0-9.]+)")


@dataclass
class LabRun:
    """The barrier scenario across the lab's two nodes: each node's torchrun, when it ended, or why it could not run."""

    nodes: list[NodeRun] = field(default_factory=list)
    out_dir: Optional[Path] = None
    ended_at: float = 0.0
    skipped: Optional[str] = None
    error: Optional[str] = None


def across_the_lab(out_dir: Path, result: LabRun) -> None:
    try:
        _across_the_lab(out_dir, result)
    except Exception as error:  # in a thread: kept for the test to show
        result.error = f"{type(error).__name__}: {error}"


def _across_the_lab(out_dir: Path, result: LabRun) -> None:
    reason = lab_unavailable()
    if reason is not None:
        result.skipped = reason
        return
    try:
        lab = Lab(2, 1.0).build()
    except LabError as error:
        result.skipped = str(error)
        return
    try:
        target = [str(SCRIPT), "--out-dir", str(out_dir), "--scenario", "barrier", "--ranks", "2", "--num-nodes", "2"]
        target += ["--hang-timeout", str(HANG_TIMEOUT)]
        result.nodes = run(target, nproc_per_node=1, lab=lab, timeout=200, log_dir=out_dir)
        result.ended_at, result.out_dir = time.time(), out_dir
    finally:
        lab.teardown()


@pytest.fixture(scope="module")
def lab_run(jobs: dict[str, Job]) -> LabRun:
    return LAB_RUN


LAB_RUN = LabRun()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("hangs")
    lab = threading.Thread(target=across_the_lab, args=(root / "lab", LAB_RUN), daemon=True)
    lab.start()  # beside the launches below: most of each is waiting
    specs: dict[str, dict[str, Any]] = {
        name: {
            "out_dir": root / name,
            "flags": (*flags, "--hang-timeout", str(HANG_TIMEOUT)),
            "script": SCRIPT,
            "timeout": 200,
            "cold": False,  # rank 0 forks from the worker's warm interpreter (its import is most of a job's CPU)
        }
        for name, (flags, _, _, _) in SCENARIOS.items()
    }
    specs["slow-step"] = {
        "out_dir": root / "slow-step",
        "flags": ("--scenario", "none", "--slow-step", str(SLOW_STEP_S), "--hang-timeout", str(HANG_TIMEOUT)),
        "script": SCRIPT,
        "timeout": 200,
        "cold": False,
    }
    launched = launch_all(specs, workers=len(specs))
    lab.join(timeout=240)
    for job in launched.values():  # kept beside the report, for a failure's post-mortem
        (job.out_dir / "output.txt").write_text(job.output)
    return launched


def stalled_at(job: Job) -> float:
    found = _STALL.search(job.output)
    assert found is not None, job.describe()
    return float(found.group(3))


def reported(job: Job) -> dict[str, Any]:
    path = job.out_dir / "hang_report.json"
    assert path.exists(), job.describe()
    result: dict[str, Any] = json.loads(path.read_text())
    return result


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_hang_ends_promptly_on_every_rank(jobs: dict[str, Job], name: str) -> None:
    job = jobs[name]
    _, ranks, _, status = SCENARIOS[name]
    assert not job.timed_out and job.leftover == [], job.describe()
    assert job.ended_at - stalled_at(job) < LATENCY_LIMIT_S, job.describe()
    if name == "sigkill":
        # Rank 0's collective failed when rank 1's connections closed: it raises (1), unless Lightning's child
        # watcher, seeing its child killed, kills it first (-9); the report was out before either.
        assert job.returncode in (1, -signal.SIGKILL), job.describe()
        assert "killed by SIGKILL" in job.output or "terminated with code -9" in job.output, job.describe()
        return
    assert job.returncode == status, job.describe()  # the launching process: rank 0
    # Every rank leaves with the hang's status; a rank that had died already (uneven batches: the short rank's
    # collective after fit may fail against the others' training ones) is named so in the report.
    gone = {state["rank"] for state in reported(job)["ranks"] if state["gone"]}
    exits = {int(m.group(1)): int(m.group(2)) for m in _EXIT.finditer(job.output)}
    assert exits == {rank: status for rank in range(ranks) if rank not in gone}, job.describe()
    assert not gone or name.startswith("uneven"), job.describe()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_one_report_names_the_right_ranks_and_line(jobs: dict[str, Job], name: str) -> None:
    job = jobs[name]
    _, ranks, (cause, culprits, site), _ = SCENARIOS[name]
    title = "A RANK LEFT THE JOB" if name == "sigkill" else "HANG: no progress for"
    assert job.output.count(title) == 1, job.describe()
    report = reported(job)
    assert report["diagnosis"]["cause"] == cause, job.describe()
    assert report["diagnosis"]["culprits"] == culprits, job.describe()
    by_rank = {state["rank"]: state for state in report["ranks"]}
    assert sorted(by_rank) == list(range(ranks))
    assert all(state["stack"] for rank, state in by_rank.items() if name != "sigkill" or rank != 1)
    if site is not None:
        line = site_line(site)
        culprit = by_rank[culprits[0]]
        assert Path(culprit["site"]["file"]).name == "hang_fit.py" and culprit["site"]["line"] == line, culprit
        assert f"hang_fit.py:{line}" in report["text"] and f"hang_fit.py:{line}" in job.output
    for rank in range(ranks):
        assert f"  rank {rank}: " in report["text"]


def test_the_others_are_named_where_they_wait(jobs: dict[str, Job]) -> None:
    barrier = reported(jobs["barrier"])
    text, summary = barrier["text"], barrier["diagnosis"]["summary"]  # the summary unwrapped
    assert "rank 0: in training_step, batch 2/6 (epoch 0, step 2); waits in barrier (collective #" in text
    assert "rank 1: in backward, batch 2/6 (epoch 0, step 2); waits in backward #3 (DDP's gradient all-reduce)" in text
    assert "under a rank condition (" in summary and "`if self.global_rank == self.odd:`" in summary
    uneven = reported(jobs["uneven"])
    assert uneven["ranks"][0]["collective"]["kind"] == "broadcast", uneven["text"]
    assert "Lightning's SIGTERM check before each training batch" in uneven["diagnosis"]["summary"]
    assert "rank 1: past the end of its run; waits in barrier" in uneven["text"]
    assert "It is loading data." in reported(jobs["loader"])["diagnosis"]["summary"]
    assert "rank 1 is still in validation" in reported(jobs["validation"])["diagnosis"]["summary"]


def test_a_preemption_signal_is_seen_while_every_rank_is_blocked(jobs: dict[str, Job]) -> None:
    """Before the watch a rank blocked in a collective never ran its SIGTERM handler: no word until the timeout."""
    job = jobs["preempted"]
    found = _SIGTERM.search(job.output)
    assert found is not None, job.describe()
    for rank in (0, 1):
        assert f"[lightning_mgpu] rank {rank}: received SIGTERM" in job.output, job.describe()
    text = reported(job)["text"]
    # Declared after the preemption grace (10 s without progress), not hang_timeout (20 s).
    assert text.startswith("[lightning_mgpu] HANG: no progress for 10 s") and "after SIGTERM" in text, text
    assert job.ended_at - float(found.group(1)) < 30.0, job.describe()


def test_a_step_longer_than_the_timeout_that_works_does_not_fire(jobs: dict[str, Job]) -> None:
    job = jobs["slow-step"]
    assert job.returncode == 0 and not job.timed_out and job.leftover == [], job.describe()
    assert "HANG" not in job.output and not (job.out_dir / "hang_report.json").exists(), job.describe()
    assert all(json.loads((job.out_dir / f"rank{r}.json").read_text())["global_step"] == 6 for r in (0, 1))


def test_across_two_nodes_of_the_network_lab(lab_run: LabRun) -> None:
    """One torchrun per namespace, gloo over the shaped link, the store on node 0's agent: the same report, the
    same exits."""
    if lab_run.skipped is not None:
        pytest.skip(f"network namespaces cannot be made here: {lab_run.skipped}")
    assert lab_run.error is None and lab_run.out_dir is not None and len(lab_run.nodes) == 2, lab_run.error
    logs = [node.output for node in lab_run.nodes]
    described = "\n".join(f"--- node {n.node} (exit {n.returncode})\n{n.output[-4000:]}" for n in lab_run.nodes)
    assert all(node.returncode not in (0, None) and not node.timed_out for node in lab_run.nodes), described
    found = _STALL.search(logs[0])
    assert found is not None, described
    assert lab_run.ended_at - float(found.group(3)) < LATENCY_LIMIT_S, described
    report = json.loads((lab_run.out_dir / "hang_report.json").read_text())
    assert report["diagnosis"]["cause"] == "collective-mismatch" and report["diagnosis"]["culprits"] == [0]
    culprit = report["ranks"][0]
    assert culprit["site"]["line"] == site_line("barrier"), culprit
    assert sum(log.count("HANG: no progress for") for log in logs) == 1, described
    for rank, log in enumerate(logs):  # each node's one rank left with the hang's status
        assert re.search(rf"rank {rank}: the job hangs .*exiting with status {HANG_EXIT}", log), described


def test_the_docs_show_the_reports_this_code_prints(jobs: dict[str, Job]) -> None:
    """docs/hangs.md shows a recorded report per scenario (bench/results/hang_reports.json); this run's must read the
    same, numbers aside. ``MGPU_RECORD_HANG_REPORTS=1`` records this run's instead (then ``python -m docs.generate``)."""
    current = {
        name: hang_tables.normalized(reported(jobs[name])["text"], log_dir=str(jobs[name].out_dir))
        for name in hang_tables.SCENARIOS
    }
    if os.environ.get("MGPU_RECORD_HANG_REPORTS"):
        recorded = {
            "recorded_by": "MGPU_RECORD_HANG_REPORTS=1 pytest tests/dist/watch/test_hang_scenarios.py",
            "hang_timeout": HANG_TIMEOUT,
            "reports": {name: {"text": text} for name, text in current.items()},
        }
        hang_tables.RECORDED.write_text(json.dumps(recorded, indent=1, ensure_ascii=False) + "\n")
        return
    recorded, racy = hang_tables.load(), hang_tables.RACY_RANK_LINES
    stale = [
        name
        for name, text in current.items()
        if hang_tables.masked(text, racy_rank=racy.get(name))
        != hang_tables.masked(recorded["reports"][name]["text"], racy_rank=racy.get(name))
    ]
    assert not stale, (
        f"docs/hangs.md's reports of {stale} are stale: this code reports them differently. Record this run's with "
        "MGPU_RECORD_HANG_REPORTS=1 pytest tests/dist/watch/test_hang_scenarios.py, then python -m docs.generate.\n"
        + "\n\n".join(
            f"--- {name} now:\n{current[name]}\n--- recorded:\n{recorded['reports'][name]['text']}" for name in stale
        )
    )
