"""A small fit under Lightning's ``ModelParallelStrategy`` (FSDP2, ``fully_shard``) on CPU ranks, with
``CommProfiler`` and ``DistributedDoctor``; rank 0 writes what they reported as JSON.

    python -m tests.scripts.fit_fsdp2 --out result.json --export-dir prof/
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import CommProfiler, DistributedDoctor


class ShardedMLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--export-dir", default=None)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    x = torch.randn(512, 16)
    loader = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=16)
    profiler = CommProfiler(warmup_steps=2, every_n_steps=2, export_dir=args.export_dir, profile_every=None)
    doctor = DistributedDoctor(check_every_n_batches=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=args.steps,
        callbacks=[profiler, doctor],
        logger=L.pytorch.loggers.CSVLogger("logs"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ShardedMLP(), loader)
    if trainer.global_rank == 0:
        result: dict[str, Any] = {
            "summary": profiler.summary,
            "logged": {k: float(v) for k, v in trainer.logged_metrics.items() if k.startswith("comm/")},
            "doctor_not_checked": sorted(doctor.not_checked),
            "doctor_findings": [f.rule for f in doctor.findings],
            "global_step": trainer.global_step,
        }
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
