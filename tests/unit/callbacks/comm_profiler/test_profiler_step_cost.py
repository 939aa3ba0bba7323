"""What CommProfiler costs a step it does not record: no clock read (on a GPU each was a CUDA event,
created and recorded from Python every step: 1.17x the step of a host-bound H100 fit), and figures
logged as CPU tensors (Lightning makes a float a tensor on the module's device: on a GPU, one copy
that waits for the GPU per figure). In process, a real one-rank fit (a gloo group of one).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import CommProfiler, TunedDDPStrategy
from lightning_mgpu.comm import timing
from tests.scripts.models import MLPRegressor

STEPS = 14


def _trainer(root: Path, callbacks: list[L.Callback], **options: Any) -> L.Trainer:
    """One CPU device under ``TunedDDPStrategy`` (DDP's hook really there), nothing but training and validation."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=TunedDDPStrategy(),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **options,
    )


class _Step(L.Callback):
    """Before the profiler's own hooks: which batch the clock is read in."""

    def __init__(self) -> None:
        self.now = -1

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self.now = trainer.global_step


def test_only_the_steps_it_records_read_the_clock_and_its_figures_are_logged_on_the_cpu(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = _Step()
    marks: list[int] = []  # the batches the profiler's own marks read the clock in
    buckets: list[int] = []  # ... and its bucket timer, in DDP's hook
    stamp = timing.HostClock.stamp

    def counted(self: timing.HostClock) -> Any:
        (marks if sys._getframe(1).f_code.co_name == "_stamp" else buckets).append(step.now)
        return stamp(self)

    monkeypatch.setattr(timing.HostClock, "stamp", counted)
    logged: list[dict[str, Any]] = []
    log_dict = L.LightningModule.log_dict

    def kept(self: L.LightningModule, dictionary: Any, *args: Any, **kwargs: Any) -> None:
        logged.append(dict(dictionary))
        log_dict(self, dictionary, *args, **kwargs)

    monkeypatch.setattr(L.LightningModule, "log_dict", kept)

    # windows of 2 profiled steps in every 6 (after a warm-up of 1): the hook goes out and back in between
    profiler = CommProfiler(warmup_steps=1, every_n_steps=50, profile_steps=2, profile_every=6, whatif=None)
    torch.manual_seed(0)
    x = torch.randn(8 * STEPS, 32)
    trainer = _trainer(tmp_path, [step, profiler], max_steps=STEPS)
    model = MLPRegressor(in_features=32, width=32, depth=1, out_features=1, lr=0.01, record_losses=False)
    trainer.fit(model, DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8))

    # synchronising step n is the batch of global step n - 1 here (no accumulation)
    profiled = [batch for batch in range(STEPS) if profiler.schedule.phase(batch + 1) == "profile"]
    switches = list(profiler.switches)
    assert switches[:4] == [(3, False), (6, True), (10, False), (12, True)]  # two windows: the hook out, then in again
    assert profiler.stats.step_numbers == [3, 9, 10]  # steps 2 and 8 settle a new DDP wrapper: not recorded
    # the marks (start, forward end, backward end, optimizer start, end): five in each batch of a window, no other
    assert sorted(set(marks)) == profiled == [1, 2, 8, 9] and len(marks) == 5 * len(profiled)
    # the bucket timer only while the hook is in DDP: none between a window's end and the next hook
    hook_out = {batch for (off, _), (on, _) in zip(switches[::2], switches[1::2]) for batch in range(off, on)}
    assert hook_out == {3, 4, 5, 10, 11} and not hook_out & set(buckets)
    assert logged and all(
        isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1
        for figures in logged
        for value in figures.values()
    )
    assert trainer.callback_metrics["comm/step_ms"].device.type == "cpu"


class _WithValidation(MLPRegressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))


def test_validation_between_steps_leaves_the_steps_marks_alone(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DDP's wrapper runs validation's forward too, and its forward hook stamped "forward_end" into the last
    # training step's marks: on CUDA that step is read one step later, after the validation in between.
    stamps: list[tuple[str, bool]] = []
    stamp = CommProfiler._stamp
    trainer: Any = None

    def kept(self: CommProfiler, name: str) -> None:
        stamps.append((name, trainer.validating))
        stamp(self, name)

    monkeypatch.setattr(CommProfiler, "_stamp", kept)
    profiler = CommProfiler(warmup_steps=1, every_n_steps=50, profile_every=None, whatif=None)
    torch.manual_seed(0)
    x = torch.randn(8 * 6, 32)
    data = TensorDataset(x, x[:, :1].sin())
    trainer = _trainer(tmp_path, [profiler], max_steps=6, val_check_interval=2, limit_val_batches=2)
    model = _WithValidation(in_features=32, width=32, depth=1, out_features=1, lr=0.01, record_losses=False)
    trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    assert "val_loss" in trainer.callback_metrics  # validation ran, through DDP's wrapper
    assert [name for name, validating in stamps if validating] == []
    assert sum(name == "forward_end" for name, _ in stamps) == 6  # one per training step
