"""``lightning-mgpu doctor --selftest`` (issue 18 item 7): every CUDA path, pass/fail with timings.

No GPU here: the command says so and exits 0 without starting anything (in-process, the fast lane
refuses process starts). The report's logic is tested with a fake runner as if GPUs were there; the
paths' own code runs for real on CPU stand-ins in tests/dist/cli/test_doctor_selftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_mgpu import cli
from lightning_mgpu.cli._selftest import run_selftest
from lightning_mgpu.cli.workers.selftest import MIN_GPUS, PATHS

needs_no_gpu = pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the machine-without-a-GPU path"
)


@needs_no_gpu
def test_without_a_gpu_it_says_so_and_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--selftest", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "ok" and len(report["checks"]) == 1
    assert "no CUDA device visible" in report["checks"][0]["value"] and "nothing to run" in report["checks"][0]["value"]


def fake_runner(results: dict[str, Any]) -> Any:
    """Writes each path's JSON as the worker would, or fails/hangs it, per ``results``."""

    def run(argv: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str]:
        path, out = argv[3], Path(argv[4])
        outcome = results.get(path, "pass")
        if outcome == "pass":
            out.write_text(json.dumps({"path": path, "seconds": 1.25, "facts": {"ranks": 1, "comm_ms": 0.123456}}))
            return 0, ""
        if outcome == "hang":
            return 124, "started\n"
        return 1, "Traceback (most recent call last):\nRuntimeError: CUDA error: an illegal memory access\n"

    return run


def test_each_path_is_a_line_with_pass_or_fail_and_its_time() -> None:
    checks = run_selftest(gpu_count=1, timeout=5, runner=fake_runner({"amp-fp16": "fail", "copy-streams": "hang"}))
    by_name = {c.name: c for c in checks}
    assert list(by_name) == list(PATHS)  # every path, in order
    assert by_name["nccl-ddp"].status == "ok" and "pass in" in by_name["nccl-ddp"].value
    assert "comm_ms=0.1235" in by_name["cuda-profiling"].value
    failed = by_name["amp-fp16"]
    assert failed.status == "fail" and "CUDA error: an illegal memory access" in failed.value
    assert failed.fix is not None and "python -m lightning_mgpu.cli.workers.selftest amp-fp16" in failed.fix
    assert by_name["copy-streams"].status == "fail" and "timed out after 5 s" in by_name["copy-streams"].value
    # more GPUs than there are: skipped, and said
    assert MIN_GPUS["hybrid-gpus"] == 2 and "skipped: needs 2 GPUs (1 visible)" in by_name["hybrid-gpus"].value


def test_with_two_gpus_every_path_runs() -> None:
    started: list[str] = []
    runner = fake_runner({})

    def recording(argv: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str]:
        started.append(argv[3])
        return runner(argv, timeout, env)

    checks = run_selftest(gpu_count=2, runner=recording)
    assert started == list(PATHS) and all(c.status == "ok" for c in checks)


def test_the_parameter_check_gathers_on_the_strategys_device_not_where_teardown_left_the_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found on the first GPU run (H100): after fit, Lightning's teardown has moved the module back to the CPU, and
    NCCL cannot gather a CPU tensor ("No backend type associated with device type cpu"): 5 of the self-test's paths
    failed after their fits had passed. The stand-in strategy refuses, as NCCL does, a tensor off its device ("meta"
    here: any device the module is not on)."""
    from types import SimpleNamespace

    import torch

    from lightning_mgpu.cli.workers import selftest

    class OneRank:
        root_device = torch.device("meta")

        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device != self.root_device:
                raise RuntimeError(f"No backend type associated with device type {tensor.device.type}")
            return torch.zeros_like(tensor, device="cpu").unsqueeze(0)

    monkeypatch.setattr(torch.distributed, "get_backend", lambda *_: "nccl")
    facts = selftest._same_on_every_rank(SimpleNamespace(strategy=OneRank(), global_step=8), torch.nn.Linear(3, 2))
    assert facts == {"ranks": 1, "backend": "nccl", "steps": 8}


def test_paths_run_at_once_report_in_the_same_order_and_alike() -> None:
    import threading
    import time

    running, most = 0, 0
    lock = threading.Lock()
    inner = fake_runner({"amp-fp16": "fail", "copy-streams": "hang"})

    def slow(argv: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str]:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return inner(argv, timeout, env)

    ports: list[str] = []

    def recording(argv: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str]:
        ports.append(env["MASTER_PORT"])
        return slow(argv, timeout, env)

    one_by_one = run_selftest(gpu_count=1, timeout=5, runner=inner)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MASTER_PORT", "29500")  # a launcher's, inherited: shared, the paths' rendezvous would collide
        at_once = run_selftest(gpu_count=1, timeout=5, runner=recording, jobs=3)
    assert most == 3  # three paths were running together
    assert len(set(ports)) == len(ports) == len(PATHS) - 1 and "29500" not in ports  # hybrid-gpus: skipped
    assert [(c.name, c.status) for c in at_once] == [(c.name, c.status) for c in one_by_one]
    assert [c.name for c in at_once] == list(PATHS)
