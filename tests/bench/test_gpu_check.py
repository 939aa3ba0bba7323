"""``python -m bench.gpu_check``: what one call on a lent GPU runs, checked here on its CPU stand-ins.

Not a timing test: the compression part runs two configurations end to end (each fit in the part's own
process, with its time limit), the runs merge into the files the docs' GPU tables read, and a machine
without CUDA is told to use the dry run rather than failing later.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import REPO as REPO_ROOT


@pytest.mark.bench
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_part_runs_in_its_own_process_and_the_launch_merges_into_the_results(tmp_path: Path) -> None:
    from bench.gpu_check import record

    out = tmp_path / "launch"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_check",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--quick",
            "--rounds",
            "1",
            "--parts",
            "compression",
            "--configs",
            "ddp_tuned,ours-fp16",
        ],  # fmt: skip
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    run = json.loads((out / "gpu_check.json").read_text())
    result = run["parts"]["compression"]["result"]
    assert run["parts"]["compression"]["exit_code"] == 0 and run["machine"]["card"].startswith("CPU stand-in")
    assert {r["config"] for r in result["runs"]} == {"ddp_tuned", "ours-fp16"}  # round 0 (warm-up) not kept
    assert all(r["round"] == 1 and r["step_ms_median"] > 0 and r["steps"] == 6 for r in result["runs"])
    assert result["hooks"] == {} and result["non_finite_losses"] == []  # torch's hook not run: nothing to compare
    assert (
        "gpu_check on CPU stand-in" in completed.stdout
        and (out / "gpu_check.log").read_text().count("===== compression (cpu) =====") == 1
    )

    results = tmp_path / "results"
    results.mkdir()
    written = record([f"{out}=dry run@abc1234"], results)
    assert [p.name for p in written] == ["gpu_compression.json"]
    merged = json.loads(written[0].read_text())
    assert merged["machine"] == run["machine"] and merged["launches"][0]["label"] == "dry run"
    assert merged["launches"][0]["commit"] == "abc1234" and merged["launches"][0]["runs"] == result["runs"]


def test_without_cuda_it_points_to_the_dry_run() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the machine-without-a-GPU path")
    from bench.gpu_check import main

    with pytest.raises(SystemExit) as exited:
        main(["--out", "/nonexistent/never-written"])
    assert exited.value.code == 2  # argparse's error, before anything starts
