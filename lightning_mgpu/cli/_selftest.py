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
from concurrent.futures import ThreadPoolExecutor
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
    return ", ".join(
        f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}" for key, value in facts.items()
    )


def _last_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:240]


def _run_path(
    path: str, what: str, tmp: Path, *, device: str, timeout: float, env: dict[str, str], runner: Runner
) -> Check:
    """One path in its own process: its Check, pass with its facts or fail with the output's last error."""
    out = tmp / f"{path}.json"
    argv = [sys.executable, "-m", WORKER, path, str(out), "--device", device]
    started = time.perf_counter()
    code, output = runner(argv, timeout, env)
    seconds = time.perf_counter() - started
    if code == 0 and out.exists():
        result = json.loads(out.read_text())
        return Check(
            path,
            "ok",
            f"pass in {seconds:.1f} s ({result['seconds']:.1f} s inside): {_facts(result['facts'])}",
            details={"what": what, "seconds": seconds, **result},
        )
    why = f"timed out after {timeout:g} s" if code == workers.TIMED_OUT else f"exit code {code}: {_last_error(output)}"
    return Check(
        path,
        "fail",
        f"FAIL after {seconds:.1f} s ({what}): {why}",
        fix=f"rerun it alone for the whole output: python -m {WORKER} {path} "
        "out.json; please report it with that output and `lightning-mgpu doctor --json`",
        details={"what": what, "seconds": seconds, "output_tail": output[-4000:]},
    )


def run_selftest(
    *,
    device: str = "cuda",
    timeout: float = PATH_TIMEOUT_S,
    gpu_count: Optional[int] = None,
    runner: Runner = workers.run,
    jobs: int = 1,
) -> list[Check]:
    """One :class:`Check` per path, in :data:`PATHS`' order (``gpu_count``: the GPUs visible, read from torch if
    None; ``jobs``: how many paths run at once)."""
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
    env = dict(os.environ)
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory(prefix="lightning_mgpu_selftest_") as tmp:

        def one(path: str) -> Check:
            needed = MIN_GPUS.get(path, 1)
            if device == "cuda" and gpu_count < needed:
                return Check(path, "ok", f"skipped: needs {needed} GPUs ({gpu_count} visible)")
            own = env
            if jobs > 1:  # paths side by side: each its own rendezvous port (an inherited MASTER_PORT would be shared)
                from lightning_mgpu.comm.distributed import free_port

                own = {**env, "MASTER_PORT": str(free_port())}
            return _run_path(path, PATHS[path], Path(tmp), device=device, timeout=timeout, env=own, runner=runner)

        if jobs <= 1:
            checks = [one(path) for path in PATHS]
        else:  # each path is its own process: threads only wait for them
            with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="selftest") as pool:
                checks = list(pool.map(one, PATHS))  # in PATHS' order, whatever order they end in
    return checks
