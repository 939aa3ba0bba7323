"""A ``lightning-mgpu tune`` target for the tests: ``tests/scripts/tune_target.py:make_module``.

A ~2 MiB MLP (8 hidden 256 x 256 layers) and its synthetic data: with candidate sizes
0.25 and 1 MiB and DDP's default there are three distinct bucket layouts.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.scripts.models import MLPRegressor


def make_module() -> tuple[L.LightningModule, DataLoader]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=generator)
    model = MLPRegressor(width=256, depth=8, lr=0.01, record_losses=False)  # the tuner times its steps
    return model, DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8)


def not_a_module() -> int:
    return 3
