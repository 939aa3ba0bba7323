"""Image classifier with ``nn.DataParallel``: the starting point of the Lightning recipe.

A small CNN (conv/ReLU/pool, no BatchNorm, no dropout) learns 10 classes of synthetic
3x16x16 images (a fixed random pattern per class under heavy noise, made here, so no
download). The loop is the one most tutorials show: ``model = nn.DataParallel(model)``
when there is more than one GPU, a shuffled ``DataLoader``, and accuracy from torchmetrics.
``train_lightning.py`` is the same run as a ``LightningModule``; compare them with

    diff recipes/image_classifier/train_plain.py recipes/image_classifier/train_lightning.py

Run (one process; DataParallel splits every batch over all visible GPUs, on a CPU it is
not used):

    python recipes/image_classifier/train_plain.py
    CUDA_VISIBLE_DEVICES=0 python recipes/image_classifier/train_plain.py      # one GPU
    CUDA_VISIBLE_DEVICES=0,1,2,3 python recipes/image_classifier/train_plain.py  # 4 GPUs

DataParallel cannot go beyond one machine (no ``torchrun`` across nodes, no SLURM job
over several nodes): that, and DDP's speed, is what ``train_lightning.py`` adds.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

NUM_CLASSES = 10

# -----------------------------------------------------------------------------
# Settings
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seed", type=int, default=0, help="seeds the data, the sample order and the initial weights")
parser.add_argument("--train-size", type=int, default=2048, help="training images")
parser.add_argument("--val-size", type=int, default=512, help="validation images")
parser.add_argument("--noise", type=float, default=3.0, help="noise std over class patterns of std 1")
# DataParallel splits each batch over the GPUs: --batch-size is the global batch.
parser.add_argument("--batch-size", type=int, default=64, help="images per optimizer step, all GPUs together")
parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
parser.add_argument("--record", default=None, help="save per-step losses and final weights here (for the tests)")


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


def main() -> None:
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # -------------------------------------------------------------------------
    # Data, from its own generator so that it never depends on what else consumed
    # torch's global random numbers.
    data_generator = torch.Generator().manual_seed(args.seed)
    class_patterns = torch.randn(NUM_CLASSES, 3, 16, 16, generator=data_generator)
    train_set = make_images(args.train_size, class_patterns, args.noise, data_generator)
    val_set = make_images(args.val_size, class_patterns, args.noise, data_generator)
    # The sampler owns the generator: DataLoader(shuffle=True, generator=g) would also
    # draw a worker seed from g at every epoch, which no other loader reproduces.
    order = RandomSampler(train_set, generator=torch.Generator().manual_seed(args.seed))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=order)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)

    # -------------------------------------------------------------------------
    # Model
    torch.manual_seed(args.seed)
    model: nn.Module = ConvNet()
    if torch.cuda.device_count() > 1:
        print(f"Let's use {torch.cuda.device_count()} GPUs!")
        model = nn.DataParallel(model)
    model.to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # average="micro": the fraction of images classified right (the default, "macro",
    # averages per-class accuracies instead).
    train_accuracy = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro").to(device)
    val_accuracy = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro").to(device)

    # -------------------------------------------------------------------------
    # Training
    losses: list[float] = []
    start_time = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            logits = model(images)
            loss = loss_fn(logits, labels)
            loss.backward()
            optimizer.step()
            train_accuracy.update(logits, labels)
            losses.append(loss.item())

        model.eval()
        with torch.no_grad():
            for images, labels in val_loader:
                images, labels = images.to(device), labels.to(device)
                val_accuracy.update(model(images), labels)

        epoch_loss = sum(losses[-len(train_loader) :]) / len(train_loader)
        train_acc, val_acc = train_accuracy.compute().item(), val_accuracy.compute().item()
        train_accuracy.reset()
        val_accuracy.reset()
        print(
            f"epoch {epoch + 1}/{args.epochs}  train_loss {epoch_loss:.4f}  "
            f"train_acc {train_acc:.3f}  val_acc {val_acc:.3f}"
        )
    train_seconds = time.perf_counter() - start_time

    # -------------------------------------------------------------------------
    # Summary
    num_gpus = torch.cuda.device_count() if isinstance(model, nn.DataParallel) else 1
    run = Table(title="Run")
    run.add_column("quantity")
    run.add_column("value", justify="right")
    run.add_row("optimizer steps", str(len(losses)))
    run.add_row("global batch", f"{args.batch_size} (DataParallel over {num_gpus} device(s))")
    samples_per_second = args.epochs * args.train_size / train_seconds
    run.add_row("samples/s (incl. validation)", f"{samples_per_second:,.0f}")
    run.add_row("train loss (last epoch)", f"{epoch_loss:.4f}")
    run.add_row("train accuracy (last epoch)", f"{train_acc:.3f}")
    run.add_row("val accuracy", f"{val_acc:.3f}  (chance: {1 / NUM_CLASSES:.3f})")
    run.add_row("device", str(device))
    Console().print(run)

    if args.record:
        bare_model = model.module if isinstance(model, nn.DataParallel) else model
        state_dict = {k: v.detach().cpu() for k, v in bare_model.state_dict().items()}
        record = {"losses": losses, "state_dict": state_dict, "world_size": 1}
        torch.save({**record, "val_acc": val_acc}, args.record)


if __name__ == "__main__":
    main()
