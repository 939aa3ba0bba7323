"""Run a training script as every node of a :class:`~bench.netlab_lib.Lab`: one torchrun per namespace.

Each node runs ``ip netns exec NODE python -m torch.distributed.run --nnodes=N --node-rank=i
--nproc-per-node=K --master-addr=<node 0> --rdzv-backend=static TARGET`` with
``GLOO_SOCKET_IFNAME`` set to the node's link, so gloo's traffic crosses the shaped link
(``K`` > 1: several ranks behind one link, as GPUs of one machine behind one NIC). A node that
fails, or a launch past its timeout, ends every node (whole process groups). Output goes to
one log file per node (never to a pipe that could fill), returned in :class:`NodeRun`.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from bench.netlab_lib import REPO_ROOT, Lab, LabError, repo_on_pythonpath

_NOISE = re.compile(
    r"^\[W|site-packages|warnings.warn|^(GPU|TPU) available|Initializing distributed|distributed_backend=|"
    r"All distributed processes|^-+$|litlogger|Tip:"
)


@dataclass(frozen=True)
class NodeRun:
    """One node's torchrun: its exit code and output."""

    node: int
    returncode: Optional[int]
    output: str


def torchrun_argv(lab: Lab, node: int, target: Sequence[str], *, nproc_per_node: int, port: int) -> list[str]:
    """``ip netns exec NODE python -m torch.distributed.run --nnodes=N --node-rank=i ... TARGET``."""
    return [
        *lab.nodes[node].exec_prefix(),
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(lab.nodes)}",
        f"--node-rank={node}",
        f"--nproc-per-node={nproc_per_node}",
        f"--master-addr={lab.master_addr}",
        f"--master-port={port}",
        "--rdzv-backend=static",
        "--max-restarts=0",
        *target,
    ]


def node_env(lab: Lab, node: int, *, threads: int = 1, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of a node's ranks: gloo on the node's link, the repository importable, CPU only."""
    env = dict(os.environ)
    for key in (
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NODE_RANK",
        "TORCHELASTIC_RUN_ID",
        "GROUP_RANK",
        "LOCAL_WORLD_SIZE",
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
    ):
        env.pop(key, None)
    env.update(
        GLOO_SOCKET_IFNAME=lab.nodes[node].interface,
        PYTHONPATH=repo_on_pythonpath(),
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
        WANDB_MODE="offline",
    )
    env.update(extra or {})
    return env


def launch_torchrun(
    lab: Lab,
    target: Sequence[str],
    *,
    nproc_per_node: int = 1,
    timeout: float = 600,
    threads: int = 1,
    env: Optional[dict[str, str]] = None,
    cwd: Optional[Path] = None,
    log_dir: Optional[Path] = None,
) -> list[NodeRun]:
    """Run ``target`` (``["script.py", ...]`` or ``["-m", "module", ...]``) as every node of ``lab``; wait for all.

    A node that fails or a launch that passes ``timeout`` ends every node (whole process groups).
    Output goes to files (``log_dir``, else a temporary directory), never to a pipe that could fill.
    """
    import tempfile

    port = 29500 + secrets.randbelow(20000)
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="netlab_logs_"))
    logs.mkdir(parents=True, exist_ok=True)
    children: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for node in range(len(lab.nodes)):
            log = logs / f"node{node}.log"
            with open(log, "wb") as sink:
                child = subprocess.Popen(
                    torchrun_argv(lab, node, target, nproc_per_node=nproc_per_node, port=port),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=node_env(lab, node, threads=threads, extra=env),
                    cwd=cwd or REPO_ROOT,
                    start_new_session=True,
                )
            children.append((child, log))
        deadline = time.monotonic() + timeout
        while any(child.poll() is None for child, _ in children):
            failed = any(child.poll() not in (None, 0) for child, _ in children)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for child, _ in children:
            if child.poll() is None:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except OSError:
                    pass
                child.wait()
    return [NodeRun(i, child.returncode, log.read_text(errors="replace")) for i, (child, log) in enumerate(children)]


def check_runs(runs: Sequence[NodeRun], label: str, lines: int = 40) -> None:
    """Raise :class:`LabError` with each failed node's last ``lines`` lines of output."""
    failed = [run for run in runs if run.returncode != 0]
    if failed:
        tails = "\n".join(
            f"--- node {run.node} (exit code {run.returncode})\n" + "\n".join(run.output.splitlines()[-lines:])
            for run in failed
        )
        raise LabError(f"{label}: {len(failed)} node(s) failed\n{tails}")


def launch_worker(
    lab: Lab,
    module: str,
    worker_args: Sequence[str],
    *,
    scratch: Path,
    label: str,
    timeout: float,
    nproc_per_node: int = 1,
    threads: int = 1,
) -> Any:
    """A benchmark's worker as every node of ``lab`` (``bench.launcher``'s contract across the lab).

    Runs ``python -m MODULE WORKER_ARGS --worker-out REPORT``, prints node 0's output (less
    torch's and Lightning's start-up chatter) and returns the JSON report rank 0 wrote; raises
    :class:`~bench.netlab_lib.LabError` naming ``label`` with the failed nodes' output.
    """
    import json

    report = scratch / f"{label}.json"
    runs = launch_torchrun(
        lab,
        ["-m", module, *worker_args, "--worker-out", str(report)],
        nproc_per_node=nproc_per_node,
        timeout=timeout,
        threads=threads,
        log_dir=scratch / label,
    )
    check_runs(runs, label)
    print("\n".join(line for line in runs[0].output.splitlines() if line.strip() and not _NOISE.search(line)))
    if not report.exists():
        raise LabError(f"{label}: the workers ended without writing {report}\n{runs[0].output[-3000:]}")
    return json.loads(report.read_text())
