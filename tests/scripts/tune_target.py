"""A ``lightning-mgpu tune`` target for the tests: ``tests/scripts/tune_target.py:make_module``.

A ~2 MiB MLP (8 hidden 256 x 256 layers) and its synthetic data: with candidate sizes
0.25 and 1 MiB and DDP's default there are three distinct bucket layouts.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(32, 256), nn.Tanh()]
        for _ in range(8):
            layers += [nn.Linear(256, 256), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(256, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def make_module() -> tuple[L.LightningModule, DataLoader]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=generator)
    return MLP(), DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8)


def not_a_module() -> int:
    return 3
