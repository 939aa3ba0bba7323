"""A model split by hand over two devices: the starting point of the hybrid-strategy recipe.

The classic way to train a model that does not fit one GPU: cut it in two modules,
``ModelPart1`` on the first device and ``ModelPart2`` on the second, and move the
activation between them with ``.to(...)`` in the training loop. It works, but at any
moment one device computes while the other waits, and the cut is wherever the author
guessed. ``train_lightning.py`` is the same run as a ``LightningModule`` with
``HybridParallelStrategy``: the cut is chosen by measuring, the batch runs as
micro-batches so both devices work at once, and DDP can run several such replicas.

    diff recipes/model_split/train_plain.py recipes/model_split/train_lightning.py

Run (two GPUs if there are; otherwise both "devices" are the CPU and the loop still runs):

    python recipes/model_split/train_plain.py

Data: a synthetic regression target (a fixed random two-layer network of the input plus
noise), read in order (no shuffle) so that the Lightning script can read the same batches.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# -----------------------------------------------------------------------------
# Settings
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seed", type=int, default=0, help="seeds the data and the model's initial weights")
parser.add_argument("--num-samples", type=int, default=2048, help="size of the synthetic data set")
parser.add_argument("--width", type=int, default=128, help="hidden width of the model")
parser.add_argument("--batch-size", type=int, default=64, help="samples per optimizer step")
parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--epochs", type=int, default=5, help="passes over the data set")
parser.add_argument("--record", default=None, help="save per-step losses and final weights here (for the tests)")


class ModelPart1(nn.Module):
    """The first half of the network: lives on device0."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ModelPart2(nn.Module):
    """The second half: lives on device1."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def make_data(num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(num_samples, 16, generator=generator)
    teacher_1 = torch.randn(16, 32, generator=generator) / 4
    teacher_2 = torch.randn(32, 1, generator=generator) / 4
    y = torch.tanh(X @ teacher_1) @ teacher_2 + 0.01 * torch.randn(num_samples, 1, generator=generator)
    return TensorDataset(X, y)


def main() -> None:
    args = parser.parse_args()
    two_gpus = torch.cuda.device_count() >= 2
    device0 = torch.device("cuda:0" if two_gpus else "cpu")
    device1 = torch.device("cuda:1" if two_gpus else "cpu")

    # -------------------------------------------------------------------------
    # Data
    train_loader = DataLoader(make_data(args.num_samples, args.seed), batch_size=args.batch_size)  # in order

    # -------------------------------------------------------------------------
    # Model, split by hand
    torch.manual_seed(args.seed)
    model_part1 = ModelPart1(args.width).to(device0)
    model_part2 = ModelPart2(args.width).to(device1)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(
        [*model_part1.parameters(), *model_part2.parameters()], lr=args.lr, momentum=args.momentum
    )

    # -------------------------------------------------------------------------
    # Training
    losses: list[float] = []
    start_time = time.perf_counter()
    for epoch in range(args.epochs):
        for inputs, targets in train_loader:
            inputs, targets = inputs.to(device0), targets.to(device1)
            optimizer.zero_grad()
            hidden = model_part1(inputs)
            hidden = hidden.to(device1)  # transfer the activation between the devices
            loss = loss_fn(model_part2(hidden), targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        epoch_loss = sum(losses[-len(train_loader) :]) / len(train_loader)
        print(f"epoch {epoch + 1}/{args.epochs}  train_loss {epoch_loss:.5f}")
    train_seconds = time.perf_counter() - start_time

    # -------------------------------------------------------------------------
    # Summary
    run = Table(title="Run")
    run.add_column("quantity")
    run.add_column("value", justify="right")
    run.add_row("optimizer steps", str(len(losses)))
    run.add_row("batch", f"{args.batch_size} (1 process)")
    run.add_row("samples/s", f"{len(losses) * args.batch_size / train_seconds:,.0f}")
    run.add_row("train loss (first step / last epoch)", f"{losses[0]:.5f} / {epoch_loss:.5f}")
    run.add_row("devices", f"ModelPart1 on {device0}, ModelPart2 on {device1}")
    Console().print(run)

    if args.record:
        # The layers in order, as one flat list: the same order as the Lightning model's `layers`.
        parameters = [p.detach().cpu() for p in [*model_part1.parameters(), *model_part2.parameters()]]
        torch.save({"losses": losses, "parameters": parameters, "world_size": 1}, args.record)


if __name__ == "__main__":
    main()
