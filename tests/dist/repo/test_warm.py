"""A warm start (``tests/warm.py``) is the process a cold ``python ARGS`` would have been, only started sooner.

One probe script reports what a process sees of itself (argv, ``__main__``, ``sys.path[0]``, working
directory, environment, session, stdin), run warm and cold with the same arguments: the reports must
match except for the process ids. Exit codes, deaths by signal, separate and merged output, timeouts
and the fallbacks to a cold start are checked on the warm handle. That the fast lane cannot start
one: tests/unit/repo/test_warm.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import warm
from tests.conftest import REPO, cpu_env
from tests.helpers import repo

probe = repo.probe  # a fixture, shared with tests/unit/repo/test_warm.py


def _run(command: list[str], cwd: Path, **env: str) -> tuple[Any, int, str, str]:
    with warm.start(
        [sys.executable, *command],
        cwd=cwd,
        env=cpu_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        out, err = process.communicate(timeout=60)
    return process, int(process.returncode), out, err


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_warm_script_sees_what_a_cold_one_sees(probe: Path, tmp_path: Path) -> None:
    warm_process, code, out, err = _run([str(probe), "a", "--b"], tmp_path, PROBE_VALUE="x")
    cold_process, cold_code, cold_out, cold_err = _run(
        [str(probe), "a", "--b"], tmp_path, PROBE_VALUE="x", MGPU_TEST_COLD="1"
    )
    assert isinstance(warm_process, warm.WarmProcess) and isinstance(cold_process, subprocess.Popen)
    assert code == cold_code == 0, err
    report, cold_report = json.loads(out), json.loads(cold_out)
    assert report == cold_report
    assert report["argv"] == [str(probe), "a", "--b"] and report["main_spec"] is None
    assert report["path0"] == str(probe.parent) and report["cwd"] == str(tmp_path) and report["env"] == "x"
    assert report["session_leader"] and report["stdin_empty"] and report["sibling_importable"]
    assert err == cold_err == "to stderr\n"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_warm_module_run_sees_what_python_dash_m_gives(probe: Path) -> None:
    process, code, out, _ = _run(["-m", "probe_pkg.probe", "z"], probe.parents[1])
    cold, cold_code, cold_out, _ = _run(["-m", "probe_pkg.probe", "z"], probe.parents[1], MGPU_TEST_COLD="1")
    assert isinstance(process, warm.WarmProcess) and code == cold_code == 0
    report = json.loads(out)
    assert report == json.loads(cold_out)
    assert report["argv"] == [str(probe), "z"] and report["main_spec"] == "probe_pkg.probe"
    assert report["path0"] == str(probe.parents[1])


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_exit_codes_signals_and_errors_reach_the_handle(probe: Path, tmp_path: Path) -> None:
    assert _run([str(probe)], tmp_path, PROBE_EXIT="3")[1] == 3
    assert _run([str(probe)], tmp_path, PROBE_SIGNAL=str(int(signal.SIGTERM)))[1] == -signal.SIGTERM
    _, code, _, err = _run([str(probe)], tmp_path, PROBE_RAISE="1")
    assert code == 1 and "RuntimeError: raised in the probe" in err
    _, code, _, err = _run([str(tmp_path / "missing.py")], tmp_path)
    assert code != 0 and "missing.py" in err


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_merged_output_timeouts_and_a_kill_by_session(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, time\nprint('out', flush=True)\nprint('err', file=sys.stderr, flush=True)\ntime.sleep(60)\n"
    )
    process = warm.start(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert isinstance(process, warm.WarmProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=3)
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.1)
    os.killpg(process.pid, signal.SIGKILL)
    out, err = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL and out == "out\nerr\n" and err is None


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_code_and_other_start_time_settings_start_cold(probe: Path, tmp_path: Path) -> None:
    piped = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    code = [sys.executable, "-c", "import sys; print('torch' in sys.modules)"]
    with warm.start(code, cwd=tmp_path, env=cpu_env(), text=True, **piped) as process:
        assert isinstance(process, subprocess.Popen) and process.communicate(timeout=60)[0] == "False\n"
    script = [sys.executable, str(probe)]
    with warm.start(script, cwd=tmp_path, env=cpu_env(), **piped) as warmed:  # the control: this one is warm
        assert isinstance(warmed, warm.WarmProcess)
        warmed.communicate(timeout=60)
    for changed in ({"OMP_NUM_THREADS": "2"}, {"PYTHONHASHSEED": "1"}, {"PYTHONPATH": str(REPO)}):
        with warm.start(script, cwd=tmp_path, env=cpu_env(changed), **piped) as cold:
            assert isinstance(cold, subprocess.Popen), changed
            cold.communicate(timeout=60)
    # output the handle would not read the way the tests do: cold, with Popen's own handling
    with warm.start(script, cwd=tmp_path, env=cpu_env(), stdout=subprocess.DEVNULL) as cold:
        assert isinstance(cold, subprocess.Popen) and cold.wait(timeout=60) == 0
    # asked for: the tests of launching itself (failures, preemption, the labs) start cold
    with warm.start(script, cwd=tmp_path, env=cpu_env(), cold=True, **piped) as cold:
        assert isinstance(cold, subprocess.Popen) and cold.wait(timeout=60) == 0
