"""Preemption (issue 17 item 1): SIGTERM stops every rank at the next step boundary, saves, exits 143.

Lightning 2.6 broadcast from inside its SIGTERM handler: SIGTERM to one rank, or to the whole
process group, deadlocked until the collective timeout (30 minutes); SIGTERM to rank 0 ended the
fit with status 0, no checkpoint, training unfinished. With our strategies
(``strategies/preemption.py``) the handler only sets a flag, the ranks agree on it after each
optimizer step (one scalar all-reduce), save the last completed step where the Trainer checkpoints
(``ModelCheckpoint``'s ``last.ckpt``) and exit with status 128 + 15, naming the signal.

Here on 2 gloo ranks (``tests/scripts/fail_fit.py``): SIGTERM to rank 1, to rank 0 (the launching process) and to the
whole process group; each job ends by itself with status 143 and ``last.ckpt`` of step 7, and a fit
resumed from it ends exactly where an uninterrupted one does. In-process (one rank): the stop, the
checkpoint, the exit status, a late signal, the handlers restored, SLURM's requeue command:
tests/unit/strategies/test_preemption.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from tests.scripts.fail_harness import Job, launch_all


# ----------------------------------------------------------------------------- in-process
# In-process fits leave Lightning's process group and launcher variables behind: conftest undoes them.
pytestmark = pytest.mark.usefixtures("clean_process")


# ----------------------------------------------------------------------------- 2 ranks

STEPS, AT, STOPPED_AT = 12, 6, 7  # the signal comes during batch 6 (from 0): step 7 completes, then every rank stops
COMMON = ["--steps", str(STEPS), "--ckpt-every", "4"]
CASES = {
    "rank1": ["--fail", "sigterm", "--rank", "1", "--at", str(AT)],
    "rank0": ["--fail", "sigterm", "--rank", "0", "--at", str(AT)],
    "group": ["--fail", "sigterm_group", "--rank", "1", "--at", str(AT)],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("preemption")
    first: dict[str, dict[str, Any]] = {"ref": {"out_dir": root / "ref", "flags": COMMON}}
    for name, flags in CASES.items():
        # a hang (the defect) ends at the harness' deadline: the test then fails on timed_out
        first[name] = {"out_dir": root / name, "flags": [*COMMON, *flags], "timeout": 120}
    jobs = launch_all(first, workers=2)
    second = {
        f"{name}_res": {
            "out_dir": root / f"{name}_res",
            "flags": [*COMMON, "--resume", str(jobs[name].out_dir / "ckpt" / "last.ckpt")],
        }
        for name in CASES
        if (jobs[name].out_dir / "ckpt" / "last.ckpt").exists()
    }
    jobs.update(launch_all(second, workers=2))
    return jobs


def _stopped_at(job: Job) -> list[float]:
    return [float(t) for t in re.findall(r"exiting with status 143 \(128 \+ SIGTERM\) at ([0-9]+\.[0-9]+)", job.output)]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_sigterm_ends_the_job_with_143_and_the_last_completed_step_saved(runs: dict[str, Job], name: str) -> None:
    job = runs[name]
    assert not job.timed_out and job.leftover == [], job.describe()
    assert job.returncode == 143, job.describe()  # the launching process (rank 0): 128 + SIGTERM
    assert len(_stopped_at(job)) == 2, job.describe()  # both ranks stopped and said so
    for rank in (0, 1):
        assert f"[lightning_mgpu] rank {rank}: preempted by SIGTERM" in job.output
    receivers = {"rank1": [1], "rank0": [0], "group": [0, 1]}[name]
    for rank in receivers:
        assert f"rank {rank}: preempted by SIGTERM (received by this rank)" in job.output, job.describe()
    saved = torch.load(job.out_dir / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == STOPPED_AT
    assert not (job.out_dir / "rank0.json").exists()  # the fit did not run on to its end


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_a_fit_resumed_from_the_preemption_checkpoint_ends_exactly_where_an_uninterrupted_one_does(
    runs: dict[str, Job], name: str
) -> None:
    ref, res = runs["ref"], runs[f"{name}_res"]
    assert ref.returncode == 0, ref.describe()
    assert res.returncode == 0, res.describe()
    after = STEPS - STOPPED_AT
    for rank in (0, 1):
        assert res.rank(rank)["global_step"] == STEPS
        assert res.rank(rank)["losses"] == ref.rank(rank)["losses"][-after:]
        assert torch.equal(res.tensors(rank)["params"], ref.tensors(rank)["params"])
        a, b = ref.tensors(rank)["optimizer"], res.tensors(rank)["optimizer"]
        assert a["param_groups"] == b["param_groups"]
        for key, state in a["state"].items():
            assert all(torch.equal(state[k], b["state"][key][k]) for k in state), key


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_preemption_latencies_are_reported(runs: dict[str, Job], capsys: pytest.CaptureFixture[str]) -> None:
    """Printed with ``pytest -s`` for docs/reliability.md: signal -> every rank stopped (checkpoint saved),
    and signal -> every process of the job gone (most of it is interpreter and process-group teardown)."""
    lines = []
    for name in CASES:
        job = runs[name]
        assert job.injected_at is not None and job.latency_s is not None
        stopped = max(_stopped_at(job)) - job.injected_at
        lines.append(
            f"{name}: stopped and saved {stopped:.2f} s after the signal; job gone after {job.latency_s:.1f} s"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
