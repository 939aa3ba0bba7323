"""``batchnorm-without-sync``: BatchNorm under DDP at a small per-device batch, without SyncBatchNorm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import lightning as L
from torch import nn

from lightning_mgpu._compat.torch import is_batchnorm
from lightning_mgpu.callbacks.doctor.findings import Finding, name_list
from lightning_mgpu.callbacks.doctor.rule import Rule, Watch

RULE = Rule(
    "batchnorm-without-sync",
    catches="BatchNorm under DDP at a small per-device batch, without SyncBatchNorm",
    detection="BatchNorm layers (not SyncBatchNorm) in training mode and a first batch smaller than "
    "batchnorm_min_batch (16)",
    cost="none (once)",
    fix="Trainer(sync_batchnorm=True) (SyncBatchNorm: statistics over the global batch), a larger per-device "
    "batch, or GroupNorm/LayerNorm",
    severity="wrong",
)


def batchnorm_layers(pl_module: nn.Module) -> list[str]:
    """BatchNorm layers (not SyncBatchNorm) in training mode."""
    return [
        name
        for name, module in pl_module.named_modules()
        if is_batchnorm(module) and not isinstance(module, nn.SyncBatchNorm) and module.training
    ]


def batch_size_of(batch: Any) -> Optional[int]:
    """The batch's size as Lightning infers it; None for an opaque batch (no verdict)."""
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - an opaque batch: no verdict
        return None


def check_batchnorm(layers: Sequence[str], batch_size: Optional[int], minimum: int) -> Optional[Finding]:
    if not layers or batch_size is None or batch_size >= minimum:
        return None
    return RULE.finding(
        seen=f"{len(layers)} BatchNorm layer(s) ({name_list(list(layers), 3)}) normalise over a per-device batch of "
        f"{batch_size} (< {minimum}) without SyncBatchNorm",
        why="each rank normalises with the statistics of its own few samples: noisy statistics, worse accuracy, and "
        "running statistics that differ per rank",
    )


class BatchNormWithoutSync(Watch):
    """Judged on each rank, at the fit's first batch."""

    rules = (RULE,)

    def reset(self) -> None:
        super().reset()
        self.layers: list[str] = []
        self.world_size = 1

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.layers, self.world_size = batchnorm_layers(pl_module), trainer.world_size

    def first_batch(self, batch: Any) -> None:
        if self.world_size > 1 and self.doctor.enabled(RULE.id) and self.layers:
            finding = check_batchnorm(self.layers, batch_size_of(batch), self.doctor.batchnorm_min_batch)
            if finding is not None:
                self.local.append(finding)
