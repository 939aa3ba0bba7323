"""``compression="fp16"`` never produces a silent NaN or a silent zero (issue 17 item 2).

torch's ``fp16_compress_hook`` casts to float16 *before* dividing by the world size: a gradient
above 65504 becomes inf (NaN parameters after the optimizer, exit 0, no warning), one below
~6e-8 becomes 0 (training stops moving). ``ScaledFp16Allreduce`` divides first and scales each
bucket by the power of two that maps its largest magnitude over all ranks to 2**15: no partial
sum can overflow and small values keep their bits. Gradients that are inf/NaN already, and values
still too small after scaling, are reported (``end_step``, ``TunedDDPStrategy.compression_stats``).

Here the 2-rank fit and the group teardown run (processes); the in-process tests are in
tests/unit/comm/test_fp16_safety.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.scripts.fail_harness import launch_all


# In-process fits leave Lightning's process group and launcher variables behind: conftest undoes them.
pytestmark = pytest.mark.usefixtures("clean_process")


# ----------------------------------------------------------------------------- 2 ranks


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_fp16_compression_on_two_ranks_with_huge_gradients_matches_fp32(tmp_path: Path) -> None:
    """2 gloo ranks, gradients above 65504 (loss x 1e7, Adam): ours ends near the float32 run, torch's hook on NaN."""
    common = ["--steps", "8", "--loss-scale", "1e7"]
    jobs = launch_all(
        {
            "fp32": {"out_dir": tmp_path / "fp32", "flags": common},
            "fp16": {
                "out_dir": tmp_path / "fp16",
                "flags": [*common, "--strategy-kwargs", json.dumps({"compression": "fp16"})],
            },
            "torch": {"out_dir": tmp_path / "torch", "flags": [*common, "--torch-fp16-hook"]},
        }
    )
    for job in jobs.values():
        assert job.returncode == 0 and not job.timed_out, job.describe()
    reference = jobs["fp32"].tensors(0)["params"]
    for rank in (0, 1):
        ours = jobs["fp16"].tensors(rank)["params"]
        assert torch.isfinite(ours).all()
        # float16 keeps 11 bits of each value: Adam, which normalises every element, can move a near-zero
        # gradient's element the other way (by up to 2 x lr per step); the rest follows the float32 run.
        difference = (ours - reference).abs()
        assert float(difference.mean()) < 1e-4 and float((difference > 2e-3).float().mean()) < 1e-3, difference.max()
        stats = jobs["fp16"].rank(rank)["package_state"]
        assert stats["compression"] == "fp16"
        assert torch.isnan(jobs["torch"].tensors(rank)["params"]).any()  # the defect this guards against
    assert torch.equal(jobs["fp16"].tensors(0)["params"], jobs["fp16"].tensors(1)["params"])  # ranks agree


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_destroying_the_group_right_after_a_hook_ran_does_not_abort_the_process() -> None:
    """gloo frees a hook's callback on its worker thread: a callback holding the group's last reference made the
    group join that thread from inside it (``Resource deadlock avoided``, SIGABRT). It took a pytest worker
    with it; the script aborted in 5 runs of 5 before the fix."""
    from tests.conftest import run_python

    repo = Path(__file__).resolve().parents[3]
    done = run_python(["-m", "tests.scripts.group_teardown", "--rounds", "300"], cwd=repo, timeout=150, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": 300 rounds") == 3 and done.stdout.count(": 60 rounds") == 2, done.stdout
    assert done.stdout.rstrip().endswith("retired groups freed"), done.stdout
