"""Fit an MLP under CommProfiler and record DDP's own timers next to it, as JSON.

    python -m tests.scripts.fit_profiled --out result.json --devices 2 --steps 30 --export-dir prof/

Rank 0 writes ``--out``: the profiler's summary and, per step, DDP's logging data
(``_get_ddp_logging_data()`` with sample rate 1: backward compute, communication and
overlap times), so that tests can compare the two; and each optimizer step's time measured
apart from the profiler (every micro-batch of its accumulation window, start to end).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import CommProfiler, TunedDDPStrategy
from tests.scripts.models import MLPRegressor


class DDPTimers(L.Callback):
    """Reads DDP's own per-iteration timers (they describe the previous iteration)."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.rows: list[dict[str, float]] = []
        self.comm_hooks: list[Any] = []  # the hook DDP registered, per fit
        self.wrappers: list[tuple[int, Any]] = []  # (global step, hook) of each DDP wrapper after the first
        self._seen: Any = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            model._set_ddp_runtime_logging_sample_rate(1)
            self.comm_hooks.append(model._get_ddp_logging_data().get("comm_hook"))
        self._seen = model

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        model = trainer.strategy.model
        if model is not self._seen and isinstance(model, DistributedDataParallel):  # CommProfiler re-wrapped DDP
            model._set_ddp_runtime_logging_sample_rate(1)
            self.wrappers.append((trainer.global_step, model._get_ddp_logging_data().get("comm_hook")))
        self._seen = model

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel) or trainer.global_step <= self.skip + 1:
            return
        data = model._get_ddp_logging_data()
        keys = ("backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time")
        if all(key in data for key in keys):
            # read after step g's optimizer step, it describes the step before: g - 1
            self.rows.append({"step": trainer.global_step - 1, **{key: data[key] / 1e6 for key in keys}})


class OptimizerStepTimer(L.Callback):
    """Each optimizer step's time, measured apart from the profiler: every batch of its
    accumulation window from ``on_train_batch_start`` to ``on_train_batch_end``, summed (the
    profiler's definition of a step; the data loading between batches is not counted)."""

    def __init__(self) -> None:
        self.ms: dict[int, float] = {}  # global step after the optimizer step -> ms
        self._window_ms = 0.0
        self._start = 0.0
        self._step_before = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._step_before = trainer.global_step
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._window_ms += (time.perf_counter() - self._start) * 1e3
        if trainer.global_step != self._step_before:  # this batch stepped the optimizer: the window ends
            self.ms[trainer.global_step] = self._window_ms
            self._window_ms = 0.0


def _logger(use_wandb: bool) -> Any:
    if use_wandb:
        from lightning.pytorch.loggers import WandbLogger

        return WandbLogger(project="lightning_mgpu_tests", save_dir=".", offline=True)
    return L.pytorch.loggers.CSVLogger("logs")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="ddp_tuned")
    parser.add_argument("--strategy-kwargs", default="{}")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--profile-every", type=int, default=0, help="0: profile every step (profile_every=None)")
    parser.add_argument("--export-dir", default=None)
    parser.add_argument("--sweep", default=None, help="a bench-comm --json result for busbw_fraction")
    parser.add_argument("--fits", type=int, default=1, help="call trainer.fit this many times")
    parser.add_argument("--wandb", action="store_true", help="log to an offline WandbLogger under ./wandb")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    x = torch.randn(4096, 256)
    y = torch.randn(4096, 16)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)
    kwargs = json.loads(args.strategy_kwargs)
    strategy: Any = TunedDDPStrategy(**kwargs) if kwargs else args.strategy
    profiler = CommProfiler(
        warmup_steps=args.warmup,
        every_n_steps=args.every,
        export_dir=args.export_dir,
        timeline_steps=args.steps,
        sweep=args.sweep,
        profile_steps=args.profile_steps,
        profile_every=args.profile_every or None,
    )
    timers = DDPTimers(skip=args.warmup)
    optimizer_steps = OptimizerStepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=[profiler, timers, optimizer_steps],
        logger=_logger(args.wandb),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = MLPRegressor(
        in_features=256,
        width=args.width,
        depth=args.depth,
        out_features=16,
        activation=nn.ReLU,
        lr=0.01,
        record_losses=False,  # step times are measured: no loss.item() sync
    )
    for fit in range(args.fits):
        if fit:  # the same trainer again, as a user resuming in a notebook would
            trainer.fit_loop.epoch_loop.max_steps += args.steps
        trainer.fit(model, loader)
    if trainer.global_rank != 0:
        return

    def median(key: str) -> Optional[float]:
        values = [row[key] for row in timers.rows]
        return statistics.median(values) if values else None

    # The profiler's own per-step timelines on rank 0, in DDP's definitions:
    # compute = forward end -> backward compute end; comm = first launch -> last done;
    # DDP's "overlap" = first launch -> backward compute end.
    ours = {}
    for t in profiler.stats.kept_timelines:
        if not t.buckets or t.compute_end_ms is None:
            continue
        first = min(b.launch_ms for b in t.buckets)
        ours[t.step] = {
            "backward_compute_time": t.compute_end_ms - t.forward_end_ms,
            "backward_comm_time": max(b.done_ms for b in t.buckets) - first,
            "backward_compute_comm_overlap_time": t.compute_end_ms - first,
        }
    pairs = [(ours[row["step"]], row) for row in timers.rows if row["step"] in ours]
    result = {
        "pairs": [{"step": d["step"], "ours": o, "ddp": {k: v for k, v in d.items() if k != "step"}} for o, d in pairs],
        "summary": profiler.summary,
        "rank0": profiler.ranks[0] if profiler.ranks else None,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "comm_hooks": timers.comm_hooks,
        "wrappers": timers.wrappers,
        "switches": list(profiler.switches),
        "profiled_steps": profiler.stats.step_numbers,
        "optimizer_steps_ms": optimizer_steps.ms,
        "ddp": {
            "rows": len(timers.rows),
            "backward_compute_ms": median("backward_compute_time"),
            "comm_ms": median("backward_comm_time"),
            "overlap_ms": median("backward_compute_comm_overlap_time"),
        },
        "gradient_bytes": sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters()),
        "logged": sorted(k for k in trainer.logged_metrics if k.startswith("comm/")),
    }
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
