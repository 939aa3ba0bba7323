"""A small fit under `hybrid`, `ddp_tuned` or one plain device, for the hybrid strategy's tests.

The LightningModule has layers before (`embed`), inside (`body`, the nn.Sequential the
hybrid strategy splits) and after (`head`) the split module, and trains with Adam (so
optimizer state must follow each parameter's device) on 128 samples read in order,
32 per step (4 steps per epoch). Writes rank 0's losses and final state to --out.
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu import CommProfiler, HybridParallelStrategy
from tests.scripts.models import StagedNet

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", choices=("hybrid", "ddp_tuned", "single"), default="hybrid")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--k", type=int, default=2, help="devices_per_replica")
parser.add_argument("--m", type=int, default=4, help="microbatches")
parser.add_argument("--checkpoint", default="never", help="activation checkpointing mode")
parser.add_argument("--balance", default="time")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32, help="per process")
parser.add_argument("--ckpt-save", default=None, help="trainer.save_checkpoint here at the end")
parser.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")
parser.add_argument("--profiler", action="store_true", help="add CommProfiler(warmup_steps=1)")
parser.add_argument(
    "--profile-schedule", default="20,200", help="STEPS,EVERY: the profiler's profile_steps, profile_every"
)
parser.add_argument("--out", required=True)


class Net(StagedNet):
    def __init__(self, batch_size: int) -> None:
        super().__init__(width=32, blocks=5, out_features=1, embed_activation="relu", example_batch=batch_size)
        self.batch_size = batch_size
        self.grads_seen: list[bool] = []  # every parameter has a gradient in on_after_backward

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(128, 8, generator=g)
        data = TensorDataset(x, x[:, :1] * x[:, 1:2])
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(
            data, batch_size=self.batch_size, sampler=DistributedSampler(data, world, rank, shuffle=False)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        self.grads_seen.append(all(p.grad is not None for p in self.parameters()))


def main() -> None:
    args = parser.parse_args()
    profile_steps, profile_every = (int(v) for v in args.profile_schedule.split(","))
    torch.manual_seed(0)
    model = Net(args.batch_size)
    balance = [int(s) for s in args.balance.split(",")] if "," in args.balance else args.balance
    if args.strategy == "hybrid":
        strategy = HybridParallelStrategy(
            devices_per_replica=args.k, microbatches=args.m, checkpoint=args.checkpoint, balance=balance
        )
    elif args.strategy == "ddp_tuned":
        strategy = "ddp_tuned"
    else:
        strategy = "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices if args.strategy != "single" else 1,
        strategy=strategy,
        max_epochs=args.epochs,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            CommProfiler(warmup_steps=1, every_n_steps=2, profile_steps=profile_steps, profile_every=profile_every)
        ]
        if args.profiler
        else [],
    )
    trainer.fit(model, ckpt_path=args.ckpt_path)
    if args.ckpt_save:
        trainer.save_checkpoint(args.ckpt_save)
    if trainer.global_rank == 0:
        optimizer_state = trainer.optimizers[0].state_dict()["state"]
        record = {
            "losses": model.losses,
            "grads_seen": model.grads_seen,
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "exp_avg": [optimizer_state[i]["exp_avg"].cpu() for i in sorted(optimizer_state)],
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "body_class": type(model.body).__name__,
            "plan": getattr(trainer.strategy, "plan", None) and trainer.strategy.plan.sizes,
            "profiler_switches": [list(c.switches) for c in trainer.callbacks if isinstance(c, CommProfiler)],
        }
        torch.save(record, args.out)
        print(json.dumps({"plan": record["plan"], "world_size": record["world_size"]}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
