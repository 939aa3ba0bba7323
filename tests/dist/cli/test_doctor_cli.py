"""``lightning-mgpu doctor`` for real: JSON shape, exit codes, provoked warnings and failures, masked secrets.

The checks one by one, in-process: tests/unit/cli/test_doctor_cli.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from lightning_mgpu import envcheck
from lightning_mgpu.cli import _allreduce
from tests.conftest import REPO, cpu_env, run_python
from tests.helpers.cli import SECRET

CHECK_NAMES = {
    "python",
    "torch",
    "torchvision",  # paired with torch (issue 18: a mismatch breaks import lightning)
    "lightning",
    "cuda",
    "nccl",
    "driver",
    "devices",
    "backends",
    "gloo all_reduce",
    "nccl all_reduce",
    "launcher",
    "master",
    "/dev/shm",
    "open files",
    "environment",
}


def doctor(*flags: str, env: dict[str, str]) -> tuple[int, dict[str, Any], str]:
    proc = run_python(
        ["-m", "lightning_mgpu.cli", "doctor", "--json", *flags], cwd=REPO, timeout=90, env=env, check=False
    )
    return proc.returncode, json.loads(proc.stdout), proc.stdout + proc.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_json_report_with_a_real_allreduce_a_provoked_warning_and_a_masked_secret() -> None:
    env = cpu_env(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "80", "WANDB_API_KEY": SECRET, "MY_SERVICE_TOKEN": "hunter2"}
    )
    code, result, output = doctor(env=env)
    assert code == 0, output  # warnings only
    assert set(result) == {"version", "status", "elapsed_s", "counts", "checks"}
    assert result["status"] == "warn" and result["elapsed_s"] > 0
    checks = {c["name"]: c for c in result["checks"]}
    assert set(checks) == CHECK_NAMES
    for check in result["checks"]:
        assert set(check) == {"name", "status", "value", "fix", "details"}
        assert check["status"] in ("ok", "warn", "fail")
        assert (check["fix"] is None) == (check["status"] == "ok"), check  # a fix for every warn and fail
    assert result["counts"] == {s: sum(c["status"] == s for c in result["checks"]) for s in ("ok", "warn", "fail")}
    smoke = checks["gloo all_reduce"]
    assert smoke["status"] == "ok", smoke
    assert [r["wrong"] for r in smoke["details"]["ranks"]] == [0, 0]
    assert all(r["allreduce_ms"] > 0 for r in smoke["details"]["ranks"]) and "ms per all_reduce" in smoke["value"]
    master = checks["master"]
    assert master["status"] == "warn" and "privileged" in master["value"] and "1024" in master["fix"]
    # Secrets never leave the process: not in the report, not in any log line.
    assert SECRET not in output and "hunter2" not in output
    assert "WANDB_API_KEY=****(40 chars)" in checks["environment"]["value"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_failing_check_makes_the_exit_code_non_zero() -> None:
    code, result, output = doctor("--skip-allreduce", env=cpu_env({"MASTER_PORT": "notaport"}))
    assert code == 1, output
    assert result["status"] == "fail" and result["counts"]["fail"] == 1
    master = next(c for c in result["checks"] if c["name"] == "master")
    assert master["status"] == "fail" and "'notaport' is not a port number" in master["value"] and master["fix"]


@pytest.mark.multiprocess
@pytest.mark.timeout(30)  # the ceiling is the check: waiting for the hung ranks would take far longer
def test_a_hung_allreduce_is_reported_not_waited_for() -> None:
    result = _allreduce.run_allreduce_smoke("gloo", 2, timeout=0.2)
    assert not result["ok"] and "no result within 0.2 s" in result["reason"]
    check = envcheck.Check("gloo all_reduce", "fail", result["reason"], fix="f")
    assert check.status == "fail"
