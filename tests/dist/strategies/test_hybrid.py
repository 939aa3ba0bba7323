"""HybridParallelStrategy: fits on CPU "devices" (subprocesses).

Arguments and placement checks, in-process: tests/unit/strategies/test_hybrid.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import SCRIPTS, run_python

FIT = str(SCRIPTS / "fit_hybrid.py")


# ----------------------------------------------------------------------------- fits (subprocesses)
def _fit(tmp_path: Path, name: str, *flags: str, timeout: float = 180) -> dict[str, Any]:
    out = tmp_path / f"{name}.pt"
    proc = run_python([FIT, *flags, "--out", str(out)], cwd=tmp_path, timeout=timeout)
    record = torch.load(out, weights_only=True)
    record["stdout"] = proc.stdout
    return record


def _assert_same(a: dict[str, Any], b: dict[str, Any], atol: float = 1e-5) -> None:
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        torch.testing.assert_close(a["state_dict"][key], b["state_dict"][key], rtol=0, atol=atol, msg=key)
    for x, y in zip(a["exp_avg"], b["exp_avg"]):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_checkpoints_round_trip_between_hybrid_ddp_tuned_and_one_device(tmp_path: Path) -> None:
    """4 steps under one strategy, checkpoint, 4 more under another == 8 steps under the first."""
    full = _fit(tmp_path, "full", "--strategy", "hybrid", "--epochs", "2", "--checkpoint", "except_last")
    assert full["plan"] and sum(full["plan"]) == 5 and full["world_size"] == 1 and full["global_step"] == 8
    assert full["body_class"] == "Sequential", "the split module's class must be restored after fit"
    assert sum(full["losses"][4:]) < sum(full["losses"][:4]), "the second epoch's loss should be lower: no training?"

    first = _fit(tmp_path, "first", "--strategy", "hybrid", "--epochs", "1", "--ckpt-save", str(tmp_path / "h.ckpt"))
    checkpoint = torch.load(tmp_path / "h.ckpt", weights_only=True)
    assert all(t.device.type == "cpu" for t in checkpoint["state_dict"].values())
    assert checkpoint["lightning_mgpu"]["hybrid"]["sizes"] == first["plan"]
    assert any(key.startswith("body.0.") for key in checkpoint["state_dict"])  # the unsplit model's keys

    to_ddp = _fit(
        tmp_path,
        "to_ddp",
        "--strategy",
        "ddp_tuned",
        "--devices",
        "1",
        "--epochs",
        "2",
        "--ckpt-path",
        str(tmp_path / "h.ckpt"),
    )
    to_single = _fit(
        tmp_path, "to_single", "--strategy", "single", "--epochs", "2", "--ckpt-path", str(tmp_path / "h.ckpt")
    )
    for resumed in (to_ddp, to_single):
        assert resumed["global_step"] == 8
        _assert_same(resumed, full)

    _fit(
        tmp_path,
        "ddp_first",
        "--strategy",
        "ddp_tuned",
        "--devices",
        "1",
        "--epochs",
        "1",
        "--ckpt-save",
        str(tmp_path / "d.ckpt"),
    )
    back = _fit(tmp_path, "back", "--strategy", "hybrid", "--epochs", "2", "--ckpt-path", str(tmp_path / "d.ckpt"))
    _assert_same(back, full)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_replicas_of_two_devices_with_a_given_split(tmp_path: Path) -> None:
    """4 CPU devices = 2 processes x 2 stages, half the batch each == one process, full batch."""
    # CommProfiler on: its all-reduce divides the loss, not the buckets, and must not divide twice;
    # windows of 2 steps every 5: DDP re-wrapped without its hook after step 3, with it after 5.
    flags = ["--devices", "4", "--batch-size", "16", "--balance", "3,2", "--m", "2", "--profiler"]
    two = _fit(tmp_path, "two", "--strategy", "hybrid", *flags, "--profile-schedule", "2,5")
    one = _fit(tmp_path, "one", "--strategy", "single", "--batch-size", "32")
    assert two["world_size"] == 2 and two["plan"] == [3, 2]
    assert two["profiler_switches"] == [[(3, False), (5, True)]]
    assert two["grads_seen"] and all(two["grads_seen"]), "on_after_backward ran before the stages' backward"
    assert json.loads(two["stdout"].strip().splitlines()[-1])["world_size"] == 2
    _assert_same(two, one)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_one_device_per_replica_is_plain_ddp_tuned(tmp_path: Path) -> None:
    hybrid = _fit(tmp_path, "k1", "--strategy", "hybrid", "--devices", "2", "--k", "1", "--m", "1", "--epochs", "1")
    ddp = _fit(tmp_path, "ddp", "--strategy", "ddp_tuned", "--devices", "2", "--epochs", "1")
    assert hybrid["world_size"] == ddp["world_size"] == 2
    assert hybrid["plan"] is None  # nothing split, nothing pipelined
    _assert_same(hybrid, ddp, atol=0)
