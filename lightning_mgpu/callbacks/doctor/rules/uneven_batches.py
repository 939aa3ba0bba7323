"""``uneven-batches``: ranks with different numbers of training batches (the classic hang at an epoch's end).

The batch counts also decide which checks are made at all: once they differ, a check past the
shortest rank's last batch would wait for ranks that are elsewhere (:meth:`UnevenBatches.may_check`),
so they are compared whether or not the rule is enabled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import lightning as L

from lightning_mgpu.callbacks.doctor.findings import Finding
from lightning_mgpu.callbacks.doctor.rule import Check, CheckKind, Rule, Watch

RULE = Rule(
    "uneven-batches",
    catches="ranks with different numbers of training batches (the classic hang or crash at the end of an epoch)",
    detection="each rank's number of batches this epoch, compared at every epoch start, before the first step; "
    "the run stops there unless stop_on_fatal=False (only a warning when max_steps ends the fit before the "
    "shortest rank runs out)",
    cost="one small exchange per epoch",
    fix="give every rank the same number of batches: DistributedSampler pads (drop_last=False) or trims "
    "(drop_last=True) the shards to equal length; split your own shards evenly",
    severity="fatal",
)


def check_batch_counts(counts: Sequence[float], epoch: int, batches_left: float = math.inf) -> Optional[Finding]:
    """``counts[r]``: rank ``r``'s training batches this epoch (inf: unknown); ``batches_left``: batches until
    the fit ends (``max_steps``), inf without a limit. Fatal only when the fit would run past the shortest
    rank's last batch."""
    finite = [c for c in counts if c is not None and math.isfinite(c)]
    if len(finite) != len(counts) or len(set(finite)) <= 1:
        return None
    low = int(min(finite))
    per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(finite))
    fix = RULE.fix + f"; or stop every rank at the shortest: Trainer(limit_train_batches={low})"
    seen = f"epoch {epoch} has different numbers of training batches per rank ({per_rank})"
    if batches_left <= low:
        return RULE.finding(
            seen=seen + f"; this fit ends (max_steps) after {int(batches_left)} more batch(es), before the shortest "
            "rank runs out",
            why="this run ends before the ranks fall out of step, but a longer one (more steps, another epoch) hangs "
            "or fails at the shortest rank's last batch",
            fix=fix,
            severity="wrong",  # not this run's crash: it goes on
        )
    return RULE.finding(
        seen=seen,
        why=f"after batch {low} the ranks with {low} batches end the epoch while the others run one more step: "
        "from then on the ranks' collectives no longer pair up, and the job hangs until the collective timeout "
        "(30 minutes by default) or fails when a rank exits",
        fix=fix,
    )


def batches_left(trainer: L.Trainer) -> float:
    """Training batches until ``max_steps`` ends the fit (inf: no such limit)."""
    if trainer.max_steps is None or trainer.max_steps < 0:
        return math.inf
    return float(max(0, trainer.max_steps - trainer.global_step) * max(1, trainer.accumulate_grad_batches))


class UnevenBatches(Watch):
    """Sends (batches this epoch, batches until ``max_steps``) at every epoch start."""

    rules = (RULE,)

    def reset(self) -> None:
        super().reset()
        self.epoch_batch_limit: Optional[float] = None
        """The shortest rank's batch count this epoch when the ranks' counts differ: past it the other
        ranks would not join a check."""
        self.out_of_step_epoch: Optional[int] = None
        """The epoch whose batch counts differ across ranks: from its shortest rank's last batch on, the ranks
        are out of step for the rest of the fit, and no check is made."""

    def may_check(self, epoch: int, batch_idx: Optional[int] = None, *, during: bool = False) -> bool:
        """Once an epoch's batch counts differ, the ranks meet only within the shortest rank's batches (and
        not after its last one): past it the shorter ranks go on without the others (into the next epoch,
        or the end of the fit) and would wait at a check the others never reach."""
        if self.out_of_step_epoch is None:
            return True
        limit = self.epoch_batch_limit
        if batch_idx is None or epoch != self.out_of_step_epoch or limit is None:
            return False
        return batch_idx < limit if during else batch_idx + 1 < limit

    def out_of_step(self) -> Optional[str]:
        if self.out_of_step_epoch is None:
            return None
        return (
            f"no check after epoch {self.out_of_step_epoch}'s batch {int(self.epoch_batch_limit or 0)}: the ranks "
            "ran different numbers of batches"
        )

    def report(self, trainer: L.Trainer, kind: CheckKind) -> Any:
        return (float(trainer.num_training_batches), batches_left(trainer)) if kind == "epoch_start" else None

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        if reports[0] is None:
            return
        counts, left = [float(count) for count, _ in reports], reports[0][1]
        finding = check_batch_counts(counts, check.epoch, left)
        # Unless the fit ends before the shortest rank's last batch: then they never fall out of step.
        reached = finding is not None and min(counts) < left
        self.epoch_batch_limit = min(counts) if reached else None
        if reached:
            self.out_of_step_epoch = check.epoch
        yield finding
