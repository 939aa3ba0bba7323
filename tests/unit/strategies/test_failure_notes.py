"""The note a surviving rank adds to a failed collective says what is known, and never contradicts itself.

In process: the launching process's children are stand-ins with a fixed ``poll()``. The real
launches (a rank that fails, closes its connections and is slow to exit; a killed rank; a stuck
one) are in ``tests/dist/strategies/test_reliability_failures.py``.
"""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

from lightning_mgpu.strategies.parts import failures as _failures


class _Clock:
    """Stands in for the module's ``time``: ``sleep`` advances ``monotonic`` at once (the 1 s wait for a child
    costs nothing, and no CPU spinning through it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Child:
    """What ``explain_collective_failure`` reads of a ``subprocess.Popen``: its pid and ``poll()``."""

    def __init__(self, pid: int, returncode: Optional[int]) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> Optional[int]:
        return self.returncode


def _explain(children: list[tuple[int, Any]], text: str = "Connection closed by peer [127.0.0.1]:1234") -> str:
    error = RuntimeError(text)
    note = _failures.explain_collective_failure(error, rank=0, timeout=timedelta(seconds=8), children=children)
    assert note is not None and str(error).endswith(note)
    return note


def test_a_child_that_closed_its_connection_but_still_runs_is_not_called_ended(monkeypatch: Any) -> None:
    """The note read "another rank's process ended ... rank 1 (pid ...) still running"."""
    monkeypatch.setattr(_failures, "time", _Clock())  # the 1 s wait for the child: skipped
    note = _explain([(1, _Child(4242, None))])
    assert "process ended" not in note, note
    assert "another rank closed its connection while this rank waited for it in a collective" in note
    assert "is exiting after an error" in note
    assert (
        "Ranks started by this process, none ended yet: rank 1 (pid 4242); when this process exits it waits up to "
        "5 s for them, then kills the ones still running." in note
    )


def test_a_child_that_ended_is_named_with_how_it_ended() -> None:
    note = _explain([(1, _Child(4242, -signal.SIGKILL))])
    assert "in a collective: rank 1 (pid 4242) killed by SIGKILL. Its own error, printed by it, is the cause." in note
    assert "still running" not in note and "none ended yet" not in note


def test_with_several_children_each_is_listed_once_in_its_own_state(monkeypatch: Any) -> None:
    monkeypatch.setattr(_failures, "time", _Clock())
    note = _explain([(1, _Child(11, 1)), (2, _Child(12, None)), (3, _Child(13, -signal.SIGTERM))])
    assert ": rank 1 (pid 11) exited with code 1, rank 3 (pid 13) killed by SIGTERM. Their own errors" in note
    assert "Still running: rank 2 (pid 12); when this process exits" in note
    assert note.count("rank 2") == 1 and "none ended yet" not in note


def test_a_rank_that_started_no_process_says_what_a_closed_connection_can_mean() -> None:
    note = _explain([], text="Connection reset by peer")
    assert note.startswith("[lightning_mgpu] rank 0: another rank closed its connection")
    assert "(its process failed, was killed, or is exiting after an error)" in note
    assert "still running" not in note and "process ended" not in note


def test_a_timeout_names_the_children_as_they_are() -> None:
    note = _explain([(1, _Child(4242, None))], text="Timed out waiting 8000ms for recv")
    assert "did not complete within the timeout (0:00:08)" in note
    assert "Ranks started by this process: rank 1 (pid 4242) still running." in note


def test_other_errors_and_explained_ones_are_left_alone() -> None:
    error = RuntimeError("shape mismatch")
    assert _failures.explain_collective_failure(error, rank=0, timeout=None, children=[]) is None
    assert str(error) == "shape mismatch"
    explained = RuntimeError("Connection closed by peer\n[lightning_mgpu] rank 1: said before")
    assert _failures.explain_collective_failure(explained, rank=1, timeout=None, children=[]) is None


def test_lightnings_observer_names_the_ended_rank_before_it_kills_the_job(capsys: Any, monkeypatch: Any) -> None:
    """Rank 1 was SIGKILLed while rank 0 (the launching process) was busy in its step: Lightning's observer thread
    killed the job before rank 0 reached the collective that would have failed and named rank 1 (seen in CI). The
    observer now names it first; after this process's own fit failed, or a hang report, it says nothing."""
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    from lightning_mgpu._compat.lightning import before_children_are_killed
    from lightning_mgpu.watch.watcher import HANG_EXIT_CODE

    killed, running = _Child(4242, -signal.SIGKILL), _Child(4243, None)
    procs = [killed, running]
    nobody = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it: a stray kill finds no one
    observer = _ChildProcessObserver(main_pid=nobody, child_processes=procs, sleep_period=3600)  # type: ignore[arg-type]
    said_before_the_kill: list[str] = []
    observer._terminate_all = lambda: said_before_the_kill.append(capsys.readouterr().err)  # type: ignore[method-assign]
    observer.start()  # sleeps for an hour (a daemon thread): its kill is called below
    assert not before_children_are_killed([killed, running], lambda: None)  # another list: not this observer's
    namer = _failures.child_ends_namer(0, [(1, killed), (2, running)])
    assert before_children_are_killed(procs, namer)
    observer._terminate_all()
    assert said_before_the_kill == [
        "[lightning_mgpu] rank 0: rank 1 (pid 4242) killed by SIGKILL. A process killed by a signal prints no error "
        "of its own (the OOM killer says so in dmesg). Lightning's launcher now kills the ranks it started on this "
        "node and this process (SIGKILL).\n"
    ]
    _failures.fit_failed_here()
    namer()
    assert capsys.readouterr().err == ""
    terminated, failed = _Child(4244, -signal.SIGTERM), _Child(4245, 1)
    _failures.child_ends_namer(0, [(1, terminated)])()  # the next launch: its fit has not failed
    assert "rank 1 (pid 4244) killed by SIGTERM. A process killed by a signal prints no error of its own. " in (
        capsys.readouterr().err
    )
    _failures.child_ends_namer(0, [(1, killed), (2, failed)])()
    assert (
        "rank 1 (pid 4242) killed by SIGKILL, rank 2 (pid 4245) exited with code 1. The error printed by the rank "
        "that exited is the cause." in capsys.readouterr().err
    )
    _failures.child_ends_namer(0, [(1, _Child(4246, HANG_EXIT_CODE))])()  # the hang report has said it all
    assert capsys.readouterr().err == ""
    children = [(1, _Child(4247, 1)), (2, _Child(4248, None))]
    namer = _failures.child_ends_namer(0, children)
    monkeypatch.setattr(_failures, "time", _Clock())  # the note's 1 s wait for rank 2: skipped
    _explain(children)  # rank 0's collective failed first, and its note named rank 1
    children[1][1].returncode = -signal.SIGKILL  # ...then rank 2 was killed
    namer()
    assert capsys.readouterr().err.startswith("[lightning_mgpu] rank 0: rank 2 (pid 4248) killed by SIGKILL. ")
