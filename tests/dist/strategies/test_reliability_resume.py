"""Killed after a checkpoint, resumed: the same run as one never interrupted, bit for bit.

Each group (tests/scripts/fail_fit.py, 2 CPU ranks, ModelCheckpoint every N steps, CommProfiler and
DistributedDoctor attached (its one wall-clock rule off), checkpoints at steps that are not epoch ends) is run three times:

* ``ref``: uninterrupted;
* ``kill``: the same, one rank killed with ``SIGKILL`` a few steps after a checkpoint (this is
  also the ``SIGKILL`` case of the rank-failure guarantee, checked with the same rules);
  in ``auto_powersgd`` the surviving rank is 8 s into its step then, so Lightning's child-process
  observer (5 s polls) ends the job before any collective fails, and has to name the killed rank;
* ``res``: resumed from the killed run's last checkpoint.

Groups: ``ddp_tuned`` with fixed buckets and fp16 compression; ``bucket_cap_mb="auto"`` with
PowerSGD (error feedback and warm-start state per rank); ``hybrid`` (2 processes x 2 pipeline
stages). Compared with ``ref`` at the end, on both ranks: parameters, optimizer state, the loss of
every step after the checkpoint, the callbacks' ``state_dict``, the strategy's package state and
PowerSGD's memory, all exactly (``torch.equal``). And ``torchrun --max-restarts=1``: a rank killed
in the first attempt, the job recovers by itself from the last checkpoint and ends on ``ref``'s
parameters.

The fixed-bucket reference run also logs to W&B (offline) and CSV with fake secrets in its
environment: no secret appears in its output or in any file it wrote. Every run reports the
sockets its processes listen on: all on loopback, except torchrun's own rendezvous store.
"""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.scripts.fail_harness import TORCHRUN, Job, child_env, latest_checkpoint, launch_all

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

LATENCY_LIMIT_S = 30.0
SECRETS = {
    "WANDB_API_KEY": "local-5f0e9c1d2b3a4f5e6d7c8b9a0f1e2d3c4b5a6978",
    "HF_TOKEN": "hf_QzT7vYb3Kx9LmN2pR4sW6uA8cE0gI1jH5fD",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYFAKEKEY123",
    "GITHUB_TOKEN": "ghp_FAKE0123456789abcdefghijABCDEFGHIJ",
}

GROUPS: dict[str, dict[str, Any]] = {
    "fixed_fp16": {
        "flags": ("--strategy-kwargs", json.dumps({"bucket_cap_mb": 0.02, "compression": "fp16"})),
        "steps": 24,
        "every": 8,
        "kill_rank": 1,
        "kill_at": 13,
        "resumed_from": 8,
    },
    "auto_powersgd": {
        "flags": (
            "--strategy-kwargs",
            json.dumps(
                {
                    "bucket_cap_mb": "auto",
                    "tune_candidates": [0.01, 0.05],
                    "compression": "powersgd",
                    "powersgd_start_iter": 2,
                }
            ),
        ),
        "steps": 200,
        "every": 50,
        "kill_rank": 1,
        "kill_at": 120,
        "resumed_from": 100,
        # rank 0 is 8 s in its step when rank 1 is killed: Lightning's observer (5 s polls) ends the job first.
        "busy_s": 8.0,
    },
    "hybrid": {
        # balance="params": the split of 4 equal blocks is [2, 2] in every run. The default, "time", times
        # the blocks, and on a loaded machine (3 test workers on 2 cores) once chose [1, 3] for one run.
        "flags": (
            "--strategy",
            "hybrid",
            "--strategy-kwargs",
            json.dumps({"bucket_cap_mb": 0.02, "balance": "params"}),
        ),
        "steps": 24,
        "every": 8,
        "kill_rank": 0,
        "kill_at": 13,
        "resumed_from": 8,
    },
}


def common_flags(group: dict[str, Any]) -> list[str]:
    return [
        *group["flags"],
        "--steps",
        str(group["steps"]),
        "--ckpt-every",
        str(group["every"]),
        "--profiler",
        "--doctor",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("resume")
    first: dict[str, dict[str, Any]] = {}
    for name, group in GROUPS.items():
        flags = common_flags(group)
        first[f"{name}_ref"] = {"out_dir": root / f"{name}_ref", "flags": flags}
        kill = ["--fail", "sigkill", "--rank", str(group["kill_rank"]), "--at", str(group["kill_at"])]
        kill += ["--busy-s", str(group.get("busy_s", 0.0))]
        first[f"{name}_kill"] = {"out_dir": root / f"{name}_kill", "flags": [*flags, *kill]}
    first["fixed_fp16_ref"]["flags"] = [*first["fixed_fp16_ref"]["flags"], "--wandb"]
    first["fixed_fp16_ref"]["env"] = child_env(SECRETS)
    marker = root / "restarted_once"
    restart_flags = ["--fail", "sigkill", "--rank", "1", "--at", "13", "--once", str(marker), "--resume", "latest"]
    first["torchrun_restart"] = {
        "out_dir": root / "torchrun_restart",
        "flags": [*common_flags(GROUPS["fixed_fp16"]), *restart_flags],
        "launcher": (*TORCHRUN, "--max-restarts=1"),
    }
    jobs = launch_all(first, workers=2)
    second: dict[str, dict[str, Any]] = {}
    for name, group in GROUPS.items():
        killed = jobs[f"{name}_kill"]
        checkpoint = latest_checkpoint(killed.out_dir / "ckpt")
        flags = [*common_flags(group), "--resume", str(checkpoint)]
        second[f"{name}_res"] = {"out_dir": root / f"{name}_res", "flags": flags}
    jobs.update(launch_all(second, workers=2))
    return jobs


def same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors compared exactly, dtype included)."""
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{where} keys"]
        return [d for k in a for d in same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"[:300]]


# ----------------------------------------------------------------------------- the kill itself


@pytest.mark.parametrize("name", list(GROUPS))
def test_the_killed_run_ended_promptly_naming_the_killed_rank(runs: dict[str, Job], name: str) -> None:
    job, rank = runs[f"{name}_kill"], GROUPS[name]["kill_rank"]
    assert not job.timed_out and job.leftover == [], job.describe()
    assert job.latency_s is not None and job.latency_s < LATENCY_LIMIT_S, job.describe()
    if rank == 0:  # Lightning's launching process is rank 0: the job's own exit status says it was killed
        assert job.returncode == -9, job.describe()
        assert "[lightning_mgpu] rank 1: another rank closed its connection" in job.output, job.describe()
    else:
        assert job.returncode not in (0, None), job.describe()
        assert re.search(r"rank 1 \(pid \d+\) killed by SIGKILL", job.output), job.describe()
    if "busy_s" in GROUPS[name]:  # named by Lightning's observer, before any collective failed
        assert re.search(
            r"rank 0: rank 1 \(pid \d+\) killed by SIGKILL\. .* Lightning's launcher now kills the ranks it started",
            job.output,
        ), job.describe()
    assert latest_checkpoint(job.out_dir / "ckpt").name.endswith(f"step={GROUPS[name]['resumed_from']}.ckpt")


# ----------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize("name", list(GROUPS))
def test_resumed_run_ends_exactly_where_the_uninterrupted_one_does(runs: dict[str, Job], name: str) -> None:
    ref, res = runs[f"{name}_ref"], runs[f"{name}_res"]
    assert ref.returncode == 0, ref.describe()
    assert res.returncode == 0, res.describe()
    group = GROUPS[name]
    after = group["steps"] - group["resumed_from"]
    for rank in (0, 1):
        a, b = ref.rank(rank), res.rank(rank)
        assert b["global_step"] == a["global_step"] == group["steps"]
        assert len(b["losses"]) == after
        assert b["losses"] == a["losses"][-after:], f"rank {rank}: loss curves differ after the checkpoint"
        ta, tb = ref.tensors(rank), res.tensors(rank)
        assert torch.equal(ta["params"], tb["params"]), f"rank {rank}: parameters differ"
        assert same(ta["optimizer"], tb["optimizer"], "optimizer") == []
        assert same(a["callbacks"], b["callbacks"], "callbacks") == []  # CommProfiler, DistributedDoctor
        assert set(a["callbacks"]) == {"CommProfiler", "DistributedDoctor"}
    # The bucket size in force is the checkpoint's (for "auto": what the killed run chose, measuring
    # its own step times; the uninterrupted run may have chosen another, with the same numerics).
    saved = torch.load(latest_checkpoint(runs[f"{name}_kill"].out_dir / "ckpt"), weights_only=True)["lightning_mgpu"]
    assert res.rank(0)["package_state"]["bucket_cap_mb"] == saved["bucket_cap_mb"]


def test_auto_buckets_are_not_tuned_again_and_powersgd_memory_is_restored(runs: dict[str, Job]) -> None:
    ref, res = runs["auto_powersgd_ref"], runs["auto_powersgd_res"]
    for rank in (0, 1):
        assert ref.rank(rank)["package_state"]["tuning"]["status"] == "done"
        assert res.rank(rank)["package_state"]["tuning"]["status"] == "resumed"
        memory_a, memory_b = ref.tensors(rank)["powersgd"], res.tensors(rank)["powersgd"]
        assert memory_a["error"], "PowerSGD kept no error feedback: nothing was compared"
        assert same(memory_a, memory_b, "powersgd") == []
    # each rank's residual is its own: restoring rank 0's on rank 1 would not have passed
    assert same(ref.tensors(0)["powersgd"]["error"], ref.tensors(1)["powersgd"]["error"]) != []


def test_hybrid_resume_keeps_the_split(runs: dict[str, Job]) -> None:
    for job in (runs["hybrid_ref"], runs["hybrid_res"]):
        assert job.rank(0)["package_state"]["hybrid"]["sizes"] == [2, 2]


def test_torchrun_max_restarts_recovers_from_the_last_checkpoint(runs: dict[str, Job]) -> None:
    job, ref = runs["torchrun_restart"], runs["fixed_fp16_ref"]
    assert job.returncode == 0, job.describe()
    assert "[fail_fit] injecting sigkill" in job.output  # the first attempt was killed...
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1", job.output), job.describe()
    assert re.search(r"\[fail_fit\] resuming from \S+step=8\.ckpt", job.output), job.describe()  # ...the second resumed
    for rank in (0, 1):
        assert torch.equal(job.tensors(rank)["params"], ref.tensors(rank)["params"])
        assert job.rank(rank)["losses"] == ref.rank(rank)["losses"][-16:]
        assert same(job.rank(rank)["callbacks"], ref.rank(rank)["callbacks"]) == []


# ----------------------------------------------------------------------------- safe defaults


def test_no_secret_in_the_output_logs_exports_or_checkpoints(runs: dict[str, Job]) -> None:
    job = runs["fixed_fp16_ref"]
    assert job.returncode == 0, job.describe()
    written = [p for p in job.out_dir.rglob("*") if p.is_file()]
    kinds = {p.suffix for p in written}
    assert {".ckpt", ".json", ".csv", ".png", ".wandb", ".log"} <= kinds, kinds  # W&B, CSV, profiler exports
    assert any(p.name == "comm_profile.json" for p in written) and any(
        p.match("wandb/*/logs/debug.log") for p in written
    )
    for name, value in SECRETS.items():
        assert value not in job.output, name
        for path in written:
            assert value.encode() not in path.read_bytes(), (name, path)


def test_nothing_listens_beyond_loopback_except_torchruns_own_store(runs: dict[str, Job]) -> None:
    seen = 0
    for job in runs.values():
        if not (job.out_dir / "rank0.json").exists():
            continue  # a killed run reports nothing
        for rank in (0, 1):
            for socket in job.rank(rank)["listening"]:
                seen += 1
                loopback = ipaddress.ip_address(socket["address"]).is_loopback
                # torch's TCPStore in torchrun's agent listens on every interface: torchrun's, not ours
                assert loopback or socket.get("process") == "torchrun agent", (job.name, rank, socket)
    assert seen >= 12  # the store on rank 0 and gloo on both ranks, in every run


def test_checkpoints_hold_plain_data_only(runs: dict[str, Job], tmp_path: Path) -> None:
    for name in GROUPS:
        checkpoint = latest_checkpoint(runs[f"{name}_kill"].out_dir / "ckpt")
        loaded = torch.load(checkpoint, weights_only=True)  # raises on anything but tensors and plain types
        assert "lightning_mgpu" in loaded
