"""`lightning-mgpu plan`: a model factory and a sample shape in, one plan per balance mode out.

The in-process cases: tests/unit/cli/test_cli_plan.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_python
from tests.helpers import cli

workdir = cli.workdir  # a fixture, shared with tests/unit/cli/test_cli_plan.py


def _plan(workdir: Path, *flags: str, check: bool = True):
    return run_python(["-m", "lightning_mgpu.cli", "plan", *flags], cwd=workdir, timeout=120, check=check)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_plan_prints_every_balance_mode_and_writes_json(workdir: Path) -> None:
    out = workdir / "plan.json"
    proc = _plan(
        workdir,
        "plan_factory_mod:build",
        "--shape",
        "64,16",
        "--devices",
        "2",
        "--microbatches",
        "4",
        "--json",
        str(out),
    )
    for mode in ("balance='time'", "balance='memory'", "balance='params'", "(fastest)", "ideal speed-up"):
        assert mode in proc.stdout, mode
    payload = json.loads(out.read_text())
    assert payload["sample_shape"] == [16, 16]  # one micro-batch of 64 / 4
    assert set(payload["plans"]) == {"time", "memory", "params"}
    for plan in payload["plans"].values():
        assert sum(plan["sizes"]) == 5 and len(plan["sizes"]) == 2 and plan["microbatches"] == 4
        assert len(plan["layers"]) == 5 and plan["stage_time_ms"] and plan["ideal_speedup"] > 0
    assert payload["plans"]["params"]["stage_params"] == [272 + 272 + 8704, 8208 + 272]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_plan_finds_the_sequential_inside_a_module(workdir: Path) -> None:
    proc = _plan(workdir, "plan_factory_mod:wrapped", "--shape", "8,16", "--devices", "3", "--repeats", "1")
    assert "5 layers over 3 devices" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_sample_the_model_cannot_take_is_reported_as_such(workdir: Path) -> None:
    proc = _plan(workdir, "plan_factory_mod:build", "--shape", "8,7", check=False)
    assert proc.returncode == 2 and "running the model on a sample of shape [8, 7] (float32) failed" in proc.stderr
    assert "Traceback" not in proc.stderr
