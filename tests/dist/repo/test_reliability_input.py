"""Bad input gets one clear error naming what is wrong, before anything starts; safe defaults (launched).

* bad flags from the console: exit code 2, one ``error:`` line naming the flag, no traceback;
* a model-dependent mistake (hybrid ``split_module``) under Lightning's launcher, ``python
  train.py`` and spawn: one error from the launching process, no rank started;
* commands that start processes listen on the loopback interface only.

Every constructor and flag fuzzed, ``partition``, checkpoints and the doctor's report, in-process:
tests/unit/repo/test_reliability_input.py.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cpu_env
from tests.scripts.fail_harness import child_env, launch, listening_while_running


@pytest.mark.multiprocess
@pytest.mark.timeout(300)  # four CLI runs in a child each, ~10 s apiece on a loaded 2-core machine
def test_bad_input_from_the_console_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "factory_mod.py").write_text("def boom():\n    raise RuntimeError('factory exploded')\n")
    env = cpu_env()
    for argv, message in (
        (
            ["plan", "factory_mod:boom", "--shape", "8,16"],
            "calling factory_mod:boom() failed: RuntimeError: factory exploded",
        ),
        (["tune", "factory_mod.py:boom", "--nproc", "0"], "argument --nproc: expected an integer >= 1, got '0'"),
        (["bench-comm", "--timeout", "inf"], "--timeout must be > 0 seconds and at most"),
        (["doctor", "--timeout", "nan"], "argument --timeout"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_mgpu.cli", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stdout == "", (argv, proc.stderr)
        assert proc.stderr.strip().splitlines()[-1].endswith(message) or message in proc.stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- model-dependent mistakes


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_a_model_dependent_mistake_is_one_error_before_any_rank_starts(tmp_path: Path, start_method: str) -> None:
    flags = [
        "--strategy",
        "hybrid",
        "--strategy-kwargs",
        json.dumps({"split_module": "bodyy"}),
        "--start-method",
        start_method,
    ]
    job = launch("split-module-typo", tmp_path / "out", flags, timeout=120)
    assert job.returncode == 1 and not job.timed_out, job.describe()
    assert job.output.count("Traceback (most recent call last)") == 1, job.describe()
    assert job.output.strip().splitlines()[-1] == (
        "ValueError: split_module='bodyy': Net.bodyy is nothing, not an nn.Sequential. Point split_module at the "
        "nn.Sequential holding the layers to split."
    )
    assert "[rank1]" not in job.output and "Initializing distributed" not in job.output  # no rank was started
    assert job.leftover == []


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_commands_that_start_processes_listen_on_loopback_only(tmp_path: Path) -> None:
    """bench-comm and doctor rendezvous through a TCPStore: bound to 127.0.0.1, not every interface."""
    for argv in (["bench-comm", "--quiet", "--max-bytes", "64KiB"], ["doctor", "--json"]):
        command = [sys.executable, "-m", "lightning_mgpu.cli", *argv]
        code, seen = listening_while_running(command, env=child_env(), cwd=tmp_path, timeout=150)
        assert code == 0, argv
        assert seen, f"{argv}: no listening socket was ever seen: the probe is broken"
        addresses = [entry.split(" (")[0].rsplit(":", 1)[0] for entry in seen]
        assert all(ipaddress.ip_address(a).is_loopback for a in addresses), (argv, seen)
