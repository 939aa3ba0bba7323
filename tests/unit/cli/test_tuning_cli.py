"""``lightning-mgpu tune``: bad input answered before anything starts.

A real 2-rank sweep: tests/dist/cli/test_tuning_cli.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mgpu.cli import main
from tests.conftest import SCRIPTS
from tests.helpers.cli import TARGET


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
