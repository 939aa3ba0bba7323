"""``python -m bench.fp16_safety --quick`` runs end to end and reports the five configurations.

Not a timing test: it checks that the script launches float32, torch's fp16 hook, ours and the two
alternatives measured against it with 2 gloo ranks, on the same bucket layout, and that the JSON
holds what docs/reliability.md cites.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import REPO as REPO_ROOT

CONFIGS = {"ddp_tuned", "fp16_torch", "fp16_scaled", "fp16_exchanged", "fp16_checked", "fp16_skip"}


@pytest.mark.bench
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_fp16_safety_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "fp16_safety.json"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.fp16_safety", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=390,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["world_size"] == 2 and report["machine"]["backend"] == "gloo"
    assert {launch["config"] for launch in report["launches"]} == CONFIGS
    assert set(report["summary"]) == CONFIGS
    for launch in report["launches"]:
        assert len(launch["step_ms"]) == report["settings"]["steps"] and launch["step"]["median"] > 0
        assert launch["strategy_class"] == "TunedDDPStrategy"
        assert math.isfinite(launch["final_loss"])  # the MLP's gradients are small: every variant trains
    assert "Cheapest safe design here" in completed.stdout
