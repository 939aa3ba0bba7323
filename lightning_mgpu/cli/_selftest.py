"""``lightning-mgpu doctor --selftest``: every CUDA code path of the package, run for real on the GPUs there are.

Each path of :data:`~lightning_mgpu.cli.workers.selftest.PATHS` runs in a fresh process
(``python -m lightning_mgpu.cli.workers.selftest PATH OUT.json``), so that one path's CUDA error
or hang cannot take the others down; each has its own time limit, after which its whole process
group is killed. The result is one line per path, pass or fail with its time: the doctor's
:class:`~lightning_mgpu.envcheck.Check` lines and JSON.

Without a CUDA device there is nothing to run: one ``ok`` line says so and the command exits 0.
``device="cpu"`` runs the same code on CPU stand-ins (gloo, ``bf16-mixed``, CPU stages): how the
self-test itself is tested on machines without a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from lightning_mgpu.cli import workers
from lightning_mgpu.cli.workers.selftest import MIN_GPUS, PATHS
from lightning_mgpu.envcheck import Check

PATH_TIMEOUT_S = 300.0
"""Default limit for one path, start-up included (a first CUDA start can take a minute)."""

WORKER = "lightning_mgpu.cli.workers.selftest"

Runner = Callable[[list[str], float, dict[str, str]], tuple[int, str]]
"""``(argv, timeout, env) -> (exit code, output)``, :func:`lightning_mgpu.cli.workers.run`'s."""


def _facts(facts: dict[str, Any]) -> str:
    shown = []
    for key, value in facts.items():
        shown.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return ", ".join(shown)


def _last_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:240]


def run_selftest(
    *,
    device: str = "cuda",
    timeout: float = PATH_TIMEOUT_S,
    gpu_count: Optional[int] = None,
    runner: Runner = workers.run,
) -> list[Check]:
    """One :class:`Check` per path (``gpu_count``: the GPUs visible, read from torch if None)."""
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpu_count == 0:
        import torch

        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return [
            Check(
                "gpu self-test",
                "ok",
                f"no CUDA device visible (torch {torch.__version__}, {build}; CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}): nothing to run",
            )
        ]
    checks = []
    env = dict(os.environ)
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory(prefix="lightning_mgpu_selftest_") as tmp:
        for path, what in PATHS.items():
            needed = MIN_GPUS.get(path, 1)
            if device == "cuda" and gpu_count < needed:
                checks.append(Check(path, "ok", f"skipped: needs {needed} GPUs ({gpu_count} visible)"))
                continue
            out = Path(tmp) / f"{path}.json"
            argv = [sys.executable, "-m", WORKER, path, str(out), "--device", device]
            started = time.perf_counter()
            code, output = runner(argv, timeout, env)
            seconds = time.perf_counter() - started
            if code == 0 and out.exists():
                result = json.loads(out.read_text())
                checks.append(
                    Check(
                        path,
                        "ok",
                        f"pass in {seconds:.1f} s ({result['seconds']:.1f} s inside): {_facts(result['facts'])}",
                        details={"what": what, "seconds": seconds, **result},
                    )
                )
                continue
            why = (
                f"timed out after {timeout:g} s"
                if code == workers.TIMED_OUT
                else f"exit code {code}: {_last_error(output)}"
            )
            checks.append(
                Check(
                    path,
                    "fail",
                    f"FAIL after {seconds:.1f} s ({what}): {why}",
                    fix=f"rerun it alone for the whole output: python -m {WORKER} {path} "
                    "out.json; please report it with that output and `lightning-mgpu doctor --json`",
                    details={"what": what, "seconds": seconds, "output_tail": output[-4000:]},
                )
            )
    return checks
