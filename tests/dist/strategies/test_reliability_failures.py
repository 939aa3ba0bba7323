"""A failing rank ends the whole job: non-zero, within seconds, the failing rank and its message in the output.

Failures are injected into tests/scripts/fail_fit.py on 2 CPU ranks (gloo): an exception in
``training_step``, a callback, the data loader (in the rank's process and in a worker process),
a pipeline stage (``hybrid``), ``SIGKILL``, and hangs that close no connection (a rank stuck in
Python, a rank that enters a collective the others never enter), which only the strategy's
collective ``timeout`` can end. Every cell of the grid is not run (that would take many minutes);
every failure kind, both strategies, both failing ranks and the three launchers (Lightning's
own ``python train.py``, ``start_method="spawn"``, ``torchrun``) each appear at least once.
``SIGKILL`` of rank 1 (ddp_tuned) and rank 0 (hybrid) under Lightning's launcher are the
killed runs of tests/dist/strategies/test_reliability_resume.py, checked there with the same rules.

The launches run in a module fixture, two at a time (most of a launch is importing torch or
waiting for the failure to be noticed): ~80 s on 2 cores.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.scripts.fail_harness import TORCHRUN, Job, launch_all

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

LATENCY_LIMIT_S = 30.0
"""Failure to end of the whole job (every process gone): seconds, where torch's default timeout is 30 minutes."""
WALL_LIMIT_S = 90.0
TIMEOUT_S = 8  # fail_fit.py holds the rendezvous (bound by it too) until every rank has imported Lightning
"""The collective timeout given to the runs that hang."""

HYBRID = ("--strategy", "hybrid")
SPAWN = ("--start-method", "spawn")

# name: (launcher, flags, what identifies the failing rank and its message in the output)
SCENARIOS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "lightning-ddp-step-rank1": ((), ("--fail", "step", "--rank", "1")),
    "lightning-ddp-step-rank0": ((), ("--fail", "step", "--rank", "0")),
    "lightning-ddp-callback-rank1": ((), ("--fail", "callback", "--rank", "1")),
    "lightning-ddp-loader-rank0": ((), ("--fail", "loader", "--rank", "0", "--at", "9")),
    "lightning-ddp-worker-rank1": ((), ("--fail", "worker", "--rank", "1", "--at", "9")),
    "lightning-hybrid-stage-rank1": ((), (*HYBRID, "--fail", "stage", "--rank", "1")),
    "lightning-hybrid-callback-rank0": ((), (*HYBRID, "--fail", "callback", "--rank", "0")),
    "lightning-hybrid-worker-rank0": ((), (*HYBRID, "--fail", "worker", "--rank", "0", "--at", "9")),
    "spawn-ddp-step-rank0": ((), (*SPAWN, "--fail", "step", "--rank", "0")),
    "spawn-hybrid-sigkill-rank1": ((), (*HYBRID, *SPAWN, "--fail", "sigkill", "--rank", "1")),
    "torchrun-ddp-sigkill-rank0": (TORCHRUN, ("--fail", "sigkill", "--rank", "0")),
    "torchrun-hybrid-step-rank1": (TORCHRUN, (*HYBRID, "--fail", "step", "--rank", "1")),
    "lightning-ddp-stuck-rank1": ((), ("--fail", "stuck", "--rank", "1", "--timeout-s", str(TIMEOUT_S))),
    # rank 1 fails and closes its connections, then takes 3 s to exit: rank 0 (which started it) sees it still running
    "lightning-ddp-step-rank1-slow-exit": ((), ("--fail", "step", "--rank", "1", "--linger-s", "3")),
    "torchrun-hybrid-mismatch-rank0": (
        TORCHRUN,
        (*HYBRID, "--fail", "mismatch", "--rank", "0", "--timeout-s", str(TIMEOUT_S)),
    ),
}
OBSERVER_KILL = "terminated with code 1. Forcefully terminating all other processes"
"""Under Lightning's launcher rank 0 watches its children: when the failing rank is 1, rank 0 may be killed by that
watcher (this message) before its own collective fails; either way it did not hang (the job ended promptly)."""
RAISING = [name for name in SCENARIOS if not re.search(r"sigkill|stuck|mismatch", name)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("failures")
    specs: dict[str, dict[str, Any]] = {
        name: {"out_dir": root / name, "flags": flags, "launcher": launcher, "timeout": 150}
        for name, (launcher, flags) in SCENARIOS.items()
    }
    return launch_all(specs, workers=2)


def failing(name: str) -> tuple[str, int]:
    kind = re.search(r"-(step|callback|loader|worker|stage|sigkill|stuck|mismatch)-", name)
    rank = re.search(r"rank(\d)", name)
    assert kind and rank
    return kind.group(1), int(rank.group(1))


def assert_ended_promptly(job: Job) -> None:
    """Non-zero, every process gone, soon after the failure."""
    assert not job.timed_out, job.describe()
    assert job.returncode not in (0, None), job.describe()
    assert job.leftover == [], job.describe()
    assert job.injected_at is not None, job.describe()
    assert job.latency_s is not None and job.latency_s < LATENCY_LIMIT_S, job.describe()
    assert job.wall_s < WALL_LIMIT_S, job.describe()


@pytest.mark.parametrize("name", RAISING)
def test_an_exception_on_one_rank_ends_the_job_naming_the_rank_and_the_message(jobs: dict[str, Job], name: str) -> None:
    job = jobs[name]
    assert_ended_promptly(job)
    kind, rank = failing(name)
    message = f"injected {kind} failure"
    if name.startswith("spawn"):
        # torch's spawn re-raises the child's error in the launching process, naming its index (= rank here)
        assert f"-- Process {rank} terminated with the following error:" in job.output, job.describe()
        assert message in job.output.split(f"-- Process {rank} terminated", 1)[1], job.describe()
    else:
        # every line a rank prints after the process group exists carries its rank
        assert re.search(rf"^\[rank{rank}\]: .*{message}", job.output, re.MULTILINE), job.describe()
    other = 1 - rank
    observer_killed = name.startswith("lightning") and rank == 1 and OBSERVER_KILL in job.output
    if not name.startswith("spawn") and not observer_killed:
        # the other rank did not hang: its collective failed at once, and it says what that means
        assert re.search(rf"^\[rank{other}\]: .*(Connection closed by peer|Connection reset by peer)", job.output, re.M)
        assert f"[lightning_mgpu] rank {other}: another rank closed its connection" in job.output, job.describe()
    if name.startswith("torchrun"):
        # torchrun's summary lists every failed rank; its "root cause" is only the first it saw exit,
        # which may be the rank that lost its peer
        summary = job.output.split("fail_fit.py FAILED", 1)[1]
        assert f"rank      : {rank} (local_rank: {rank})" in summary, job.describe()


def test_a_killed_rank_under_spawn_is_named_by_its_signal(jobs: dict[str, Job]) -> None:
    job = jobs["spawn-hybrid-sigkill-rank1"]
    assert_ended_promptly(job)
    assert "process 1 terminated with signal SIGKILL" in job.output, job.describe()


def test_a_killed_rank_under_torchrun_is_named_by_its_signal(jobs: dict[str, Job]) -> None:
    job = jobs["torchrun-ddp-sigkill-rank0"]
    assert_ended_promptly(job)
    summary = job.output.split("fail_fit.py FAILED", 1)[1]
    killed = re.search(
        r"rank      : 0 \(local_rank: 0\)\n  exitcode  : -9 .*\n.*\n  traceback : Signal 9 \(SIGKILL\)", summary
    )
    assert killed, job.describe()
    assert "[lightning_mgpu] rank 1: another rank closed its connection" in job.output, job.describe()


def test_a_rank_that_closed_its_connection_but_still_runs_is_not_called_ended(jobs: dict[str, Job]) -> None:
    """Rank 1 fails, destroys its process group (its connections close) and lingers 3 s before its process ends.
    Rank 0's note named a lost peer "process ended" and, in the same sentence, rank 1 "still running". Now it says
    what it knows: either rank 1 is still running (and is given 5 s, then killed), or how it ended, never both."""
    job = jobs["lightning-ddp-step-rank1-slow-exit"]
    assert_ended_promptly(job)
    assert "[fail_fit] lingering 3 s" in job.output, job.describe()
    notes = set(re.findall(r"\[lightning_mgpu\] rank 0: .*", job.output))
    assert notes, job.describe()
    for note in notes:
        assert "process ended" not in note, note
        still_running = re.search(
            r"none ended yet: rank 1 \(pid \d+\); when this process exits it waits up to 5 s", note
        )
        # the failure note, or Lightning's child watcher's line when it saw rank 1's exit first (it kills the job)
        ended = re.search(
            r"(in a collective: rank 1 \(pid \d+\) exited with code 1\. Its own error)"
            r"|(^\[lightning_mgpu\] rank 0: rank 1 \(pid \d+\) exited with code 1\. The error printed by the rank)",
            note,
        )
        assert bool(still_running) != bool(ended), note  # one state for rank 1, said once


def test_a_stuck_rank_is_ended_by_the_collective_timeout_and_then_killed(jobs: dict[str, Job]) -> None:
    """Rank 1 sleeps in training_step: no connection closes. Rank 0 fails after ``timeout``; on its
    way out it gives rank 1 (its child) 5 s, then kills it: nothing is left running."""
    job = jobs["lightning-ddp-stuck-rank1"]
    assert_ended_promptly(job)
    assert job.latency_s is not None and job.latency_s >= TIMEOUT_S, (
        job.describe()
    )  # the timeout, not a crash, ended it
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in job.output, job.describe()
    assert (
        f"[lightning_mgpu] rank 0: a collective did not complete within the timeout (0:00:0{TIMEOUT_S})" in job.output
    )
    assert re.search(r"Ranks started by this process: rank 1 \(pid \d+\) still running", job.output), job.describe()
    assert re.search(r"rank 1 \(pid \d+\) still running 5 s after the fit failed .*: killing it", job.output)


def test_a_collective_only_one_rank_enters_is_ended_by_the_timeout(jobs: dict[str, Job]) -> None:
    """Rank 0 enters a barrier while rank 1 is in DDP's all-reduce: both wait, nothing closes."""
    job = jobs["torchrun-hybrid-mismatch-rank0"]
    assert_ended_promptly(job)
    assert job.latency_s is not None and job.latency_s >= TIMEOUT_S, job.describe()
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in job.output, job.describe()
    assert f"did not complete within the timeout (0:00:0{TIMEOUT_S})" in job.output, job.describe()


def test_latencies_are_reported(jobs: dict[str, Job], capsys: pytest.CaptureFixture[str]) -> None:
    """Not an assertion beyond the ones above: the measured bounds, for the README's table (-s to see)."""
    with capsys.disabled():
        for name, job in jobs.items():
            print(
                f"\n{name:36s} exit {job.returncode!s:>4}  failure->end {job.latency_s or float('nan'):5.1f} s  "
                f"wall {job.wall_s:5.1f} s",
                end="",
            )
        print()
    assert all(job.latency_s is not None for job in jobs.values())
