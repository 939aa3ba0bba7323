"""``dataparallel-wrapped``: a module still wrapped in ``nn.DataParallel`` inside the LightningModule."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import lightning as L
from torch import nn

from lightning_mgpu.callbacks.doctor.findings import Finding, name_list
from lightning_mgpu.callbacks.doctor.rule import Check, Rule, Watch

RULE = Rule(
    "dataparallel-wrapped",
    catches="a module still wrapped in nn.DataParallel (or DistributedDataParallel) inside the LightningModule",
    detection="at fit start: isinstance over the LightningModule's submodules",
    cost="none (once)",
    fix="remove the wrapper and let the strategy replicate the model (strategy='ddp_tuned': one process per device)",
    severity="wasteful",
)


def wrapped_modules(pl_module: nn.Module) -> list[str]:
    """``"DataParallel at 'net'"`` per wrapped submodule."""
    found = []
    for name, module in pl_module.named_modules():
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            found.append(f"{type(module).__name__} at '{name or 'self'}'")
    return found


def check_dataparallel(wrapped: Sequence[str]) -> Optional[Finding]:
    if not wrapped:
        return None
    return RULE.finding(
        seen=f"the LightningModule holds {name_list(list(wrapped))}",
        why="nn.DataParallel runs in one process and copies the model to every GPU at every step; under a DDP "
        "strategy each process would do so again over the GPUs it sees (or wrap twice): slow at best, wrong "
        "device placement at worst",
        fix="build the plain module (drop nn.DataParallel(...)/DistributedDataParallel(...)) and let the strategy "
        "replicate it: Trainer(strategy='ddp_tuned', devices=N)",
    )


class DataParallelWrapped(Watch):
    rules = (RULE,)

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.setup = wrapped_modules(pl_module)

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        if check.first:
            yield check_dataparallel(self.setups[0])
