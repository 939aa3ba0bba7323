"""Launch tests/scripts/fail_fit.py under a launcher, with a deadline, and record how the job ended.

Used by tests/dist/strategies/test_reliability_*.py and the other launched failure tests (with
``script=``, the hang scenarios of tests/dist/watch/). Every launch runs in its own session: when it
ends (or its deadline passes) whatever is left of it is found by session id, reported and killed, so
a test can neither hang nor leave processes behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from bench.harness.launch import rank_env
from tests import warm

SCRIPT = Path(__file__).with_name("fail_fit.py")
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.5")
_INJECTED = re.compile(r"\[fail_fit\] injecting (\w+) \(pid (\d+)\) at ([0-9.]+)")


@dataclass
class Job:
    name: str
    returncode: Optional[int]
    wall_s: float
    output: str
    out_dir: Path
    timed_out: bool
    ended_at: float
    leftover: list[str] = field(default_factory=list)

    @property
    def injected_at(self) -> Optional[float]:
        """Wall-clock time of the first injected failure (printed by the failing rank)."""
        found = _INJECTED.search(self.output)
        return float(found.group(3)) if found else None

    @property
    def latency_s(self) -> Optional[float]:
        """Seconds from the injected failure to the end of the whole job (every process gone)."""
        return None if self.injected_at is None else self.ended_at - self.injected_at

    def rank(self, r: int) -> dict[str, Any]:
        result: dict[str, Any] = json.loads((self.out_dir / f"rank{r}.json").read_text())
        return result

    def tensors(self, r: int) -> dict[str, Any]:
        result: dict[str, Any] = torch.load(self.out_dir / f"rank{r}.pt", weights_only=True)
        return result

    def describe(self) -> str:
        return (
            f"{self.name}: exit {self.returncode}, {self.wall_s:.1f} s, latency {self.latency_s}\n{self.output[-6000:]}"
        )


def child_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """A launched job's environment: no variables of a surrounding launch, one thread, no GPU, W&B offline."""
    return rank_env(threads=1, extra={"CUDA_VISIBLE_DEVICES": "", **(extra or {})})


def launch(
    name: str,
    out_dir: Path,
    flags: Sequence[str],
    *,
    launcher: Sequence[str] = (),
    timeout: float = 150,
    env: Optional[dict[str, str]] = None,
    script: Path = SCRIPT,
    cold: bool = True,
) -> Job:
    """``python [LAUNCHER] SCRIPT --out-dir OUT FLAGS`` (``fail_fit.py`` unless told) in its own session, killed at
    ``timeout``; cold, as a user's shell starts it (these are the tests of launching, failing and being preempted),
    unless ``cold=False`` (tests of what a run does, not of how it starts: the top process forks from the worker's
    zygote, ``tests/warm.py``; the launcher's other ranks still start cold)."""
    command = [sys.executable, *launcher, str(script), "--out-dir", str(out_dir), *flags]
    started = time.perf_counter()
    process = warm.start(
        command,
        cwd=out_dir.parent,
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cold=cold,
    )
    timed_out = False
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    ended_at = time.time()  # the output closed: every process that held it is gone
    wall = time.perf_counter() - started
    leftover = _session_processes(process.pid, wait_s=3.0)
    if leftover:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Job(name, process.returncode, wall, output, out_dir, timed_out, ended_at, leftover)


def launch_all(jobs: dict[str, dict[str, Any]], *, workers: int = 2) -> dict[str, Job]:
    """Run several launches, ``workers`` at a time (most of a launch is importing or waiting)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(launch, name, **spec) for name, spec in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def _session_processes(session: int, wait_s: float) -> list[str]:
    """Live (non-zombie) processes of a session, after waiting up to ``wait_s`` for them to go."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            state, sid = fields[0], int(fields[3])
            if sid == session and state != "Z":
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                alive.append(f"{pid} {cmdline[:120]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def listening_while_running(
    command: Sequence[str], *, env: dict[str, str], cwd: Path, timeout: float
) -> tuple[int, list[str]]:
    """Run ``command`` in its own session; every TCP socket its processes listen on, sampled every 20 ms
    until it exits: (exit code, ["address:port (pid)", ...])."""
    process = subprocess.Popen(
        list(command), cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None and time.monotonic() < deadline:
            for pid in _session_pids(process.pid):
                for socket in _listening(pid):
                    seen.add(f"{socket['address']}:{socket['port']} ({pid})")
            time.sleep(0.02)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    return process.returncode, sorted(seen)


def _session_pids(session: int) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[3]) == session:
                pids.append(int(pid))
    return pids


def _listening(pid: int) -> list[dict[str, Any]]:
    from tests.scripts.fail_fit import listening_sockets

    return listening_sockets(pid)


def latest_checkpoint(directory: Path) -> Path:
    found = sorted(directory.glob("*.ckpt"), key=lambda p: int(re.search(r"step=(\d+)", p.name).group(1)))  # type: ignore[union-attr]
    assert found, f"no checkpoint in {directory}"
    return found[-1]
