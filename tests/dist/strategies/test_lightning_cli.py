"""Every public class from a LightningCLI YAML, through a real ``fit`` on 2 CPU ranks (issue 18 item 1).

``class_path`` without ``init_args`` is the case that failed: jsonargparse fills in every
default of ``DistributedDataParallel`` and the strategy refused ``output_device=None``. Each run
also checks that nothing is left in ``os.environ`` after ``fit`` (``GLOO_SOCKET_IFNAME`` was, item 2),
and that the variable was in force when the process group was made, and only then (issue 28 item 6).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, run_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the test extra)")

# What Lightning's own launcher leaves in the launching process (stock DDPStrategy does the same).
LIGHTNING_LEAVES = {
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "NODE_RANK",
    "LOCAL_RANK",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
}


def _cli_fit(tmp_path: Path, config: str) -> list[dict[str, Any]]:
    path = tmp_path / "config.yaml"
    path.write_text(config)
    prefix = tmp_path / "report"
    run_python(["-m", "tests.scripts.cli_fit", str(path), str(prefix)], cwd=REPO, timeout=240)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("report.rank*.json"))]
    assert len(reports) == 2, f"one report per rank expected, got {len(reports)}"
    return reports


TRAINER = """\
trainer:
  accelerator: cpu
  max_steps: 12
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
"""


def test_tuned_ddp_without_init_args_and_both_callbacks_from_yaml(tmp_path: Path) -> None:
    config = (
        TRAINER.format(root=tmp_path)
        + """\
  devices: 2
  strategy:
    class_path: lightning_mgpu.TunedDDPStrategy
  callbacks:
    - class_path: lightning_mgpu.CommProfiler
      init_args:
        warmup_steps: 1
        every_n_steps: 2
    - class_path: lightning_mgpu.DistributedDoctor
      init_args:
        check_every_n_batches: 4
    - class_path: tests.scripts.cli_fit.Report
"""
    )
    for report in _cli_fit(tmp_path, config):
        assert report["strategy"] == "TunedDDPStrategy" and report["world_size"] == 2
        assert {"CommProfiler", "DistributedDoctor", "Report"} <= set(report["callbacks"])
        assert report["global_step"] == 12
        summary = report["profiler_summary"]
        assert summary is not None and summary["steps"] > 0 and summary["comm_ms"] > 0
        assert report["doctor_checks"] > 0 and report["doctor_findings"] == []
        assert report["gloo_interface_at_init"] is not None  # gloo was pinned to loopback when the group was made,
        assert report["gloo_interface_during_fit"] is None  # for that call only (issue 28 item 6) ...
        assert report["gloo_interface_after_fit"] is None  # ... and nothing is left after fit
        assert not set(report["added_environment"]) - LIGHTNING_LEAVES, report["added_environment"]


def test_hybrid_from_yaml(tmp_path: Path) -> None:
    config = (
        TRAINER.format(root=tmp_path)
        + """\
  devices: 4
  strategy:
    class_path: lightning_mgpu.HybridParallelStrategy
    init_args:
      devices_per_replica: 2
      microbatches: 2
  callbacks:
    - class_path: tests.scripts.cli_fit.Report
"""
    )
    for report in _cli_fit(tmp_path, config):
        assert report["strategy"] == "HybridParallelStrategy" and report["world_size"] == 2
        assert report["global_step"] == 12
        assert report["gloo_interface_after_fit"] is None
        assert not set(report["added_environment"]) - LIGHTNING_LEAVES, report["added_environment"]
