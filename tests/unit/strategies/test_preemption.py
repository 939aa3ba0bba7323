"""Preemption (issue 17 item 1): SIGTERM stops every rank at the next step boundary, saves, exits 143.

Lightning 2.6 broadcast from inside its SIGTERM handler: SIGTERM to one rank, or to the whole
process group, deadlocked until the collective timeout (30 minutes); SIGTERM to rank 0 ended the
fit with status 0, no checkpoint, training unfinished. With our strategies
(``strategies/preemption.py``) the handler only sets a flag, the ranks agree on it after each
optimizer step (one scalar all-reduce), save the last completed step where the Trainer checkpoints
(``ModelCheckpoint``'s ``last.ckpt``) and exit with status 128 + 15, naming the signal.

Here, in-process (one rank, the fast lane): the stop, the checkpoint, the exit status, a late signal
delivered again, the handlers restored, SLURM's requeue command. On 2 gloo ranks:
tests/dist/strategies/test_preemption.py.
"""

from __future__ import annotations

import os
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
