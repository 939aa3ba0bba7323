"""Reentrant activation checkpointing under DDP on 2 CPU ranks: the error, and the two fixes, in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/scripts/reentrant_fit.py --out-dir OUT

Four short fits of the same seeded model, one after another in the same processes (torchrun
starts them, so every ``Trainer`` shares one process group), with ``ddp_tuned``:

  failing         checkpoint(..., use_reentrant=True) with find_unused_parameters=True
  static_graph    the same with static_graph=True
  non_reentrant   find_unused_parameters=True with checkpoint(..., use_reentrant=False)
  baseline        use_reentrant=True with find_unused_parameters=False (nothing for DDP to search)

Each rank writes ``OUT/rank<r>.json``: per fit the error it ended with (type, message, and its
``__cause__``'s), or the final parameters, flattened.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import TunedDDPStrategy

FITS: dict[str, tuple[dict[str, Any], bool]] = {
    # name: (strategy arguments, use_reentrant)
    "failing": ({"find_unused_parameters": True}, True),
    "static_graph": ({"find_unused_parameters": True, "static_graph": True}, True),
    "non_reentrant": ({"find_unused_parameters": True}, False),
    "baseline": ({}, True),
}


class CheckpointedNet(L.LightningModule):
    """``a`` -> checkpointed ``b`` -> ``c``, trained with SGD on MSE."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.use_reentrant = use_reentrant

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = torch.tanh(self.a(x))
        hidden = checkpoint(self._middle, hidden, use_reentrant=self.use_reentrant)
        return nn.functional.mse_loss(self.c(hidden), y)

    def _middle(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(hidden))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(strategy_kwargs: dict[str, Any], use_reentrant: bool) -> dict[str, Any]:
    L.seed_everything(3, verbose=False)
    x = torch.randn(64, 8)
    y = x[:, :1] * 2
    model = CheckpointedNet(use_reentrant)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TunedDDPStrategy(**strategy_kwargs),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    except RuntimeError as error:
        cause = error.__cause__
        return {
            "error_type": type(error).__name__,
            "error": str(error),
            "cause_type": None if cause is None else type(cause).__name__,
            "cause": None if cause is None else str(cause),
        }
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {name: fit(kwargs, reentrant) for name, (kwargs, reentrant) in FITS.items()}
    rank = int(os.environ["RANK"])
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
