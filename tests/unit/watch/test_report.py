"""The report as data and as one screen of text; the states it is made of survive JSON; the loggers get it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_mgpu.watch.diagnosis import diagnose
from lightning_mgpu.watch.report import REPORT_FILE, build, send_to_loggers, write
from lightning_mgpu.watch.state import RankState
from lightning_mgpu.watch.verdict import judge
from tests.unit.watch.builders import at, in_backward, in_barrier, state


def report(**kwargs: Any) -> dict[str, Any]:
    states = [in_barrier(0, site=at(40)), in_backward(1)]
    states[0].stack = [at(90, "main"), at(40)]
    verdict = judge(states, timeout=20.0, silent_limit=10.0)
    return build(states, verdict, diagnose(states, verdict), reporter=0, hang_timeout=20.0, exit_code=124, **kwargs)


def test_the_text_names_every_rank_its_place_the_cause_and_the_exit() -> None:
    text = report()["text"]
    lines = text.splitlines()
    assert (
        lines[0]
        == "[lightning_mgpu] HANG: no progress for 20 s on ranks 0 and 1 (hang_timeout=20 s); reported by rank 0"
    )
    assert (
        "  rank 0: in training_step, batch 2/6 (epoch 0, step 0); waits in barrier (collective #7, 2 ranks) for 25 s"
        in lines
    )
    assert "      at /project/train.py:40 in training_step" in lines
    assert (
        "  rank 1: in backward, batch 2/6 (epoch 0, step 0); waits in backward #3 (DDP's gradient all-reduce)" in lines
    )
    assert any(line.startswith("Likely cause (collective-mismatch): ") for line in lines)
    assert any(line.startswith("Fix: ") for line in lines)
    assert lines[-1].endswith("Every rank now exits with status 124.")
    assert len(lines) < 25 and max(map(len, lines)) <= 160  # one screen


def test_a_preemption_signal_is_named() -> None:
    assert "on ranks 0 and 1 after SIGTERM (hang_timeout=20 s)" in report(signum=15)["text"]


def test_the_json_holds_every_rank_with_its_stack_and_reads_back(tmp_path: Path) -> None:
    data = report()
    path = write(data, str(tmp_path / "logs"))
    assert path == str(tmp_path / "logs" / REPORT_FILE)
    read = json.loads(Path(path).read_text())
    assert read["kind"] == "hang" and read["exit_code"] == 124 and read["diagnosis"]["culprits"] == [0]
    ranks = [RankState.from_dict(r) for r in read["ranks"]]
    assert [r.rank for r in ranks] == [0, 1]
    assert ranks[0].stack == [at(90, "main"), at(40)] and ranks[0].site == at(40)
    assert ranks[0].collective == {"kind": "barrier", "seq": 7, "group_size": 2, "for_s": 25.0}
    assert write(data, None) is None
    assert write(data, str(path)) is None  # a file where the directory should be: not written, no error


def test_a_state_survives_its_round_trip() -> None:
    original = state(3, "validation", idle=4.5, site=at(12, "validation_step"), in_hook=True, c10d="barrier", gone=True)
    assert RankState.from_dict(json.loads(json.dumps(original.as_dict()))) == original


class WandbLike:
    def __init__(self) -> None:
        self.texts: list[tuple[str, list[list[str]]]] = []
        self.finished: list[int] = []
        self.experiment = self

    def log_text(self, key: str, columns: list[str], data: list[list[str]]) -> None:
        self.texts.append((key, data))

    def finish(self, exit_code: int) -> None:
        self.finished.append(exit_code)


class TensorBoardLike:
    class Writer:
        def __init__(self) -> None:
            self.texts: list[tuple[str, str]] = []
            self.flushed = 0

        def add_text(self, tag: str, text: str) -> None:
            self.texts.append((tag, text))

        def flush(self) -> None:
            self.flushed += 1

    def __init__(self) -> None:
        self.experiment = self.Writer()
        self.saved = 0

    def save(self) -> None:
        self.saved += 1


class CSVLike:
    experiment = object()


def test_the_loggers_that_take_text_get_it() -> None:
    data = report()
    wandb, board, csv = WandbLike(), TensorBoardLike(), CSVLike()
    assert send_to_loggers([wandb, board, csv], data) == ["WandbLike", "TensorBoardLike"]
    assert wandb.texts == [("lightning_mgpu/hang_report", [[data["text"]]])] and wandb.finished == [124]
    ((tag, text),) = board.experiment.texts
    assert tag == "lightning_mgpu/hang_report" and "HANG: no progress" in text
    assert board.experiment.flushed == 1 and board.saved == 1


def test_the_docs_staleness_check_ignores_timing_and_the_racy_rank_but_not_a_changed_report() -> None:
    """docs/hangs.md's reports are compared with each run's (tests/dist/watch): numbers, the log directory, the host
    and the title may differ; the SIGKILL report's rank 0 (in its collective, or failing already) may too."""
    from docs import hang_tables

    recorded = hang_tables.load()["reports"]
    sigkill = recorded["sigkill"]["text"]
    now = sigkill.replace("LOG_DIR", "/tmp/run7").replace("on vm)", "on ci-runner-3)").replace("batch 2/6", "batch 3/7")
    assert hang_tables.masked(hang_tables.normalized(now, log_dir="/tmp/run7")) == hang_tables.masked(sigkill)
    lines = sigkill.splitlines()
    failing = "  rank 0: failing with an exception [failed: RuntimeError: Connection closed by peer [127.0.0.1]:5]"
    other = "\n".join([lines[0], failing, *[line for line in lines[1:] if not line.startswith("  rank 0:")]])
    other = other.replace("; rank 0 waits for it in vain.", ".")
    assert hang_tables.masked(other, racy_rank=0) == hang_tables.masked(sigkill, racy_rank=0)
    assert hang_tables.masked(other) != hang_tables.masked(sigkill)  # only where the race is named
    barrier = recorded["barrier"]["text"]
    moved = barrier.replace("hang_fit.py:115 in go_wrong", "hang_fit.py:115 in training_step")
    assert hang_tables.masked(moved) != hang_tables.masked(barrier)
