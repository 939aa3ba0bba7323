"""Image classifier as a LightningModule, trained on every device with ``strategy="ddp_tuned"``.

The same run as ``train_plain.py`` (a small CNN on synthetic 3x16x16 images, 10 classes,
SGD with momentum), step for step, on any number of processes; compare them with

    diff recipes/image_classifier/train_plain.py recipes/image_classifier/train_lightning.py

What the conversion from ``nn.DataParallel`` to DDP changes, and the traps it avoids:

* Batch size. DataParallel's batch is the global one, split over the GPUs; a DataLoader
  under DDP feeds one process. ``--batch-size`` stays the global batch here and each
  process loads ``batch_size // processes`` of it (an error says so if it does not split).
* Sample order. Lightning's automatic distributed sampler would reshuffle with its own
  seed. Here ``use_distributed_sampler=False`` and the plain loop's seeded
  ``RandomSampler`` is dealt out over the processes by ``DistributedSamplerWrapper``:
  every step the processes together read the plain loop's batch, epoch after epoch.
* Metrics. Each process sees only its share of the images: its own accuracy is not the
  accuracy. torchmetrics all-gathers the counts when the epoch's value is computed, and
  the validation set must split evenly over the processes (``DistributedSampler`` would
  pad it with repeated images, counted twice).

Run:

    python recipes/image_classifier/train_lightning.py                        # CPU: 2 processes (gloo)
    python recipes/image_classifier/train_lightning.py --accelerator gpu --devices 1
    python recipes/image_classifier/train_lightning.py --accelerator gpu --devices 8
    # 2 nodes x 4 GPUs, started by torchrun on every node (Lightning reads its environment):
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        recipes/image_classifier/train_lightning.py --devices 4 --num-nodes 2
    # the same under SLURM (Lightning detects SLURM itself):
    srun --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 \\
        python recipes/image_classifier/train_lightning.py --devices 4 --num-nodes 2

Add ``--wandb`` to log to Weights & Biases (offline unless ``WANDB_MODE=online``).
"""

from __future__ import annotations

import argparse
import os
import time

import lightning as L
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_mgpu import DistributedDoctor  # importing lightning_mgpu registers strategy="ddp_tuned"

NUM_CLASSES = 10

# -----------------------------------------------------------------------------
# Settings
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seed", type=int, default=0, help="seeds the data, the sample order and the initial weights")
parser.add_argument("--train-size", type=int, default=2048, help="training images")
parser.add_argument("--val-size", type=int, default=512, help="validation images")
parser.add_argument("--noise", type=float, default=3.0, help="noise std over class patterns of std 1")
# As with DataParallel, --batch-size is the global batch: each process loads its share.
parser.add_argument("--batch-size", type=int, default=64, help="images per optimizer step, all processes together")
parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
parser.add_argument("--record", default=None, help="save per-step losses and final weights here (for the tests)")
parser.add_argument("--accelerator", default="auto", help="cpu, gpu, ... (auto: the GPUs if there are any)")
parser.add_argument("--devices", type=int, default=torch.cuda.device_count() or 2, help="processes per node")
parser.add_argument("--num-nodes", type=int, default=1, help="machines (with torchrun or SLURM)")
parser.add_argument("--out-dir", default="runs/image_classifier", help="where Lightning writes its logs")
parser.add_argument("--wandb", action="store_true", help="log to Weights & Biases instead of CSV files")
parser.add_argument(
    "--doctor",
    action="store_true",
    help="check for the classic multi-GPU mistakes while training (DistributedDoctor(strict=True): stops on a finding)",
)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16x16 -> 8x8
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Linear(32 * 4 * 4, NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def make_images(num_images: int, patterns: torch.Tensor, noise: float, generator: torch.Generator) -> TensorDataset:
    labels = torch.randint(0, NUM_CLASSES, (num_images,), generator=generator)
    images = patterns[labels] + noise * torch.randn(num_images, 3, 16, 16, generator=generator)
    return TensorDataset(images, labels)


class ImageClassifier(L.LightningModule):
    def __init__(
        self,
        model: nn.Module,
        train_set: TensorDataset,
        val_set: TensorDataset,
        *,
        seed: int,
        batch_size: int,
        lr: float,
    ) -> None:
        super().__init__()
        self.model = model
        self.train_set = train_set
        self.val_set = val_set
        self.seed = seed
        self.batch_size = batch_size
        self.lr = lr
        self.loss_fn = nn.CrossEntropyLoss()
        # average="micro": the fraction of images classified right (the default, "macro",
        # averages per-class accuracies instead).
        self.train_accuracy = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
        self.val_accuracy = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
        self.losses: list[float] = []

    def setup(self, stage: str) -> None:
        world_size = self.trainer.world_size
        if self.batch_size % world_size:
            raise ValueError(
                f"--batch-size {self.batch_size} is the global batch (as with DataParallel) and must split evenly "
                f"over the {world_size} processes: use a multiple of {world_size}, e.g. "
                f"--batch-size {max(1, round(self.batch_size / world_size)) * world_size}."
            )
        # DistributedSampler pads a data set that does not split evenly with repeated
        # samples: they would be trained on twice and counted twice in the accuracy.
        for flag, dataset in (("--train-size", self.train_set), ("--val-size", self.val_set)):
            if len(dataset) % world_size:
                raise ValueError(
                    f"{flag} {len(dataset)} does not split evenly over the {world_size} processes: "
                    f"use a multiple of {world_size}, e.g. {flag} {max(1, len(dataset) // world_size) * world_size}."
                )
        self.per_process_batch_size = self.batch_size // world_size

    def train_dataloader(self) -> DataLoader:
        # The plain loop's seeded order (the sampler owns the generator, as there), dealt
        # out round-robin: rank r of n reads positions r, r+n, r+2n, ... of it, so at every
        # step the n processes together read exactly the batch of the one-process loop.
        # shuffle=False: the RandomSampler already reshuffles every epoch. (Lightning's
        # automatic sampler would reshuffle with its own seed: use_distributed_sampler=False.)
        order = RandomSampler(self.train_set, generator=torch.Generator().manual_seed(self.seed))
        sampler = DistributedSamplerWrapper(
            order, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(self.train_set, batch_size=self.per_process_batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(
            self.val_set, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(self.val_set, batch_size=self.per_process_batch_size, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)

    def on_train_start(self) -> None:
        self.start_time = time.perf_counter()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self.model(images)
        loss = self.loss_fn(logits, labels)
        self.train_accuracy.update(logits, labels)
        # Epoch values over every process: sync_dist all-reduces the mean loss once per
        # epoch, torchmetrics gathers the accuracy's counts when it is computed.
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        self.log("train_acc", self.train_accuracy, on_step=False, on_epoch=True, prog_bar=True)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.val_accuracy.update(self.model(images), labels)
        self.log("val_acc", self.val_accuracy, on_epoch=True, prog_bar=True)

    def on_train_end(self) -> None:
        self.train_seconds = time.perf_counter() - self.start_time


def main() -> None:
    args = parser.parse_args()
    L.seed_everything(args.seed, verbose=False)

    # -------------------------------------------------------------------------
    # Data, from its own generator so that it never depends on what else consumed
    # torch's global random numbers. Every process makes the same images; the
    # dataloaders (in ImageClassifier) give each process its share.
    data_generator = torch.Generator().manual_seed(args.seed)
    class_patterns = torch.randn(NUM_CLASSES, 3, 16, 16, generator=data_generator)
    train_set = make_images(args.train_size, class_patterns, args.noise, data_generator)
    val_set = make_images(args.val_size, class_patterns, args.noise, data_generator)

    # -------------------------------------------------------------------------
    # Model
    model = ConvNet()
    lightning_module = ImageClassifier(
        model, train_set, val_set, seed=args.seed, batch_size=args.batch_size, lr=args.lr
    )

    # -------------------------------------------------------------------------
    # Training
    logger: Logger = CSVLogger(args.out_dir)
    if args.wandb:
        offline = os.environ.get("WANDB_MODE", "offline") != "online"
        logger = WandbLogger(project="lightning_mgpu", save_dir=args.out_dir, offline=offline)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp_tuned",
        max_epochs=args.epochs,
        use_distributed_sampler=False,  # keep the plain loop's order: see train_dataloader
        logger=logger,
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
    metrics = {name: value.item() for name, value in trainer.callback_metrics.items()}
    run = Table(title="Run")
    run.add_column("quantity")
    run.add_column("value", justify="right")
    run.add_row("optimizer steps", str(trainer.global_step))
    run.add_row("global batch", f"{args.batch_size} ({trainer.world_size} x {lightning_module.per_process_batch_size})")
    samples_per_second = args.epochs * args.train_size / lightning_module.train_seconds
    run.add_row("samples/s (incl. validation)", f"{samples_per_second:,.0f}")
    run.add_row("train loss (last epoch)", f"{metrics['train_loss']:.4f}")
    run.add_row("train accuracy (last epoch)", f"{metrics['train_acc']:.3f}")
    run.add_row("val accuracy", f"{metrics['val_acc']:.3f}  (chance: {1 / NUM_CLASSES:.3f})")
    run.add_row("strategy", f"{type(trainer.strategy).__name__}, {trainer.world_size} processes")
    run.add_row("device", str(trainer.strategy.root_device))
    Console().print(run)

    if args.record:
        state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        record = {"losses": lightning_module.losses, "state_dict": state_dict, "world_size": trainer.world_size}
        torch.save({**record, "val_acc": metrics["val_acc"]}, args.record)


if __name__ == "__main__":
    main()
