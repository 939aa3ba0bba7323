"""``lightning-mgpu tune``: bad input answered before anything starts, and a real 2-rank sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_mgpu.cli import main
from tests.conftest import REPO, SCRIPTS, run_python

TARGET = f"{SCRIPTS / 'tune_target.py'}:make_module"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nocolon"], "argument TARGET: expected FILE.py:FUNCTION or MODULE:FUNCTION, got 'nocolon'"),
        (["missing.py:f"], "argument TARGET: no such file: 'missing.py'"),
        (["no_such_package.models:build"], "argument TARGET: no module named 'no_such_package.models'"),
        ([f"{SCRIPTS / 'tune_target.py'}:absent"], "has no function 'absent'"),
        ([TARGET, "--nproc", "0"], "argument --nproc: expected an integer >= 1, got '0'"),
        ([TARGET, "--nproc", "two"], "argument --nproc: expected an integer >= 1, got 'two'"),
        ([TARGET, "--rounds", "-1"], "argument --rounds: expected an integer >= 1, got '-1'"),
        ([TARGET, "--measure", "0"], "argument --measure"),
        ([TARGET, "--sizes", "0,4"], "argument --sizes"),
        ([TARGET, "--sizes", "a,b"], "argument --sizes"),
        ([TARGET, "--sizes", ""], "argument --sizes"),
        ([TARGET, "--sizes", "1e12"], "argument --sizes"),
        ([TARGET, "--timeout", "nan"], "argument --timeout"),
        ([TARGET, "--accelerator", "tpu"], "argument --accelerator: invalid choice: 'tpu'"),
    ],
)
def test_bad_input_is_one_clear_error_naming_the_argument(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["tune", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("lightning-mgpu tune: error:")


def test_a_function_returning_no_module_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The worker's own check (run in-process here), then the launcher's output as the command shows it."""
    from lightning_mgpu.cli.workers import tune as sweep

    target = f"{SCRIPTS / 'tune_target.py'}:not_a_module"
    with pytest.raises(SystemExit) as info:
        sweep.run(["--target", target, "--out", str(tmp_path / "x.json")])
    assert info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        "lightning-mgpu tune: error: the function must return a LightningModule or (LightningModule, DataLoader), got int"
    )


def test_a_worker_error_is_shown_alone_without_the_launchers_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess

    worker_line = "lightning-mgpu tune: error: the function must return a LightningModule, got int"

    class Launcher:  # what torch.distributed.run prints when both ranks exit with that line
        pid, returncode = 0, 1

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def communicate(self, timeout: float = 0) -> tuple[str, None]:
            return f"{worker_line}\n{worker_line}\nTraceback (most recent call last):\nChildFailedError: ...\n", None

    monkeypatch.setattr(subprocess, "Popen", Launcher)
    assert main(["tune", TARGET, "--out-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == worker_line


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sweep_prints_the_table_and_writes_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    args = ["-m", "lightning_mgpu.cli", "tune", TARGET, "--sizes", "0.25,1", "--rounds", "2", "--measure", "2"]
    proc = run_python([*args, "--out-dir", str(out)], cwd=REPO, timeout=100)
    assert "bucket size -> step time (2 ranks, gloo)" in proc.stdout
    assert "recommended:" in proc.stdout and "25 (DDP default)" in proc.stdout
    result = json.loads((out / "tune.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    record = result["tuning"]
    assert record["status"] == "done" and record["rounds"] == 2 and record["measure"] == 2
    candidates = record["candidates"]
    assert [c["cap_mb"] for c in candidates] == [25.0, 0.25, 1.0]
    # 2 rounds of 2 steps; more rounds for the default and the closest layouts when the decision is open (issue 14)
    assert all(c["steps"] == 2 * len(c["round_ms"]) >= 4 and c["step_ms"] > 0 for c in candidates)
    assert all(c["built_bytes"] == c["bucket_bytes"] for c in candidates)
    assert record["outcome"] in ("faster", "not faster", "too noisy")
    assert sum(candidates[0]["bucket_bytes"]) == result["gradient_bytes"]
    assert record["chosen_mb"] in (25.0, 0.25, 1.0)
    png = (out / "tune.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
