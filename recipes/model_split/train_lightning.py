"""The hand-split model of ``train_plain.py`` as a LightningModule on ``HybridParallelStrategy``.

What changes against the plain loop:

* no ``.to(device0)`` / ``.to(device1)`` and no hand-placed cut: the layers of both parts
  go into one ``nn.Sequential`` (``self.layers``), and the strategy measures each layer
  on a sample (``example_input_array``) and cuts where the two stages take the same time
  (exactly: :func:`lightning_mgpu.placement.planning.partition`);
* the batch runs as ``--microbatches`` micro-batches in a fill-drain pipeline, so both
  devices compute at once (the plain loop keeps one of them idle at any moment);
* ``--devices`` counts all devices; every ``--devices-per-replica`` of them form one
  replica (one process), and DDP averages gradients across replicas.

The numbers are the same as the plain loop's (the tests check it to 1e-5): micro-batches
change only the order of a sum, and for 2 replicas give each ``--batch-size`` / 2.

    diff recipes/model_split/train_plain.py recipes/model_split/train_lightning.py

Run:

    python recipes/model_split/train_lightning.py                       # CPU: 1 replica on 2 "devices"
    python recipes/model_split/train_lightning.py --devices 4 --batch-size 32   # CPU: 2 replicas x 2
    python recipes/model_split/train_lightning.py --accelerator gpu --devices 2  # cuda:0 + cuda:1
    python recipes/model_split/train_lightning.py --accelerator gpu --devices 8 --batch-size 16
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from train_plain import ModelPart1, ModelPart2, make_data  # the same parts and data as the plain loop

from lightning_mgpu import HybridParallelStrategy

# -----------------------------------------------------------------------------
# Settings
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seed", type=int, default=0, help="seeds the data and the model's initial weights")
parser.add_argument("--num-samples", type=int, default=2048, help="size of the synthetic data set")
parser.add_argument("--width", type=int, default=128, help="hidden width of the model")
parser.add_argument("--batch-size", type=int, default=64, help="samples per optimizer step, per replica")
parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--epochs", type=int, default=5, help="passes over the data set")
parser.add_argument("--record", default=None, help="save per-step losses and final weights here (for the tests)")
parser.add_argument("--accelerator", default="auto", help="cpu, gpu, ... (auto: the GPUs if there are at least 2)")
parser.add_argument(
    "--devices", type=int, default=None, help="all devices on this node (default: every GPU, else 2 CPU)"
)
parser.add_argument("--devices-per-replica", type=int, default=2, help="devices one model is split over")
parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step in the pipeline")
parser.add_argument("--balance", default="time", help="time, memory, params, or stage sizes like 4,5")
parser.add_argument("--out-dir", default="runs/model_split", help="where Lightning writes its logs")


class SplitRegression(L.LightningModule):
    def __init__(self, width: int, train_set: TensorDataset, batch_size: int, lr: float, momentum: float) -> None:
        super().__init__()
        # One nn.Sequential holding both parts' layers, in order: the strategy splits it.
        self.layers = nn.Sequential(*ModelPart1(width).layers, *ModelPart2(width).layers)
        self.train_set = train_set
        self.batch_size = batch_size
        self.lr = lr
        self.momentum = momentum
        self.loss_fn = nn.MSELoss()
        self.losses: list[float] = []
        self.example_input_array = train_set.tensors[0][:batch_size]  # what the strategy measures the layers on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def train_dataloader(self) -> DataLoader:
        # The plain loop's order (Lightning's automatic sampler would shuffle; it is off):
        # replica r of n reads samples r, r+n, ..., so together they read the plain batch.
        sampler = DistributedSampler(
            self.train_set, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def on_train_start(self) -> None:
        self.start_time = time.perf_counter()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.loss_fn(self(inputs), targets)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        self.losses.append(loss.item())
        return loss

    def on_train_end(self) -> None:
        self.train_seconds = time.perf_counter() - self.start_time


def main() -> None:
    args = parser.parse_args()
    L.seed_everything(args.seed, verbose=False)
    gpus = torch.cuda.device_count()
    accelerator = args.accelerator if args.accelerator != "auto" else ("gpu" if gpus >= 2 else "cpu")
    devices = args.devices or (gpus if accelerator == "gpu" else 2)
    balance = [int(size) for size in args.balance.split(",")] if "," in args.balance else args.balance

    train_set = make_data(args.num_samples, args.seed)
    torch.manual_seed(args.seed)  # the plain loop seeds right before building its parts
    lightning_module = SplitRegression(args.width, train_set, args.batch_size, args.lr, args.momentum)

    strategy = HybridParallelStrategy(
        devices_per_replica=args.devices_per_replica, balance=balance, microbatches=args.microbatches
    )
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_epochs=args.epochs,
        use_distributed_sampler=False,  # keep the plain loop's order: see train_dataloader
        logger=CSVLogger(args.out_dir),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(lightning_module)
    if trainer.global_rank != 0:
        return

    plan = strategy.plan
    run = Table(title="Run")
    run.add_column("quantity")
    run.add_column("value", justify="right")
    run.add_row("optimizer steps", str(trainer.global_step))
    run.add_row(
        "global batch", f"{args.batch_size * trainer.world_size} ({trainer.world_size} replica(s) x {args.batch_size})"
    )
    run.add_row(
        "samples/s",
        f"{trainer.global_step * args.batch_size * trainer.world_size / lightning_module.train_seconds:,.0f}",
    )
    run.add_row("train loss (last epoch)", f"{trainer.callback_metrics['train_loss'].item():.5f}")
    run.add_row("placement", plan.summary_line() if plan else "one device per replica")
    Console().print(run)

    if args.record:
        parameters = [p.detach().cpu() for p in lightning_module.layers.parameters()]
        torch.save(
            {"losses": lightning_module.losses, "parameters": parameters, "world_size": trainer.world_size}, args.record
        )


if __name__ == "__main__":
    main()
