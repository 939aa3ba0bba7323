"""The classic patterns, told apart from the ranks' states, each naming the right rank, line and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mgpu.watch.diagnosis import diagnose, rank_condition
from lightning_mgpu.watch.sampling import Frame
from lightning_mgpu.watch.verdict import Verdict, judge
from tests.unit.watch.builders import at, collective, in_backward, in_barrier, state

USER_CODE = """\
class Net:
    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).sum()
        if batch_idx == 2:
            if self.global_rank == 0:
                self.trainer.strategy.barrier()
        if self.trainer.is_global_zero:
            self.log("loss", loss, sync_dist=True)
        return loss
"""


@pytest.fixture
def user_file(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text(USER_CODE)
    return str(path)


def judged(*states: object) -> tuple[list[object], Verdict]:
    found = judge(list(states), timeout=20.0, silent_limit=10.0)  # type: ignore[arg-type]
    assert found.hang
    return list(states), found


def test_a_collective_under_a_rank_condition(user_file: str) -> None:
    states, verdict = judged(in_barrier(0, site=Frame(user_file, 6, "training_step")), in_backward(1))
    found = diagnose(states, verdict)  # type: ignore[arg-type]
    assert found.cause == "collective-mismatch" and found.culprits == [0]
    assert "rank 0 entered barrier (collective #7, 2 ranks) at" in found.summary
    assert f"{user_file}:5: `if self.global_rank == 0:`" in found.summary
    assert "rank 1 waits in backward #3 (DDP's gradient all-reduce)" in found.summary
    assert "call it on every rank" in found.fix


def test_sync_dist_logged_by_one_rank(user_file: str) -> None:
    logging = state(0, idle=25.0, collective=collective("all_reduce", 9), site=Frame(user_file, 8, "training_step"))
    logging.in_hook = True
    states, verdict = judged(logging, in_backward(1))
    found = diagnose(states, verdict)  # type: ignore[arg-type]
    assert found.cause == "collective-mismatch" and found.culprits == [0]
    assert "`if self.trainer.is_global_zero:`" in found.summary
    assert "self.log(..., sync_dist=True)" in found.fix and "rank_zero_only=True" in found.fix


def test_rank_condition_looks_only_at_enclosing_blocks(user_file: str) -> None:
    assert rank_condition(Frame(user_file, 6, "training_step")) == (5, "if self.global_rank == 0:")
    assert rank_condition(Frame(user_file, 3, "training_step")) is None  # the def ends the search
    assert rank_condition(Frame(user_file + ".missing", 6, "training_step")) is None


def test_uneven_batches_a_rank_past_its_run() -> None:
    short = state(1, "after_run", idle=40.0, watching=False, batches=3, batches_done=3, c10d="barrier", site=at(99))
    long = state(0, "data_fetch", idle=20.0, batches_done=3, collective=collective("broadcast", 14))
    states, verdict = judged(long, short)
    found = diagnose(states, verdict)  # type: ignore[arg-type]
    assert found.cause == "uneven-batches" and found.culprits == [1]
    assert "rank 1 ran 3 training batches (3 per epoch)" in found.summary
    assert "with 3 of its 6 batches done" in found.summary
    assert "use_distributed_sampler=True" in found.fix


def test_uneven_batches_when_the_short_rank_has_died_after_its_run() -> None:
    """Its collective after fit failed against the others' training ones (gloo may say so): still uneven batches."""
    short = state(1, "after_run", idle=40.0, watching=False, batches=3, batches_done=3, gone=True, site=at(99))
    long = state(0, "data_fetch", idle=20.0, batches_done=3, collective=collective("broadcast", 14))
    found = diagnose(*judged(long, short))  # type: ignore[arg-type]
    assert found.cause == "uneven-batches" and found.culprits == [1]
    assert "(its process has ended since)" in found.summary


def test_uneven_batches_loaders_of_different_lengths() -> None:
    short = state(1, "train_epoch_end", idle=25.0, batches=3, batches_done=3, collective=collective("all_reduce", 8))
    long = in_backward(0)
    found = diagnose(*judged(long, short))  # type: ignore[arg-type]
    assert found.cause == "uneven-batches" and found.culprits == [1]


def test_a_rank_still_validating_while_the_others_train() -> None:
    validating = state(1, "validation", idle=0.2, batch=57, batches=200, site=at(60, "validation_step"), in_hook=True)
    waiting = state(0, "data_fetch", idle=20.0, collective=collective("broadcast", 17))
    found = diagnose(*judged(waiting, validating))  # type: ignore[arg-type]
    assert found.cause == "rank-elsewhere" and found.culprits == [1]
    assert "rank 1 is still in validation, batch 57/200 at /project/train.py:60" in found.summary
    assert "same number of validation batches" in found.fix


def test_a_rank_stuck_outside_any_collective() -> None:
    sleeping = state(1, "forward", idle=21.0, site=at(77), in_hook=True)
    found = diagnose(*judged(in_backward(0), sleeping))  # type: ignore[arg-type]
    assert found.cause == "stuck-outside-collective" and found.culprits == [1]
    assert "at /project/train.py:77 in training_step" in found.summary and "in no collective" in found.summary


def test_a_rank_stuck_in_its_data_loader() -> None:
    loading = state(1, "data_fetch", idle=21.0, site=at(30, "__getitem__", "/project/data.py"))
    found = diagnose(*judged(in_backward(0), loading))  # type: ignore[arg-type]
    assert found.cause == "stuck-outside-collective" and "It is loading data." in found.summary
    assert "/project/data.py:30 in __getitem__" in found.summary and "num_workers" in found.fix


def test_a_dead_rank() -> None:
    dead = state(1, "forward", idle=2.0, gone=True, site=at(81), in_hook=True)
    found = diagnose(*judged(in_barrier(0, idle=12.0), dead))  # type: ignore[arg-type]
    assert found.cause == "rank-died" and found.culprits == [1]
    assert "rank 1: its process (pid 1001 on node0) has ended; last seen in training_step" in found.summary
    assert "/project/train.py:81" in found.summary and "rank 0 waits for it in vain" in found.summary


def test_every_rank_in_the_same_collective() -> None:
    states = [in_barrier(0, seq=7), in_barrier(1, seq=7)]
    found = diagnose(*judged(*states))  # type: ignore[arg-type]
    assert found.cause == "stuck-in-collective" and found.culprits == []
    assert "NCCL_DEBUG=INFO" in found.fix


def test_a_rank_that_ended_its_run_while_the_others_train_is_named_not_a_crash() -> None:
    """Seen in CI (tests/dist/callbacks/doctor/test_doctor.py, uneven batches with the doctor only warning): rank 1
    ended its fit and its process while rank 0 still trained; rank 0's failure report found no pattern and built its
    fallback text from the (empty) list of blocked ranks: IndexError, raised from the strategy's on_exception in place
    of DDP's own error."""
    finished = state(1, "after_run", watching=False, gone=True)
    diagnosis = diagnose([state(0, "backward"), finished], Verdict(False, [], [1], [], 300.0))
    assert diagnosis.culprits == [1] and "rank 1 left the job" in diagnosis.summary


def test_the_failure_report_never_replaces_the_runs_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from lightning_mgpu.watch import watcher

    watch = watcher.HangWatch(output=io.StringIO(), threaded=False)

    def broken(*_: object) -> str:
        raise IndexError("list index out of range")

    monkeypatch.setattr(watch, "_report_left", broken)
    monkeypatch.setattr(watch, "_state", lambda *_, **__: None)
    monkeypatch.setattr(watch, "_sample", lambda: None)
    watch._run, watch._main_channel, watch._watching = object(), object(), True  # type: ignore[assignment]
    assert watch.report_failure(RuntimeError("Connection closed by peer")) is None
    assert "the report of the ranks that left failed: IndexError" in watch._output.getvalue()  # type: ignore[union-attr]
