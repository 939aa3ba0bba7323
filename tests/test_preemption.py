"""Preemption (issue 17 item 1): SIGTERM stops every rank at the next step boundary, saves, exits 143.

Lightning 2.6 broadcast from inside its SIGTERM handler: SIGTERM to one rank, or to the whole
process group, deadlocked until the collective timeout (30 minutes); SIGTERM to rank 0 ended the
fit with status 0, no checkpoint, training unfinished. With our strategies
(``strategies/preemption.py``) the handler only sets a flag, the ranks agree on it after each
optimizer step (one scalar all-reduce), save the last completed step where the Trainer checkpoints
(``ModelCheckpoint``'s ``last.ckpt``) and exit with status 128 + 15, naming the signal.

In-process (one rank, the fast lane): the stop, the checkpoint, the exit status, a late signal
delivered again, the handlers restored, SLURM's requeue command. Multi-process (2 gloo ranks,
``tests/scripts/fail_fit.py``): SIGTERM to rank 1, to rank 0 (the launching process) and to the
whole process group; each job ends by itself with status 143 and ``last.ckpt`` of step 7, and a fit
resumed from it ends exactly where an uninterrupted one does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import TunedDDPStrategy
from lightning_mgpu.strategies.parts import preemption
from lightning_mgpu.strategies.parts.preemption import Preempted
from tests.scripts.fail_harness import Job, launch_all


# ----------------------------------------------------------------------------- in-process
# In-process fits leave Lightning's process group and launcher variables behind: conftest undoes them.
pytestmark = pytest.mark.usefixtures("clean_process")


class Tiny(L.LightningModule):
    def __init__(self, signal_at: int = -1, signal_at_end: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.signal_at, self.signal_at_end = signal_at, signal_at_end

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: a flag
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def on_train_end(self) -> None:
        if self.signal_at_end:
            os.kill(os.getpid(), signal.SIGTERM)  # no step boundary is left

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 8, generator=generator)),
            batch_size=4,
        )


def trainer(root: Path, steps: int = 10) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=TunedDDPStrategy(),
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=4, save_top_k=-1)],
    )


def test_sigterm_stops_after_the_step_saves_it_and_exits_with_143(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as caught:
        trainer(tmp_path).fit(Tiny(signal_at=5))
    assert caught.value.code == 143 and caught.value.signum == signal.SIGTERM and isinstance(caught.value, SystemExit)
    assert "preempted by SIGTERM" in str(caught.value) and "after global step 6" in str(caught.value)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 6  # the step during which the signal came completed, and was saved
    assert signal.getsignal(signal.SIGTERM) == before  # handlers as they were
    # and the fit resumes from it to the end
    resumed = trainer(tmp_path / "again")
    resumed.fit(Tiny(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert resumed.global_step == 10


def test_a_signal_after_the_last_step_goes_to_the_previous_handler_once_the_fit_is_done(tmp_path: Path) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        fit = trainer(tmp_path, steps=3)
        fit.fit(Tiny(signal_at_end=True))  # returns: the training had completed
        assert seen == [signal.SIGTERM] and fit.global_step == 3
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_late_signal_with_the_default_handler_ends_the_process_after_the_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raised: list[tuple[int, Any]] = []
    original = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    monkeypatch.setattr(signal, "raise_signal", lambda signum: raised.append((signum, signal.getsignal(signum))))
    try:
        trainer(tmp_path, steps=3).fit(Tiny(signal_at_end=True))
        # delivered again, to the default action (the process would end here), after the fit's teardown
        assert raised == [(signal.SIGTERM, signal.SIG_DFL)]
    finally:
        signal.signal(signal.SIGTERM, original)


class Failing(Tiny):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            raise RuntimeError("the step failed")  # before any step boundary could act on the signal
        return super().training_step(batch, batch_idx)


def test_a_signal_that_comes_while_the_fit_fails_leaves_the_error_to_end_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raised: list[int] = []
    original = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    try:
        with pytest.raises(RuntimeError, match="the step failed"):  # the error is what the caller sees...
            trainer(tmp_path, steps=5).fit(Failing())
        assert raised == []  # ...not a SIGTERM that would end the process before it is printed
    finally:
        signal.signal(signal.SIGTERM, original)


def test_the_exit_status_names_the_signal() -> None:
    error = Preempted(signal.SIGUSR1, "message")
    assert error.code == 138 and str(error) == "message" and preemption.signal_name(15) == "SIGTERM"


def test_slurm_requeue_runs_scontrol_for_the_job_or_the_array_task(monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(preemption.subprocess, "run", fake_run)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert preemption._requeue_slurm_job() == "SLURM job 4242 requeued"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert preemption._requeue_slurm_job() == "SLURM job 77_3 requeued"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77; rm -rf /")
    assert "not requeued" in preemption._requeue_slurm_job()
    assert commands == [["scontrol", "requeue", "4242"], ["scontrol", "requeue", "77_3"]]


def test_hpc_checkpoints_are_numbered_as_lightning_resumes_them(tmp_path: Path) -> None:
    assert preemption._next_hpc_checkpoint(str(tmp_path)) == str(tmp_path / "hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_1.ckpt").touch()
    (tmp_path / "hpc_ckpt_7.ckpt").touch()
    assert preemption._next_hpc_checkpoint(str(tmp_path)) == str(tmp_path / "hpc_ckpt_8.ckpt")


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
