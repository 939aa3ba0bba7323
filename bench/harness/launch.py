"""The one way benchmarks (and the lab's tests) start N ranks: ``torch.distributed.run``, here or on a lab's nodes.

* on this machine: ``python -m torch.distributed.run --standalone --nproc-per-node=N TARGET``;
* as the nodes of a :class:`~bench.labs.network.Lab`: one ``ip netns exec NODE python -m
  torch.distributed.run --nnodes=N --node-rank=i --nproc-per-node=K --master-addr=<node 0>
  --rdzv-backend=static TARGET`` per namespace, with ``GLOO_SOCKET_IFNAME`` set to the node's
  link, so gloo's traffic crosses the shaped link (``K`` > 1: several ranks behind one link, as
  GPUs of one machine behind one NIC).

Either way the same start for every configuration (the fair choice: identical process start,
environment and rendezvous): from the repository root with the repository on ``PYTHONPATH``,
``OMP_NUM_THREADS`` pinned to the torch threads each rank uses, torchrun's own variables of a
surrounding launch cleared, W&B offline. Output goes to one log file per node (never to a pipe
that could fill); a node that fails, or a launch past its timeout, ends every node and every
rank under it (:func:`end_tree`: torchrun gives each rank a session of its own), so no rank
outlives its launch.

:func:`run` starts any ``TARGET`` (``["script.py", ...]`` or ``["-m", "module", ...]``) and
returns every node's exit code and output; :func:`launch` runs a benchmark's worker
(``-m MODULE ARGS --worker-out REPORT``) and returns the report rank 0 wrote, or stops the
benchmark (:class:`LaunchFailed`) with the end of the failed nodes' output.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from bench import REPO_ROOT, pythonpath_with_repo

if TYPE_CHECKING:
    from bench.labs.network import Lab

_TORCHRUN_VARIABLES = (
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
)
_NOISE = re.compile(
    r"^\[W|site-packages|warnings.warn|^(GPU|TPU) available|Initializing distributed|distributed_backend=|"
    r"All distributed processes|^-+$|litlogger|Tip:"
)


class LaunchFailed(SystemExit):
    """A launch failed, timed out or wrote no report: ends the benchmark with the nodes' output tails."""


@dataclass(frozen=True)
class NodeRun:
    """One node's torchrun: its exit code (None: never ended), whether the deadline ended it, its output."""

    node: int
    returncode: Optional[int]
    output: str
    timed_out: bool = False


@dataclass(frozen=True)
class Finished:
    """A launch that ended well: rank 0's report, node 0's output, the launch's wall time."""

    report: Any
    output: str
    wall_s: float

    def worker_lines(self) -> str:
        """Node 0's output without torch's and Lightning's start-up chatter: what a benchmark echoes."""
        return "\n".join(line for line in self.output.splitlines() if line.strip() and not _NOISE.search(line))


def describe(nproc: int, lab: Optional[Lab] = None) -> str:
    """The launcher as reports record it."""
    if lab is None:
        return f"python -m torch.distributed.run --standalone --nproc-per-node={nproc}"
    nodes = len(lab.nodes)
    return f"torchrun --nnodes={nodes} --nproc-per-node={nproc // nodes} per network-lab node (bench.labs.network)"


def torchrun_argv(
    target: Sequence[str], *, nproc_per_node: int, lab: Optional[Lab] = None, node: int = 0, port: int = 0
) -> list[str]:
    """``[ip netns exec NODE] python -m torch.distributed.run ... TARGET`` for one node (all ranks, without a lab)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if lab is None:
        return [*torchrun, "--standalone", f"--nproc-per-node={nproc_per_node}", *target]
    rendezvous = [f"--master-addr={lab.master_addr}", f"--master-port={port}", "--rdzv-backend=static"]
    nodes = [f"--nnodes={len(lab.nodes)}", f"--node-rank={node}", f"--nproc-per-node={nproc_per_node}"]
    return [*lab.nodes[node].exec_prefix(), *torchrun, *nodes, *rendezvous, "--max-restarts=0", *target]


def rank_env(
    *, threads: int = 1, lab: Optional[Lab] = None, node: int = 0, extra: Optional[Mapping[str, str]] = None
) -> dict[str, str]:
    """The environment of a node's ranks; in a lab, gloo on the node's link and no GPU (the lab is a CPU cluster)."""
    env = {key: value for key, value in os.environ.items() if key not in _TORCHRUN_VARIABLES}
    env.update(
        PYTHONPATH=pythonpath_with_repo(), OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", WANDB_MODE="offline"
    )
    if lab is not None:
        env.update(GLOO_SOCKET_IFNAME=lab.nodes[node].interface, CUDA_VISIBLE_DEVICES="")
    env.update(extra or {})
    return env


def run(
    target: Sequence[str],
    *,
    nproc_per_node: int,
    timeout: float,
    threads: int = 1,
    lab: Optional[Lab] = None,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[Path] = None,
    log_dir: Optional[Path] = None,
) -> list[NodeRun]:
    """Run ``target`` under torchrun on this machine (one node) or as every node of ``lab``; wait for all.

    A node that fails or a launch that passes ``timeout`` seconds ends every node. Output goes to
    ``log_dir/node<i>.log`` (a temporary directory by default).
    """
    nodes = 1 if lab is None else len(lab.nodes)
    port = 29500 + secrets.randbelow(20000)
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="bench_logs_"))
    logs.mkdir(parents=True, exist_ok=True)
    children: list[tuple[subprocess.Popen[bytes], Path]] = []
    expired = False
    try:
        for node in range(nodes):
            log = logs / f"node{node}.log"
            with open(log, "wb") as sink:
                child = subprocess.Popen(
                    torchrun_argv(target, nproc_per_node=nproc_per_node, lab=lab, node=node, port=port),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=rank_env(threads=threads, lab=lab, node=node, extra=env),
                    cwd=cwd or REPO_ROOT,
                    start_new_session=True,
                )
            children.append((child, log))
        deadline = time.monotonic() + timeout
        while any(child.poll() is None for child, _ in children):
            if any(child.poll() not in (None, 0) for child, _ in children):
                break
            if time.monotonic() > deadline:
                expired = True
                break
            time.sleep(0.2)
    finally:
        ended = [child.poll() is not None for child, _ in children]
        for child, _ in children:
            if child.poll() is None:
                end_tree(child)
    return [
        NodeRun(i, child.returncode, log.read_text(errors="replace"), timed_out=expired and not ended[i])
        for i, (child, log) in enumerate(children)
    ]


def end_tree(child: subprocess.Popen[bytes], *, grace: float = 5.0) -> None:
    """End ``child`` and every process under it: torchrun puts each rank in a session of its own, so
    killing torchrun's process group alone would leave the ranks running. Asked to stop first
    (SIGTERM: torchrun stops its ranks), then killed, with every descendant found beforehand."""
    tree = _descendants(child.pid)
    for pid in (child.pid, *tree):
        _signal(pid, signal.SIGTERM)
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    for pid in (child.pid, *tree):
        _signal(pid, signal.SIGKILL)
    child.wait()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc; none where there is no /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # the parent pid is the 2nd field after the command, which is in parentheses and may hold spaces
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _signal(pid: int, signum: int) -> None:
    for kill in (os.killpg, os.kill):  # its process group (a rank's own session included), then itself
        try:
            kill(pid, signum)
        except OSError:
            pass


def check(runs: Sequence[NodeRun], label: str, *, timeout: Optional[float] = None, lines: int = 40) -> None:
    """Raise :class:`LaunchFailed` naming ``label`` with each failed node's last ``lines`` lines of output."""
    failed = [r for r in runs if r.returncode != 0]
    if not failed:
        return
    how = f"timed out after {timeout:g} s" if any(r.timed_out for r in failed) and timeout else "failed"
    tails = "\n".join(
        f"--- node {r.node} (exit code {r.returncode}{', killed at the deadline' if r.timed_out else ''})\n"
        + "\n".join(r.output.splitlines()[-lines:])
        for r in failed
    )
    raise LaunchFailed(f"{label}: launch {how} ({len(failed)} of {len(runs)} node(s))\n{tails}")


def options(args: Any) -> dict[str, Any]:
    """:func:`launch`'s ``nproc``, ``threads`` and ``timeout`` from a benchmark's launch options
    (:func:`bench.harness.cli.add_launch_options`)."""
    return {"nproc": args.nproc, "threads": args.threads, "timeout": args.launch_timeout}


def launch(
    module: str,
    worker_args: Sequence[str],
    *,
    nproc: int,
    threads: int,
    scratch: Path,
    label: str,
    timeout: float,
    env: Optional[Mapping[str, str]] = None,
    lab: Optional[Lab] = None,
) -> Finished:
    """Run ``module``'s worker on ``nproc`` ranks (here, or spread evenly over ``lab``'s nodes) and return
    rank 0's report, written to ``scratch/<label>.json`` (``--worker-out`` is appended to ``worker_args``).

    ``worker_args`` must not hold ``--nproc``: torch.distributed.run would read it as an abbreviation
    of its own ``--nproc-per-node``. Workers take the world size from the environment.
    """
    nodes = 1 if lab is None else len(lab.nodes)
    if nproc % nodes:
        raise ValueError(f"{label}: {nproc} ranks do not spread evenly over {nodes} nodes")
    report = scratch / f"{label}.json"
    started = time.perf_counter()
    runs = run(
        ["-m", module, *worker_args, "--worker-out", str(report)],
        nproc_per_node=nproc // nodes,
        timeout=timeout,
        threads=threads,
        lab=lab,
        env=env,
        log_dir=scratch / f"{label}_logs",
    )
    check(runs, label, timeout=timeout)
    if not report.exists():
        tail = "\n".join(runs[0].output.splitlines()[-40:])
        raise LaunchFailed(f"{label}: the workers ended without writing {report}\n{tail}")
    return Finished(report=json.loads(report.read_text()), output=runs[0].output, wall_s=time.perf_counter() - started)


def launch_plan(
    module: str, plan: Sequence[Any], worker_args: Sequence[str], *, scratch: Path, label: str, **options: Any
) -> Finished:
    """:func:`launch` of a worker that runs a plan (:func:`bench.harness.worker.run_plan`): ``plan`` is written
    to ``scratch/<label>_plan.json`` and passed as ``--worker-plan``."""
    plan_file = scratch / f"{label}_plan.json"
    plan_file.write_text(json.dumps(list(plan)))
    return launch(module, ["--worker-plan", str(plan_file), *worker_args], scratch=scratch, label=label, **options)
