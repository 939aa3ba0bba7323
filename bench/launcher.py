"""The one launcher of ``bench/``: start a benchmark's workers on N ranks and read back rank 0's report.

Every multi-process benchmark launches its workers the same way::

    python -m torch.distributed.run --standalone --nproc-per-node=N -m bench.<script> <worker options> \\
        --worker-out REPORT.json

from the repository root (``-m`` imports ``bench`` from there), with ``OMP_NUM_THREADS``
pinned to the torch threads each rank uses. The same launcher for every configuration is the
fair choice: identical process start, environment and rendezvous for all of them. The worker's
rank 0 writes its JSON report to ``--worker-out``; a launch that fails, times out or writes no
report stops the benchmark with the end of the workers' output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Finished:
    """A launch that ended well: rank 0's report, the workers' standard output, the launch's wall time."""

    report: Any
    stdout: str
    wall_s: float


def describe(nproc: int) -> str:
    """The launcher as reports record it."""
    return f"python -m torch.distributed.run --standalone --nproc-per-node={nproc}"


def command(module: str, worker_args: Sequence[str], *, nproc: int) -> list[str]:
    """``python -m torch.distributed.run ... -m MODULE WORKER_ARGS``.

    ``worker_args`` must not hold ``--nproc``: torch.distributed.run would read it as an
    abbreviation of its own ``--nproc-per-node``. Workers take the world size from the environment.
    """
    return [sys.executable, *describe(nproc).split()[1:], "-m", module, *worker_args]


def launch(
    module: str,
    worker_args: Sequence[str],
    *,
    nproc: int,
    threads: int,
    report: Path,
    label: str,
    timeout: float,
    env: Optional[Mapping[str, str]] = None,
) -> Finished:
    """Run ``module``'s worker on ``nproc`` ranks (``--worker-out report`` appended) and return rank 0's report.

    ``threads`` is each rank's ``OMP_NUM_THREADS``; ``env`` adds variables (e.g. ``CUDA_VISIBLE_DEVICES``).
    Raises ``SystemExit`` naming ``label`` when the launch times out, fails or writes no report.
    """
    full = command(module, [*worker_args, "--worker-out", str(report)], nproc=nproc)
    child_env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(env or {})}
    started = time.perf_counter()
    try:
        completed = subprocess.run(full, env=child_env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired as error:
        raise SystemExit(
            f"{label}: launch timed out after {timeout} s\n{output_tail(error.stdout, error.stderr)}"
        ) from None
    if completed.returncode != 0 or not report.exists():
        raise SystemExit(
            f"{label}: launch failed (exit code {completed.returncode})\n$ {' '.join(full)}\n"
            f"{output_tail(completed.stdout, completed.stderr)}"
        )
    return Finished(
        report=json.loads(report.read_text()), stdout=completed.stdout, wall_s=time.perf_counter() - started
    )


def output_tail(stdout: Any, stderr: Any, lines: int = 40) -> str:
    """The last ``lines`` lines of a child's output (``str``, ``bytes`` or ``None`` each)."""

    def text(value: Any) -> str:
        return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")

    return "\n".join((text(stdout) + text(stderr)).splitlines()[-lines:])
