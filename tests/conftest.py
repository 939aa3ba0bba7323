"""Shared helpers for tests that start real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
RECIPES = REPO / "recipes"
TORCHRUN_2 = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")


def cpu_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Environment for a child run: CPU only, the repo importable, W&B offline, quiet."""
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        WANDB_MODE="offline",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",  # 2 ranks on 2 cores: one thread each, no oversubscription
    )
    # A launcher's variables leaking in from an outer run would confuse Lightning.
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_python(
    args: Sequence[str], *, cwd: Path, timeout: float, env: Optional[dict[str, str]] = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS``; fail the test with the child's output if it hangs, or fails and ``check``."""
    cmd = [sys.executable, *args]
    # Own session: on a timeout the whole process group goes (Lightning's launcher starts
    # the other ranks as children; killing only the direct child would leave them running).
    with subprocess.Popen(
        cmd, cwd=cwd, env=env or cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{stdout or ''}\n{stderr or ''}")
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        pytest.fail(f"exit code {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def fit_tiny(tmp_path: Path, *extra: str, timeout: float = 120) -> dict[str, Any]:
    """Run tests/scripts/fit_tiny.py on 2 CPU ranks and return rank 0's report."""
    out = tmp_path / f"fit_{len(list(tmp_path.glob('fit_*.json')))}.json"
    run_python([str(SCRIPTS / "fit_tiny.py"), "--out", str(out), *extra], cwd=tmp_path, timeout=timeout)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_recipe(
    recipe: str, script: str, workdir: Path, *flags: str, launcher: Sequence[str] = (), timeout: float = 240
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Run ``recipes/RECIPE/SCRIPT FLAGS --record ...`` on CPU; return rank 0's record and the run."""
    record = workdir / "record.pt"
    script_path = str(RECIPES / recipe / script)
    proc = run_python([*launcher, script_path, *flags, "--record", str(record)], cwd=workdir, timeout=timeout)
    result: dict[str, Any] = torch.load(record, weights_only=True)
    return result, proc
