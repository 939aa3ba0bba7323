"""`lightning-mgpu plan` in-process: bad input, file targets, split points.

The command run for real: tests/dist/cli/test_cli_plan.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_mgpu.cli import main
from tests.helpers import cli

workdir = cli.workdir  # a fixture, shared with tests/dist/cli/test_cli_plan.py


def _plan_here(workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *flags: str):
    """In this process (no torch import per case): exit code and stderr."""
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *flags])
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["plan_factory_mod", "--shape", "8,16"],
            "expected FILE.py:FUNCTION or MODULE:FUNCTION, got 'plan_factory_mod'",
        ),
        (["no_such_mod:build", "--shape", "8,16"], "no module named 'no_such_mod'"),
        (["plan_factory_mod:missing", "--shape", "8,16"], "plan_factory_mod has no function 'missing'"),
        (["plan_factory_mod:two", "--shape", "8,16"], "has 2 nn.Sequential children; name one with --split-module"),
        (
            ["plan_factory_mod:wrapped", "--shape", "8,16", "--split-module", "stem"],
            "--split-module 'stem' is not an nn.Sequential",
        ),
        (["plan_factory_mod:build", "--shape", "8,x"], "argument --shape"),
        (["plan_factory_mod:build", "--shape", "0,16"], "every size must be >= 1"),
        (
            ["plan_factory_mod:build", "--shape", "8,16", "--devices", "0"],
            "argument --devices: expected an integer >= 1",
        ),
        (["plan_factory_mod:build", "--shape", "8,16", "--devices", "6"], "5 layers, fewer than --devices 6"),
        (
            ["plan_factory_mod:build", "--shape", "8,16", "--capacity", "lots"],
            "argument --capacity: cannot read 'lots'",
        ),
        (["plan_factory_mod:build", "--shape", "8,16", "--device", "cuda"], "CUDA is not available"),
    ],
)
@pytest.mark.usefixtures("no_gpu_visible")  # asserts CPU behaviour, also on a GPU machine
def test_bad_input_gets_one_clear_line_and_no_traceback(
    workdir: Path, flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _plan_here(workdir, monkeypatch, capsys, *flags)
    assert code == 2, err
    assert message in err


def test_a_gpu_the_machine_does_not_have_gets_one_clear_line(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device cuda:99`` on a machine with one GPU: refused before anything runs (it ran the plan, seen on an
    H100 machine)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, err = _plan_here(
        workdir, monkeypatch, capsys, "plan_factory_mod:build", "--shape", "8,16", "--device", "cuda:99"
    )
    assert code == 2, err
    assert "argument --device: cuda:99 is not on this machine (1 GPU(s) visible: cuda:0 to cuda:0)" in err
    assert "Traceback" not in err


def test_plan_takes_a_file_target_like_tune(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """FILE.py:FUNCTION as well as MODULE:FUNCTION: one target syntax for every command (in this process)."""
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(sys, "path", list(sys.path))
    target = f"{workdir / 'plan_factory_mod.py'}:build"
    assert main(["plan", target, "--shape", "8,16", "--repeats", "1"]) == 0
    assert "5 layers over 2 devices" in capsys.readouterr().out
    code, err = _plan_here(workdir, monkeypatch, capsys, f"{workdir / 'absent.py'}:build", "--shape", "8,16")
    assert code == 2 and "argument TARGET: no such file" in err


RESNETISH = """
import torch.nn as nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x.mean()

def net():
    return Net()

def flat():  # a ResNet-ish model flattened into a Sequential: in-place ReLU and BatchNorm as layers
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3), nn.ReLU(inplace=True))
"""


def test_split_points_on_an_unmodified_model_with_batchnorm_and_in_place_relu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plan_resnetish.py").write_text(RESNETISH)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "points.json"
    # M = 4 micro-batches of a 4-sample batch: measured on 2 samples (BatchNorm refuses 1 per channel in training)
    flags = ["plan", "plan_resnetish:net", "--shape", "4,3,8,8", "--microbatches", "4", "--repeats", "2"]
    assert main([*flags, "--split-points", "blocks.2", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["split_points"] == ["blocks.2"] and payload["sample_shape"] == [2, 3, 8, 8]
    assert len(payload["stage_time_ms"]) == 2 and all(t > 0 for t in payload["stage_time_ms"])
    assert "blocks.2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*flags, "--split-points", "blocks.7"])
    assert "split point 'blocks.7' is not a submodule of Net" in capsys.readouterr().err
    # the flattened Sequential with in-place ReLU layers and BatchNorm plans under every balance mode
    assert main(["plan", "plan_resnetish:flat", "--shape", "4,3,8,8", "--microbatches", "4", "--repeats", "2"]) == 0
