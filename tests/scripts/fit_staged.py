"""Fits of unmodified models (HF GPT-2 with tied embeddings, a residual CNN) under `hybrid` with split points
and every schedule, or on one plain device: for tests/dist/strategies/test_hybrid_staged.py.

Each schedule in --schedules is one fit in this process (same seed, same data); rank 0 writes
the losses Lightning saw per step (the combined loss training_step returned), the logged
train_loss, and the final parameters and buffers to --out. ``--reference-chunks C`` (one
device only): training_step computes the loss of C consecutive micro-batches one after the
other and returns their mean, the single-process reference for BatchNorm in training mode
(which normalises per micro-batch in any micro-batched pipeline).
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu import HybridParallelStrategy
from tests.scripts.split_models import ResidualCNN, tiny_gpt2

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=("gpt2", "cnn"), default="gpt2")
parser.add_argument("--strategy", choices=("hybrid", "single"), default="hybrid")
parser.add_argument("--schedules", default="gpipe,1f1b,zero_bubble")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--m", type=int, default=4, help="microbatches")
parser.add_argument("--split-points", default="", help="comma-separated; empty: the strategy chooses")
parser.add_argument("--balance", default="params")
parser.add_argument("--batch-size", type=int, default=16, help="per process")
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--reference-chunks", type=int, default=1)
parser.add_argument("--out", required=True)


class Split(L.LightningModule):
    def __init__(self, kind: str, batch_size: int, samples: int, chunks: int) -> None:
        super().__init__()
        self.kind, self.batch_size, self.chunks = kind, batch_size, chunks
        g = torch.Generator().manual_seed(1)
        if kind == "gpt2":
            self.model = tiny_gpt2()
            ids = torch.randint(0, 64, (samples, 12), generator=g)
            self.data = TensorDataset(ids, ids)
        else:
            self.model = ResidualCNN()
            self.data = TensorDataset(
                torch.randn(samples, 3, 8, 8, generator=g), torch.randint(0, 5, (samples,), generator=g)
            )
        self.seen: list[float] = []

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "gpt2":
            return self.model(input_ids=x, labels=y).loss
        return F.cross_entropy(self.model(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.chunks > 1:
            loss = (
                sum(self.loss(a, b) for a, b in zip(x.tensor_split(self.chunks), y.tensor_split(self.chunks)))
                / self.chunks
            )
        else:
            loss = self.loss(x, y)
        self.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: dict[str, torch.Tensor], batch: object, batch_idx: int) -> None:
        self.seen.append(float(self.all_gather(outputs["loss"].detach()).mean()))  # the global batch's loss

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(
            self.data, batch_size=self.batch_size, sampler=DistributedSampler(self.data, world, rank, shuffle=False)
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    args = parser.parse_args()
    records = {}
    for schedule in args.schedules.split(","):
        torch.manual_seed(0)
        model = Split(args.model, args.batch_size, args.samples, args.reference_chunks)
        if args.strategy == "hybrid":
            points = [p for p in args.split_points.split(",") if p] or None
            balance = [int(s) for s in args.balance.split(",")] if "," in args.balance else args.balance
            strategy: object = HybridParallelStrategy(
                devices_per_replica=2, microbatches=args.m, split_points=points, schedule=schedule, balance=balance
            )
        else:
            strategy = "auto"
        trainer = L.Trainer(
            accelerator="cpu",
            devices=args.devices if args.strategy == "hybrid" else 1,
            strategy=strategy,
            max_epochs=1,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            log_every_n_steps=1,
        )
        trainer.fit(model)
        if trainer.global_rank == 0:
            records[schedule] = {
                "losses": model.seen,
                "logged": float(trainer.callback_metrics["train_loss"]),
                "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "world_size": trainer.world_size,
                "split_points": getattr(trainer.strategy, "split_points", None),
                "tied": model.model.lm_head.weight is model.model.transformer.wte.weight
                if args.model == "gpt2"
                else None,
            }
    # The process group stays between the schedules' fits, as Lightning leaves it for a later Trainer. Destroying
    # it between them (most likely) let rank 1 start the next rendezvous while rank 0's old store still served the last one's
    # keys: rank 1 then dialled rank 0's closing gloo socket ("Connection reset by peer"; torch's env:// alike).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if records:
        torch.save(records, args.out)
        print(json.dumps({s: r["split_points"] for s, r in records.items()}))


if __name__ == "__main__":
    main()
