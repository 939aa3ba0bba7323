"""A profiled fit on 2 CPU ranks (tests/scripts/fit_profiled.py), read back: shared by
tests/dist/callbacks/comm_profiler/test_comm_profiler.py and tests/dist/callbacks/test_profiler_strategies.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import SCRIPTS, run_python

WARMUP = 3


def profile_run(tmp_path: Path, *flags: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    args = [str(SCRIPTS / "fit_profiled.py"), "--out", str(out), "--warmup", str(WARMUP), *flags]
    proc = run_python(args, cwd=tmp_path, timeout=180)
    result: dict[str, Any] = json.loads(out.read_text())
    result["stdout"] = proc.stdout + proc.stderr
    return result
