"""Linear regression with a plain PyTorch loop: the starting point of the Lightning recipe.

This is the loop most tutorials start from: ``nn.Linear(10, 1)`` fitted with SGD and
``nn.MSELoss`` on synthetic data ``y = X @ w_true + b_true + noise``, read in order by a
``DataLoader`` that does NOT shuffle. ``train_lightning.py`` is the same run as a
``LightningModule``; compare them with

    diff recipes/regression/train_plain.py recipes/regression/train_lightning.py

Run (one process; it uses the first GPU if there is one, else the CPU):

    python recipes/regression/train_plain.py
    CUDA_VISIBLE_DEVICES=0 python recipes/regression/train_plain.py

This loop runs in one process only: more GPUs, ``torchrun`` across nodes and SLURM are
what ``train_lightning.py`` adds (see its docstring for those commands).
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
# 1024 = 32 steps of 32 samples: every batch is full, and split over 2 processes each
# step still covers exactly the samples of the one-process step.
parser.add_argument("--num-samples", type=int, default=1024, help="size of the synthetic data set")
parser.add_argument("--batch-size", type=int, default=32, help="samples per optimizer step")
parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
parser.add_argument("--epochs", type=int, default=10, help="passes over the data set")
parser.add_argument("--record", default=None, help="save per-step losses and final weights here (for the tests)")


def main() -> None:
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # -------------------------------------------------------------------------
    # Data: y = X @ w_true + b_true + noise, from its own generator so that it never
    # depends on what else consumed torch's global random numbers.
    data_generator = torch.Generator().manual_seed(args.seed)
    true_weight = torch.randn(10, 1, generator=data_generator)
    true_bias = 0.5
    X = torch.randn(args.num_samples, 10, generator=data_generator)
    y = X @ true_weight + true_bias + 0.1 * torch.randn(args.num_samples, 1, generator=data_generator)
    train_set = TensorDataset(X, y)
    train_loader = DataLoader(train_set, batch_size=args.batch_size)  # no shuffle: samples 0..31, 32..63, ...

    # -------------------------------------------------------------------------
    # Model
    torch.manual_seed(args.seed)
    model = nn.Linear(10, 1).to(device)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    # -------------------------------------------------------------------------
    # Training
    losses: list[float] = []
    start_time = time.perf_counter()
    for epoch in range(args.epochs):
        for inputs, targets in train_loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        epoch_loss = sum(losses[-len(train_loader) :]) / len(train_loader)
        print(f"epoch {epoch + 1}/{args.epochs}  train_loss {epoch_loss:.4f}")
    train_seconds = time.perf_counter() - start_time

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
    run.add_row("optimizer steps", str(len(losses)))
    run.add_row("global batch", f"{args.batch_size} (1 process)")
    run.add_row("samples/s", f"{len(losses) * args.batch_size / train_seconds:,.0f}")
    run.add_row("train loss (last epoch)", f"{epoch_loss:.5f}")
    run.add_row("device", str(device))
    console = Console()
    console.print(weights)
    console.print(run)

    if args.record:
        state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        record = {"losses": losses, "state_dict": state_dict, "world_size": 1}
        torch.save(record, args.record)


if __name__ == "__main__":
    main()
