"""``unsynced-logging``: epoch metrics logged from every rank without ``sync_dist`` (the logger keeps rank 0's)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import lightning as L

from lightning_mgpu._compat.lightning import epoch_metrics_logged_without_sync
from lightning_mgpu.callbacks.doctor.findings import Finding, name_list
from lightning_mgpu.callbacks.doctor.rule import Check, CheckKind, Rule, Watch

RULE = Rule(
    "unsynced-logging",
    catches="epoch metrics logged from every rank without sync_dist: the logger records rank 0's shard only",
    detection="values of self.log(..., on_epoch=True, sync_dist=False) compared across ranks at each check "
    "and at the end of validation",
    cost="one small exchange per check",
    fix="self.log(..., sync_dist=True), or log a torchmetrics Metric (it syncs its state itself)",
    severity="wrong",
)


def check_unsynced_metrics(values: Sequence[Mapping[str, float]], rtol: float = 1e-6) -> Optional[Finding]:
    if len(values) < 2:
        return None
    common = set(values[0])
    for other in values[1:]:
        common &= set(other)
    differ = []
    for key in sorted(common):
        row = [v[key] for v in values]
        if any(math.isnan(x) for x in row):
            continue
        if max(row) - min(row) > rtol * max(abs(x) for x in row) + 1e-12:
            differ.append(f"{key.split('.', 1)[-1]} ({', '.join(f'{x:.4g}' for x in row)} on ranks 0..{len(row) - 1})")
    if not differ:
        return None
    return RULE.finding(
        seen=f"epoch-level metric(s) logged with sync_dist=False differ across ranks: {name_list(differ, 3)}",
        why="each rank averages only its own shard and the logger keeps rank 0's value: the curve you read is one "
        "shard's, not the data set's",
    )


class UnsyncedLogging(Watch):
    """Sends this rank's value of every epoch metric logged without ``sync_dist`` (the mean so far for mean
    reductions) at periodic checks, validation ends and the end of training."""

    rules = (RULE,)

    def report(self, trainer: L.Trainer, kind: CheckKind) -> Any:
        if kind not in ("periodic", "validation_end", "train_end"):
            return None
        if not self.doctor.enabled(RULE.id):
            return {}
        values = epoch_metrics_logged_without_sync(trainer)
        if values is None:
            self.doctor.cannot_check(RULE.id, "the logged metrics' sync_dist options cannot be read")
            return {}
        return values

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        if reports[0] is not None and len(reports) > 1:
            yield check_unsynced_metrics([values or {} for values in reports])
