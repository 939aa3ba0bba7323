"""Linear regression as a LightningModule, trained on every device with ``strategy="ddp_tuned"``.

The same run as ``train_plain.py`` (``nn.Linear(10, 1)``, SGD, ``nn.MSELoss`` on
``y = X @ w_true + b_true + noise``), step for step; compare them with

    diff recipes/regression/train_plain.py recipes/regression/train_lightning.py

The trap: the plain loop read its samples in order (no shuffle), but Lightning's automatic
distributed sampler *always* shuffles the training set, even on one device, as soon as the
strategy is a DDP one. Here ``Trainer(use_distributed_sampler=False)`` turns it off and
``train_dataloader`` shards the plain loop's order itself with
``DistributedSampler(shuffle=False)``.

``--batch-size`` is per process, as for any DataLoader under DDP: the global batch is
``batch_size x processes``. To reproduce the plain run exactly on 2 processes, give each
half of it: ``--devices 2 --batch-size 16``.

Run:

    python recipes/regression/train_lightning.py                        # CPU: 2 processes (gloo)
    python recipes/regression/train_lightning.py --accelerator gpu --devices 1
    python recipes/regression/train_lightning.py --accelerator gpu --devices 8
    # 2 nodes x 4 GPUs, started by torchrun on every node (Lightning reads its environment):
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        recipes/regression/train_lightning.py --devices 4 --num-nodes 2
    # the same under SLURM (Lightning detects SLURM itself):
    srun --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 \\
        python recipes/regression/train_lightning.py --devices 4 --num-nodes 2
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

from lightning_mgpu import DistributedDoctor  # importing lightning_mgpu registers strategy="ddp_tuned"

# -----------------------------------------------------------------------------
# Settings
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seed", type=int, default=0, help="seeds the data and the model's initial weights")
# 1024 = 32 steps of 32 samples: every batch is full, and split over 2 processes each
# step still covers exactly the samples of the one-process step.
parser.add_argument("--num-samples", type=int, default=1024, help="size of the synthetic data set")
parser.add_argument("--batch-size", type=int, default=32, help="samples per optimizer step, per process")
parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
parser.add_argument("--epochs", type=int, default=10, help="passes over the data set")
parser.add_argument("--record", default=None, help="save per-step losses and final weights here (for the tests)")
parser.add_argument("--accelerator", default="auto", help="cpu, gpu, ... (auto: the GPUs if there are any)")
parser.add_argument("--devices", type=int, default=torch.cuda.device_count() or 2, help="processes per node")
parser.add_argument("--num-nodes", type=int, default=1, help="machines (with torchrun or SLURM)")
parser.add_argument("--out-dir", default="runs/regression", help="where Lightning writes its logs")
parser.add_argument(
    "--doctor",
    action="store_true",
    help="check for the classic multi-GPU mistakes while training (DistributedDoctor(strict=True): stops on a finding)",
)


class LinearRegression(L.LightningModule):
    def __init__(self, model: nn.Module, train_set: TensorDataset, batch_size: int, lr: float) -> None:
        super().__init__()
        self.model = model
        self.train_set = train_set
        self.batch_size = batch_size
        self.lr = lr
        self.loss_fn = nn.MSELoss()
        self.losses: list[float] = []

    def train_dataloader(self) -> DataLoader:
        # Lightning's automatic sampler would shuffle (it is off: use_distributed_sampler=False).
        # Rank r of n reads samples r, r+n, r+2n, ...: at every step the n processes
        # together read exactly the batch of the one-process loop.
        sampler = DistributedSampler(
            self.train_set, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def on_train_start(self) -> None:
        self.start_time = time.perf_counter()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.loss_fn(self.model(inputs), targets)
        # Epoch mean over every process; a per-step sync_dist would all-reduce at every step.
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        self.losses.append(loss.item())
        return loss

    def on_train_end(self) -> None:
        self.train_seconds = time.perf_counter() - self.start_time


def main() -> None:
    args = parser.parse_args()
    L.seed_everything(args.seed, verbose=False)

    # -------------------------------------------------------------------------
    # Data: y = X @ w_true + b_true + noise, from its own generator so that it never
    # depends on what else consumed torch's global random numbers.
    data_generator = torch.Generator().manual_seed(args.seed)
    true_weight = torch.randn(10, 1, generator=data_generator)
    true_bias = 0.5
    X = torch.randn(args.num_samples, 10, generator=data_generator)
    y = X @ true_weight + true_bias + 0.1 * torch.randn(args.num_samples, 1, generator=data_generator)
    train_set = TensorDataset(X, y)

    # -------------------------------------------------------------------------
    # Model
    model = nn.Linear(10, 1)
    lightning_module = LinearRegression(model, train_set, args.batch_size, args.lr)

    # -------------------------------------------------------------------------
    # Training
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp_tuned",
        max_epochs=args.epochs,
        use_distributed_sampler=False,  # keep the plain loop's order: see train_dataloader
        logger=CSVLogger(args.out_dir),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[DistributedDoctor(strict=True)] if args.doctor else [],
    )
    trainer.fit(lightning_module)
    if trainer.global_rank != 0:
        return

    # -------------------------------------------------------------------------
    # Summary
    learned_weight = model.weight.detach().cpu().flatten()
    weights = Table(title="Learned vs true parameters")
    for column in ("parameter", "true", "learned"):
        weights.add_column(column, justify="right")
    for i in range(10):
        weights.add_row(f"w[{i}]", f"{true_weight[i, 0]:+.4f}", f"{learned_weight[i]:+.4f}")
    weights.add_row("b", f"{true_bias:+.4f}", f"{model.bias.item():+.4f}")
    run = Table(title="Run")
    run.add_column("quantity")
    run.add_column("value", justify="right")
    run.add_row("optimizer steps", str(trainer.global_step))
    run.add_row("global batch", f"{args.batch_size * trainer.world_size} ({trainer.world_size} x {args.batch_size})")
    samples_per_second = trainer.global_step * args.batch_size * trainer.world_size / lightning_module.train_seconds
    run.add_row("samples/s", f"{samples_per_second:,.0f}")
    run.add_row("train loss (last epoch)", f"{trainer.callback_metrics['train_loss'].item():.5f}")
    run.add_row("strategy", f"{type(trainer.strategy).__name__}, {trainer.world_size} processes")
    run.add_row("device", str(trainer.strategy.root_device))
    console = Console()
    console.print(weights)
    console.print(run)

    if args.record:
        state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        record = {"losses": lightning_module.losses, "state_dict": state_dict, "world_size": trainer.world_size}
        torch.save(record, args.record)


if __name__ == "__main__":
    main()
