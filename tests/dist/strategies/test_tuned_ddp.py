"""TunedDDPStrategy on 2 real CPU processes over gloo: buckets, hooks, launchers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import SCRIPTS, cpu_env, fit_tiny, free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

MIB = 1024 * 1024


def greedy_buckets(ready_order_bytes: list[int], limits_bytes: list[float]) -> list[int]:
    """Independent oracle of DDP's bucketing: fill in gradient-ready order, close a bucket
    once it reaches its limit; bucket i uses limits[min(i, len - 1)]."""
    buckets: list[int] = []
    current = 0
    for size in ready_order_bytes:
        current += size
        if current >= limits_bytes[min(len(buckets), len(limits_bytes) - 1)]:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def assert_ranks_agree(result: dict[str, Any]) -> None:
    per_rank = result["params_per_rank"]
    assert len(per_rank) == result["world_size"] == 2
    assert per_rank[0] == per_rank[1]


def assert_trained(result: dict[str, Any]) -> None:
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert min(losses[-3:]) < losses[0]


def test_default_name_builds_ddps_own_layout(tmp_path: Path) -> None:
    result = fit_tiny(tmp_path, "--strategy", "ddp_tuned")
    assert result["strategy_class"] == "TunedDDPStrategy" and result["backend"] == "gloo"
    assert result["comm_hook"] in (None, "", "builtin_allreduce")
    expected = greedy_buckets(result["param_ready_order_bytes"], [1 * MIB, 25 * MIB])
    assert result["ddp_bucket_sizes"] == expected
    assert [b["bytes"] for b in result["bucket_layout"]] == expected
    assert sum(b["num_params"] for b in result["bucket_layout"]) == 6
    assert result["bucket_layout"][0]["param_names"][0] == "net.4.bias"  # last layer's gradients are ready first
    assert_ranks_agree(result)
    assert_trained(result)


def test_explicit_cap_keeps_the_first_bucket_where_stock_ddp_drops_it(tmp_path: Path) -> None:
    # 8 hidden layers of 256x256 (~0.25 MiB each): a 1 MiB first bucket holds 4 of them.
    common = ["--width", "256", "--depth", "8", "--steps", "4"]
    ours = fit_tiny(
        tmp_path,
        *common,
        "--strategy-kwargs",
        json.dumps({"bucket_cap_mb": 1.6, "static_graph": True, "gradient_as_bucket_view": True}),
    )
    stock = fit_tiny(tmp_path, *common, "--stock", "--strategy-kwargs", json.dumps({"bucket_cap_mb": 1.6}))
    order = ours["param_ready_order_bytes"]
    assert ours["ddp_bucket_sizes"] == greedy_buckets(order, [1 * MIB, 1.6 * MIB])
    assert stock["ddp_bucket_sizes"] == greedy_buckets(order, [1.6 * MIB])
    assert ours["ddp_bucket_sizes"][0] < stock["ddp_bucket_sizes"][0]  # the point of first_bucket_cap_mb
    assert ours["bucket_layout"][0]["bytes"] < 1.3 * MIB
    # the other keyword arguments reached DistributedDataParallel
    assert ours["ddp_flags"] == {"static_graph": True, "gradient_as_bucket_view": True, "find_unused_parameters": False}
    assert ours["bucket_cap_mb"] == 1.6 and ours["first_bucket_cap_mb"] == 1.0
    assert_ranks_agree(ours)


def test_fp16_by_name_registers_the_hook_on_gloo(tmp_path: Path) -> None:
    result = fit_tiny(tmp_path, "--strategy", "ddp_tuned_fp16")
    assert result["comm_hook"] == "fp16_scaled_allreduce"  # issue 17: our overflow-safe fp16 hook, not torch's
    # gradients came back through fp16: 11 significant bits (scaled by a power of two, so not always fp16's range)
    assert all(check["fp16_precision"] for check in result["grad_checks"])
    assert not all(check["bf16_exact"] for check in result["grad_checks"])  # ... and more than bf16's 8
    assert_ranks_agree(result)
    assert_trained(result)


def test_bf16_uses_our_hook_on_gloo(tmp_path: Path) -> None:
    result = fit_tiny(tmp_path, "--strategy-kwargs", json.dumps({"compression": "bf16"}))
    assert result["comm_hook"] == "bf16_allreduce_hook"
    assert all(check["bf16_exact"] for check in result["grad_checks"])
    assert_ranks_agree(result)
    assert_trained(result)


def test_powersgd_by_name_compresses_after_start_iter(tmp_path: Path) -> None:
    result = fit_tiny(tmp_path, "--strategy", "ddp_tuned_powersgd", "--steps", "14")
    assert result["comm_hook"] == "powerSGD_hook"
    ranks = [check["rank"] for check in result["grad_checks"]]
    assert min(ranks[:9]) > 1  # plain all-reduce before powersgd_start_iter=10
    assert ranks[-3:] == [1, 1, 1]  # rank-1 approximation afterwards
    assert_ranks_agree(result)


def test_spawn_by_name(tmp_path: Path) -> None:
    result = fit_tiny(tmp_path, "--strategy", "ddp_tuned_spawn", "--steps", "4")
    assert result["strategy_class"] == "TunedDDPStrategy" and result["world_size"] == 2
    assert len(result["losses"]) == 4


def test_checkpoint_carries_package_state(tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny.ckpt"
    fit_tiny(tmp_path, "--steps", "3", "--strategy-kwargs", json.dumps({"bucket_cap_mb": 3}), "--ckpt", str(ckpt))
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["lightning_mgpu"] == {"bucket_cap_mb": 3.0, "first_bucket_cap_mb": 1.0, "compression": None}
    assert all(not key.startswith("module.") for key in checkpoint["state_dict"])


def test_two_nodes_with_torchrun_on_loopback(tmp_path: Path) -> None:
    """Two torchrun launchers, one per 'node', rendezvous over 127.0.0.1."""
    port = free_port()
    out = tmp_path / "multinode.json"
    procs = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(SCRIPTS / "fit_tiny.py"),
            "--devices",
            "1",
            "--num-nodes",
            "2",
            "--steps",
            "4",
            "--out",
            str(out),
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=tmp_path, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=150)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    assert_ranks_agree(result)


def test_profiled_training_ends_on_the_same_parameters(tmp_path: Path) -> None:
    """CommProfiler's hook path (average applied on the loss) trains bit for bit like DDP's built-in one."""
    plain = fit_tiny(tmp_path, "--steps", "6")
    profiled = fit_tiny(tmp_path, "--steps", "6", "--profiler")
    assert plain["comm_hook"] in (None, "", "builtin_allreduce")
    assert profiled["comm_hook"] == "timed_averaging_allreduce"
    assert profiled["losses"] == plain["losses"]
    assert profiled["params_per_rank"] == plain["params_per_rank"]


def test_profiling_windows_switch_ddp_hooks_and_train_the_same_parameters(tmp_path: Path) -> None:
    """Windows of 2 profiled steps every 5: DDP is re-wrapped without and with the profiler's hook
    after steps 3, 5, 9, 10 and 14; the losses and weights stay those of a run without the profiler."""
    plain = fit_tiny(tmp_path, "--steps", "15")
    sampled = fit_tiny(tmp_path, "--steps", "15", "--profiler", "--profile-schedule", "2,5")
    # step 15 is outside a window; step 16's window does not start: the fit ends at 15
    assert sampled["comm_hook"] in (None, "", "builtin_allreduce")
    assert sampled["losses"] == plain["losses"]
    assert sampled["params_per_rank"] == plain["params_per_rank"]
