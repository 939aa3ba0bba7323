"""CommProfiler and DistributedDoctor under the strategies users already have, and what their reports say (issue 18).

In process, one rank (a real gloo group of one: DDP still runs its communication hook):

* under Lightning's own ``DDPStrategy`` the profiler registers its timed hook itself and measures
  the buckets (the 2-rank agreement with DDP's own timers: ``tests/dist/callbacks/test_profiler_strategies.py``);
* a user's ``ddp_comm_wrapper`` is kept and composed with ours, and given back after fit;
* with ``profile_every=None`` and fewer profiled steps than ``every_n_steps``, ``comm/*`` still
  reaches the logger, at the end of fit;
* ``strategy.bucket_layout`` is still there after fit.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import CommProfiler, TunedDDPStrategy
from lightning_mgpu.callbacks.comm_profiler import callback as callback_module
from lightning_mgpu.callbacks.comm_profiler.callback import comm_hook_host
from lightning_mgpu.callbacks.comm_profiler.stock_ddp import StockDDPHookHost, wire_ratio_of
from lightning_mgpu.comm.timing import HostClock
from tests.scripts.models import MLPRegressor


class HookName(L.Callback):
    """The communication hook DDP runs, read while the wrapper exists."""

    name: Any = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        if isinstance(model, nn.parallel.DistributedDataParallel):
            HookName.name = model._get_ddp_logging_data().get("comm_hook")


def _fit(root: Path, strategy: Any, profiler: CommProfiler, *, steps: int, accumulate: int = 1) -> L.Trainer:
    torch.manual_seed(0)
    x = torch.randn(16 * steps * accumulate, 32)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[profiler, HookName()],
        logger=CSVLogger(root, name="logs"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    model = MLPRegressor(in_features=32, width=64, depth=2, out_features=1, activation=nn.Tanh, lr=0.01)
    trainer.fit(model, DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=16))
    return trainer


def _logged_keys(trainer: L.Trainer) -> set[str]:
    logger = trainer.logger
    assert isinstance(logger, CSVLogger)
    with open(Path(logger.log_dir) / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    return {key for row in rows for key, value in row.items() if key.startswith("comm/") and value not in ("", None)}


def test_stock_ddp_gets_the_timed_hook_and_real_bucket_figures(tmp_path: Path, one_rank: None) -> None:
    profiler = CommProfiler(warmup_steps=1, every_n_steps=2, profile_every=None)
    trainer = _fit(tmp_path, DDPStrategy(), profiler, steps=8)
    summary = profiler.summary
    assert summary is not None and summary["measures_comm"] is True
    assert summary["comm_ms"] > 0 and summary["backward_compute_ms"] > 0
    gradient_bytes = sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters())
    assert summary["bytes_per_step"] == gradient_bytes == summary["wire_bytes_per_step"]
    assert HookName.name == "timed_averaging_allreduce"  # our averaging all-reduce, timed, in stock DDP
    assert {"comm/comm_ms", "comm/exposed_ms", "comm/busbw_gbps"} <= _logged_keys(trainer)


def test_a_short_fit_still_logs_its_figures_at_the_end(tmp_path: Path, one_rank: None) -> None:
    # 5 profiled steps, every_n_steps=50, one endless window: nothing would be logged before the end
    profiler = CommProfiler(warmup_steps=1, every_n_steps=50, profile_every=None)
    trainer = _fit(tmp_path, TunedDDPStrategy(), profiler, steps=7)
    assert profiler.stats.profiled_steps == 5  # steps 3..7 (step 1 warm-up, DDP's first two settle)
    assert {"comm/step_ms", "comm/comm_ms", "comm/busbw_gbps"} <= _logged_keys(trainer)
    assert profiler.stats.unlogged_steps == 0


def test_bucket_layout_is_still_there_after_fit(tmp_path: Path, one_rank: None) -> None:
    strategy = TunedDDPStrategy(bucket_cap_mb=0.01)
    _fit(tmp_path, strategy, CommProfiler(warmup_steps=1, every_n_steps=2), steps=6)
    layout = strategy.bucket_layout
    assert layout is not None and len(layout) > 1  # kept from before teardown
    assert not isinstance(strategy.model, nn.parallel.DistributedDataParallel)  # the wrapper is gone


def test_a_users_ddp_comm_wrapper_is_composed_and_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_mgpu.callbacks.comm_profiler import stock_ddp

    calls: list[str] = []

    def user_wrapper(hook: Any) -> Any:
        calls.append("user")
        return hook

    def user_hook(state: Any, bucket: Any) -> Any:
        raise AssertionError("not called here")

    def ours(hook: Any) -> Any:
        calls.append("ours")
        return hook

    strategy = DDPStrategy(ddp_comm_hook=user_hook, ddp_comm_wrapper=user_wrapper)
    # Lightning registers a user's hook itself on CUDA only: that case, on this CPU machine
    monkeypatch.setattr(stock_ddp, "stock_ddp_registers_comm_hook", lambda strategy: True)
    host = StockDDPHookHost(strategy)
    host.add_comm_hook_wrapper(ours, pausable=False)
    composed = strategy._ddp_comm_wrapper
    assert composed is not user_wrapper
    assert composed(user_hook) is user_hook and calls == ["user", "ours"]  # the user's first, ours outermost
    assert host.attach(nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel))
    host.detach()
    assert strategy._ddp_comm_wrapper is user_wrapper  # the strategy as the user gave it


def test_which_host_each_strategy_gets() -> None:
    tuned = TunedDDPStrategy()
    assert comm_hook_host(tuned) is tuned
    assert isinstance(comm_hook_host(DDPStrategy()), StockDDPHookHost)
    assert comm_hook_host(L.pytorch.strategies.SingleDeviceStrategy("cpu")) is None


def test_wire_ratio_of_a_users_hook() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    assert wire_ratio_of(None) == 1.0
    assert wire_ratio_of(default_hooks.fp16_compress_hook) == 0.5
    assert wire_ratio_of(default_hooks.bf16_compress_hook) == 0.5
    assert wire_ratio_of(powerSGD_hook.powerSGD_hook) is None  # measured per bucket instead
    assert wire_ratio_of(default_hooks.allreduce_hook) == 1.0


class DeferredHostClock(HostClock):
    """Host stamps read the way CUDA events are: one step later (``device_type == "cuda"``)."""

    device_type = "cuda"  # type: ignore[assignment]


@pytest.mark.parametrize("deferred", [False, True], ids=["host", "read-one-step-later"])
def test_with_accumulation_each_window_s_micro_batches_are_timed_with_its_step(
    tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch, deferred: bool
) -> None:
    """Issue 28: accumulate_grad_batches=3: every profiled step carries the two micro-batches before it
    (also when steps are read one step later, as on CUDA), and the summary has the whole optimizer step."""
    if deferred:
        monkeypatch.setattr(callback_module, "clock_for", lambda device: DeferredHostClock())
    profiler = CommProfiler(warmup_steps=1, every_n_steps=50, profile_every=None)
    _fit(tmp_path, TunedDDPStrategy(), profiler, steps=7, accumulate=3)
    timelines = profiler.stats.kept_timelines
    assert profiler.stats.step_numbers == [3, 4, 5, 6, 7] and len(timelines) == 4
    for timeline in timelines:
        assert len(timeline.micro_batches) == 2
        assert [m.start_ns for m in timeline.micro_batches] == sorted(m.start_ns for m in timeline.micro_batches)
        assert timeline.micro_batches[-1].start_ns < timeline.start_ns  # the window's, before its step
        for micro in timeline.micro_batches:
            assert 0 < micro.forward_end_ms <= micro.backward_end_ms <= micro.end_ms
    summary = profiler.summary
    assert summary is not None and summary["accumulate_grad_batches"] == 3
    assert profiler.ranks[0]["micro_batches"] == 3
    assert 0 < summary["accumulation_compute_ms"] <= summary["accumulation_ms"]
    assert summary["optimizer_step_ms"]["median"] > summary["step_ms"]["median"]
