"""``lightning-mgpu doctor``'s checks in-process: fix sentences, masked secrets, the environment,
launchers, master address and port, limits, the text report.

The command for real (JSON shape, exit codes, a hung all_reduce): tests/dist/cli/test_doctor_cli.py.
"""

from __future__ import annotations

import os

import pytest

from lightning_mgpu import cli, envcheck
from lightning_mgpu.callbacks.doctor import RULE_IDS
from lightning_mgpu.envcheck import Check
from tests.helpers.cli import SECRET


# ----------------------------------------------------------------------------- the checks, in this process


def test_checks_need_a_fix_sentence_for_warn_and_fail() -> None:
    with pytest.raises(ValueError, match="needs a fix"):
        Check("x", "warn", "v")
    with pytest.raises(ValueError, match="status must be one of"):
        Check("x", "bad", "v", fix="f")


@pytest.mark.parametrize(
    ("name", "value", "masked"),
    [
        ("WANDB_API_KEY", SECRET, True),
        ("HF_TOKEN", "short", True),
        ("DB_PASSWORD", "x", True),
        ("NCCL_SOMETHING", "a9F3k2LmQ8zX7pW1vB6nT4yR0c", True),  # looks like a key whatever its name
        ("CUDA_HOME", "/usr/local/cuda-12.4/targets/x86_64-linux", False),
        ("NCCL_SOCKET_IFNAME", "eth0", False),
        ("WANDB_MODE", "offline", False),
        ("MASTER_ADDR", "node-017.cluster.example.org", False),
        ("PL_SOMETHING", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.abc", True),  # a JWT
    ],
)
def test_secret_looking_values_are_masked(name: str, value: str, masked: bool) -> None:
    shown = envcheck.mask(name, value)
    assert (shown == f"****({len(value)} chars)") is masked
    assert (value not in shown) is masked


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("WANDB_BASE_URL", "https://alice:hunter2pass@h", "https://alice:****@h"),
        ("HF_ENDPOINT", "https://bob:s3cr3t@hub.example.org/path", "https://bob:****@hub.example.org/path"),
        ("PIP_INDEX_URL", "https://user:pa:ss@pypi.example.org/simple", "https://user:****@pypi.example.org/simple"),
        ("GIT_URL", "https://ghp_a9F3k2LmQ8zX7pW1vB6nT4yR0c@github.com/o/r", "****(53 chars)"),  # a key-like token
        (
            "PIP_EXTRA_INDEX_URL",
            "https://deploy_token_for_ci_builds@gitlab.example.org/simple",
            "https://****@gitlab.example.org/simple",
        ),
        ("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p", "/tmp/nccl.%h.%p"),
        ("WANDB_BASE_URL", "https://api.wandb.ai", "https://api.wandb.ai"),
        ("MASTER_ADDR", "git@node-1", "git@node-1"),
        ("MY_PRIVATE_KEY", "-----BEGIN", "****(10 chars)"),
        ("AWS_SECRET_ACCESS_KEY", "abc", "****(3 chars)"),
        ("GITHUB_TOKEN", "ghp_x", "****(5 chars)"),
        ("SOME_CREDENTIALS_FILE", "/home/me/creds.json", "****(19 chars)"),
        ("DATABASE_PASSWORD", "pw", "****(2 chars)"),
    ],
)
def test_realistic_variables_never_show_a_secret(name: str, value: str, shown: str) -> None:
    assert envcheck.mask(name, value) == shown


def test_url_passwords_are_masked_in_the_table_and_in_json(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"WANDB_BASE_URL": "https://alice:hunter2pass@h", "NCCL_DEBUG": "INFO"}
    listed = envcheck.relevant_environment({**env, "MASTER_ADDR": "https://carol:pw123@x"})
    assert "hunter2pass" not in repr(listed) and "pw123" not in repr(listed)
    check = envcheck.detect_launcher({"MASTER_ADDR": "https://carol:pw123@x", "MASTER_PORT": "1"})
    assert "pw123" not in repr(check.details)


def test_environment_lists_only_distributed_variables() -> None:
    env = {"HOME": "/root", "NCCL_DEBUG": "INFO", "WANDB_API_KEY": SECRET, "RANK": "0", "SLURM_PROCID": "3"}
    assert envcheck.relevant_environment(env) == {
        "NCCL_DEBUG": "INFO",
        "RANK": "0",
        "SLURM_PROCID": "3",
        "WANDB_API_KEY": "****(40 chars)",
    }
    check = envcheck.check_environment({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert check.status == "warn" and "unset" in check.fix


@pytest.mark.parametrize(
    ("value", "entries", "problem"),
    [
        (None, None, None),
        ("", [], None),
        ("0,1", ["0", "1"], None),
        ("GPU-4f2a,MIG-77", ["GPU-4f2a", "MIG-77"], None),
        ("0,0", ["0", "0"], "twice"),
        ("0,,1", ["0", "", "1"], "empty entry"),
        ("gpu0", ["gpu0"], "neither an index"),
    ],
)
def test_cuda_visible_devices_parsing(value: str | None, entries: list[str] | None, problem: str | None) -> None:
    got_entries, got_problem = envcheck.parse_visible_devices(value)
    assert got_entries == entries
    assert (got_problem is None) == (problem is None) and (problem is None or problem in got_problem)


@pytest.mark.parametrize(
    ("env", "status", "words"),
    [
        ({}, "ok", "none (plain process"),
        (
            {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4"},
            "ok",
            "torchrun (rank 1 of 4)",
        ),
        ({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8", "SLURM_PROCID": "3"}, "ok", "SLURM (job 42, 8 task(s))"),
        ({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8"}, "warn", "not started by srun"),
        ({"RANK": "2"}, "warn", "RANK set in the environment"),
        ({"RANK": "x"}, "fail", "RANK='x' is not an integer"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "fail", "RANK=4 outside"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "ok", "none (plain process"),
    ],
)
def test_launcher_detection(env: dict[str, str], status: str, words: str) -> None:
    check = envcheck.detect_launcher(env)
    assert check.status == status and words in check.value, check


@pytest.mark.parametrize(
    ("env", "status", "words"),
    [
        ({}, "ok", "unset"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "ok", "MASTER_PORT='29500'"),
        ({"MASTER_PORT": "70000"}, "fail", "not a port number"),
        ({"MASTER_PORT": "-1"}, "fail", "not a port number"),
        ({"MASTER_PORT": "29500"}, "warn", "MASTER_ADDR=None"),
        ({"MASTER_ADDR": "127.0.0.1"}, "warn", "MASTER_PORT=None"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "443"}, "warn", "privileged"),
        ({"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"}, "fail", "does not resolve"),
    ],
)
def test_master_address_and_port(env: dict[str, str], status: str, words: str) -> None:
    check = envcheck.check_master(env, port_in_use=lambda port: False)
    assert check.status == status and words in check.value, check


def test_master_port_in_use_on_this_machine() -> None:
    env = {"MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    check = envcheck.check_master(env, port_in_use=lambda port: True)
    assert check.status == "warn" and "in use" in check.value
    # Inside a launched job rank 0 is meant to hold the port: no warning there.
    assert envcheck.check_master({**env, "RANK": "1"}, port_in_use=lambda port: True).status == "ok"


def test_small_shm_and_low_file_limit_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    class Small:
        f_frsize, f_blocks, f_bavail = 4096, (64 << 20) // 4096, 1000

    monkeypatch.setattr(os, "statvfs", lambda path: Small())
    check = envcheck.check_shm()
    assert check.status == "warn" and "--shm-size" in check.fix and check.value.startswith("0.1 GiB")
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    check = envcheck.check_open_files()
    assert check.status == "warn" and "ulimit -n 4096" in check.fix


def test_text_report_rules_list_and_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    cli.doctor.print_report(envcheck.report([Check("a", "ok", "fine"), Check("b", "warn", "meh", fix="do X")], 1.5))
    text = capsys.readouterr().out
    assert "1 ok, 1 warn, 0 fail" in text and "warn b: do X" in text
    assert cli.main(["doctor", "--rules"]) == 0
    text = capsys.readouterr().out
    for rule_id in RULE_IDS:
        assert rule_id in text
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "--timeout", "0"])
    assert info.value.code == 2 and "--timeout" in capsys.readouterr().err
