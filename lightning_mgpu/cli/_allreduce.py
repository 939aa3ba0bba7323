"""``lightning-mgpu doctor``'s multi-process check: a real all_reduce between processes started on 127.0.0.1.

:func:`run_allreduce_smoke` starts ``world`` copies of :mod:`lightning_mgpu.cli.workers.allreduce`,
which meet through a store listening on 127.0.0.1 only, all-reduce a known tensor, check the
sum and time a few more all-reduces. It never waits longer than its ``timeout``: processes
still running then are killed and the check fails, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from lightning_mgpu.envcheck.checks import Check
from lightning_mgpu.envcheck.variables import LAUNCH_VARS

SMOKE_TIMEOUT_S = 20.0
SMOKE_BYTES = 4 << 20  # all_reduce 4 MiB of float32
WORKER = "lightning_mgpu.cli.workers.allreduce"


def run_allreduce_smoke(backend: str, world: int, timeout: float, nbytes: int = SMOKE_BYTES) -> dict[str, Any]:
    """Start ``world`` processes on 127.0.0.1 that all_reduce ``nbytes`` and check the sum.

    Returns {"ok": bool, "reason": str, "wall_s": float, "ranks": [...]}. Never waits longer than
    ``timeout`` (plus a second to reap): processes still running then are killed.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU test: never touch a GPU
    from lightning_mgpu.comm.distributed import LOOPBACK, free_port  # torch: imported by the checks already

    port = free_port(LOOPBACK)
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", WORKER, str(rank), str(world), str(port), backend, str(nbytes), str(timeout)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    outputs: list[tuple[str, str]] = [("", "")] * world
    deadline = started + timeout
    timed_out = False
    for rank, proc in enumerate(procs):
        try:
            outputs[rank] = proc.communicate(timeout=max(0.01, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for proc in procs:  # only the processes started here
            if proc.poll() is None:
                proc.kill()
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=1.0)
                outputs[rank] = (out or "", err or "")
            except subprocess.TimeoutExpired:
                pass
    wall = time.perf_counter() - started
    ranks: list[dict[str, Any]] = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        line = next((l for l in reversed((out or "").splitlines()) if l.startswith("{")), None)
        ranks.append(
            json.loads(line)
            if line
            else {"rank": rank, "returncode": proc.returncode, "stderr_tail": (err or "").strip().splitlines()[-3:]}
        )
    failed = [r for r in ranks if "wrong" not in r]
    if timed_out:
        reason = f"no result within {timeout:g} s (a rank hung or started too slowly)"
    elif failed:
        tail = "; ".join(" / ".join(r.get("stderr_tail", [])) for r in failed)[-300:]
        reason = f"rank(s) {[r['rank'] for r in failed]} failed: {tail}"
    elif any(r["wrong"] for r in ranks):
        reason = "all_reduce returned wrong values"
    else:
        reason = ""
    return {"ok": not reason, "reason": reason, "wall_s": wall, "ranks": ranks}


def check_smoke(backend: str, world: int, timeout: float) -> Check:
    name = f"{backend} all_reduce"
    result = run_allreduce_smoke(backend, world, timeout)
    details = {"world_size": world, "bytes": SMOKE_BYTES, **result}
    if result["ok"]:
        ranks = result["ranks"]
        ms = max(r["allreduce_ms"] for r in ranks)
        init = max(r["init_s"] for r in ranks)
        return Check(
            name,
            "ok",
            f"{world} processes on 127.0.0.1: {SMOKE_BYTES >> 20} MiB correct, {ms:.2f} ms "
            f"per all_reduce (rendezvous {init * 1e3:.0f} ms, {result['wall_s']:.1f} s with start-up)",
            details=details,
        )
    fix = (
        "check that local processes can connect over TCP on 127.0.0.1 (firewall, sandbox), that no GLOO_/NCCL_ "
        "variable points at a missing interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), and rerun with "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL NCCL_DEBUG=INFO for the cause"
    )
    return Check(name, "fail", result["reason"], fix=fix, details=details)
