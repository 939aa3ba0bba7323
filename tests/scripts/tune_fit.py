"""Fit a small MLP with TunedDDPStrategy (``bucket_cap_mb="auto"`` or a fixed size); every rank
reports what happened, as JSON, for tests/dist/tuning/test_tuning.py.

    python -m tests.scripts.tune_fit --out-dir run/ --steps 120 \
        --strategy-kwargs '{"bucket_cap_mb": "auto", "tune_candidates": [0.25, 1]}'

The data do not come from the data loader's position: each micro-batch is drawn from a
generator seeded by the global batch count and the rank, so a resumed fit sees exactly
the batches an uninterrupted one would (whatever the loader does on restart).

Every rank writes ``rank<R>.json`` (its strategy's bucket size, tuning record and
re-wraps; the DDP wrapper seen at each batch); rank 0 also writes ``losses`` and
``params.pt`` (the final parameters, flat) and checks that every rank holds the same ones.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu
from lightning_mgpu import TunedDDPStrategy
from tests.scripts.models import MLPRegressor, position_generator


class MLP(MLPRegressor):
    """Batches drawn from the position in the fit (``position_generator``), not from the loader."""

    def __init__(self, width: int, depth: int, batch_size: int, out_features: int) -> None:
        super().__init__(width=width, depth=depth, out_features=out_features, lr=0.05, momentum=0.9)
        self.batch_size = batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        seen = self.trainer.fit_loop.epoch_loop.batch_progress.total.ready  # restored on resume
        generator = position_generator(seen, self.global_rank)
        x = torch.randn(self.batch_size, 32, generator=generator)
        out = self.net[-1].out_features
        y = torch.sin(x[:, :out] * 2) + 0.1 * x[:, out : 2 * out]
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss


class Probe(L.Callback):
    """Which DDP wrapper each batch runs on, and the final report."""

    def __init__(self, out_dir: Path, params_at: int) -> None:
        self.out_dir = out_dir
        self.params_at = params_at
        self.batches: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.params_at and not (self.out_dir / "params_at.pt").exists():
            flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
            if trainer.global_rank == 0:
                torch.save(flat.clone(), self.out_dir / "params_at.pt")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        progress = trainer.fit_loop.epoch_loop.batch_progress.total
        self.batches.append(
            {"batch": progress.ready, "global_step": trainer.global_step, "wrapper": id(trainer.strategy.model)}
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, TunedDDPStrategy) and isinstance(pl_module, MLP)
        layout = strategy.bucket_layout
        model = strategy.model
        data = model._get_ddp_logging_data() if isinstance(model, torch.nn.parallel.DistributedDataParallel) else {}
        report: dict[str, Any] = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "bucket_cap_mb": strategy.bucket_cap_mb,
            "first_bucket_cap_mb": strategy.first_bucket_cap_mb,
            "tuning": strategy.tuning,
            "rewraps": strategy.rewraps,
            "batches": self.batches,
            "built_bytes": None if layout is None else [b.bytes for b in layout],
            "comm_hook": data.get("comm_hook"),
            "powersgd_remaps": None if strategy.powersgd_keeper is None else strategy.powersgd_keeper.remaps,
            "accumulate": trainer.accumulate_grad_batches,
            "wrapper_forward_hooks": len(getattr(model, "_forward_hooks", {})),
        }
        profiler = next((c for c in trainer.callbacks if isinstance(c, lightning_mgpu.CommProfiler)), None)
        if profiler is not None:
            report["profile"] = {"summary": profiler.summary, "buckets": profiler.stats.local_buckets()}
            report["profiler_switches"] = list(profiler.switches)
            report["profiled_steps"] = profiler.stats.step_numbers
        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        gathered = strategy.all_gather(flat)
        if trainer.global_rank == 0:
            report["losses"] = pl_module.losses
            report["params_rank_max_diff"] = float((gathered - gathered[0]).abs().max())
            torch.save(flat.clone(), self.out_dir / "params.pt")
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--strategy-kwargs", default='{"bucket_cap_mb": "auto"}', help="JSON for TunedDDPStrategy")
    parser.add_argument("--steps", type=int, default=120, help="max_steps (optimizer steps)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--out-features",
        type=int,
        default=1,
        help="16: every tensor a multiple of 64 bytes, so that CPU matmuls "
        "on bucket views round the same whatever their offset in the bucket (PowerSGD comparisons)",
    )
    parser.add_argument("--profiler", action="store_true", help="CommProfiler(warmup_steps=2) with exports")
    parser.add_argument("--ckpt", type=Path, default=None, help="save a checkpoint here after fit")
    parser.add_argument("--resume", type=Path, default=None, help="fit(ckpt_path=...)")
    parser.add_argument("--params-at", type=int, default=-1, help="also save the parameters after this global step")
    parser.add_argument("--start-method", default="popen", help="popen (the script again per rank) or spawn")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    L.seed_everything(7, verbose=False)
    model = MLP(args.width, args.depth, args.batch_size, args.out_features)
    strategy = TunedDDPStrategy(**json.loads(args.strategy_kwargs), start_method=args.start_method)
    callbacks: list[L.Callback] = [Probe(args.out_dir, args.params_at)]
    if args.profiler:
        callbacks.append(lightning_mgpu.CommProfiler(warmup_steps=2, every_n_steps=5, export_dir=args.out_dir / "prof"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        logger=L.pytorch.loggers.CSVLogger(str(args.out_dir), name="logs"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # 64 index batches per rank and epoch: epochs end and start during tuning too.
    loader = DataLoader(TensorDataset(torch.arange(2 * 64)), batch_size=1)
    trainer.fit(model, loader, ckpt_path=str(args.resume) if args.resume else None)
    if args.start_method != "popen":  # the launching process: what does its strategy say now?
        main_view = {"bucket_cap_mb": strategy.bucket_cap_mb, "tuning_status": strategy.tuning_status}
        (args.out_dir / "main.json").write_text(json.dumps(main_view))
    if args.ckpt:
        trainer.save_checkpoint(args.ckpt)
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
