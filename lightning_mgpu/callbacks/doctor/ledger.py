"""What every rank holds identically: each check's gathered reports merged, as a :class:`~.protocol.Snapshot`.

Every rank absorbs the same gathered :class:`~.protocol.RankReport` list in the same order, so
every rank's ledger and snapshot are the same. The part later fits and resumed runs need (batch
counter, checks run, rules reported, findings, the last epochs' first-batch hashes, the
parameter-use counts) is checkpointed through :meth:`Ledger.state_dict`. No torch import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from lightning_mgpu.callbacks.doctor.checks import check_batch_counts
from lightning_mgpu.callbacks.doctor.findings import Finding
from lightning_mgpu.callbacks.doctor.protocol import (
    FirstBatches,
    ParamUsage,
    RankReport,
    SamplerInfo,
    SetupInfo,
    Snapshot,
    UsageReport,
)

__all__ = ["STATE_VERSION", "Ledger"]

STATE_VERSION = 1
"""The version of :meth:`Ledger.state_dict`'s layout."""


class Ledger:
    """The doctor's agreed state (identical on every rank)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start afresh (a new fit; checkpoint state, if any, is loaded afterwards)."""
        # Checkpointed.
        self.batches_seen = 0
        self.checks = 0
        self.reported: set[str] = set()
        self.findings: list[Finding] = []
        self.epoch_digests: dict[int, list[Optional[str]]] = {}
        """Epoch -> its first batch's hash per rank (the last two epochs: all a comparison needs)."""
        self.use_counts: list[list[int]] = []
        """Per rank, per parameter: batches of the use window in which it got a gradient."""
        self.use_batches: list[int] = []
        # Agreed for this fit only.
        self.setup_sent = False
        self.setups: list[SetupInfo] = []
        self.samplers: list[SamplerInfo] = []
        self.random_sent = False
        self.epoch_batch_limit: Optional[float] = None
        """The shortest rank's batch count this epoch when the ranks' counts differ: past it the other
        ranks would not join a check."""
        self.out_of_step_epoch: Optional[int] = None
        """The epoch whose batch counts differ across ranks: from its shortest rank's last batch on, the ranks
        are out of step for the rest of the fit, and no check is made."""
        self.unreduced: list[str] = []
        """Parameters without a gradient on some rank under find_unused_parameters=False (their DDP buckets
        were not all-reduced)."""

    # ------------------------------------------------------------------ checks

    def may_check(self, epoch: int, batch_idx: Optional[int] = None, *, during: bool = False) -> bool:
        """Whether every rank is certain to reach a check made now: after training batch ``batch_idx`` of
        ``epoch`` (``during``: within it, e.g. before its backward), or, with ``batch_idx`` None, at an
        epoch's start or end, a validation's end, the end of training.

        Once an epoch's batch counts differ, the ranks meet only within the shortest rank's batches (and
        not after its last one): past it the shorter ranks go on without the others (into the next epoch,
        or the end of the fit) and would wait at a check the others never reach.
        """
        if self.out_of_step_epoch is None:
            return True
        limit = self.epoch_batch_limit
        if batch_idx is None or epoch != self.out_of_step_epoch or limit is None:
            return False
        return batch_idx < limit if during else batch_idx + 1 < limit

    def absorb(
        self,
        reports: Sequence[RankReport],
        *,
        epoch: int,
        tensor_names: list[str],
        buffers_checked: bool,
        param_names: list[str],
        find_unused: bool,
        data_wait_threshold: float,
    ) -> Snapshot:
        """Merge one check's reports (every rank's, by rank) into the ledger; the snapshot the rules judge."""
        self.checks += 1
        first, world = reports[0], len(reports)
        snapshot = Snapshot(
            world_size=world,
            epoch=epoch,
            local_findings=[report.local_findings for report in reports],
            data_wait_threshold=data_wait_threshold,
        )
        if first.setup is not None:
            self.setup_sent = True
            self.setups = [report.setup for report in reports if report.setup is not None]
            snapshot.setups = self.setups
        if first.sampler is not None:
            self.samplers = [report.sampler or {} for report in reports]
        snapshot.samplers = self.samplers
        if first.batches is not None:
            counts = [float(report.batches or 0.0) for report in reports]
            snapshot.batch_counts, snapshot.batches_left = counts, first.batches_left
            # Whether or not the rule is enabled: checks must not wait for ranks that have run out of batches
            # (unless the fit ends before the shortest rank's last batch: then they never do).
            uneven = check_batch_counts(counts, epoch) is not None
            reached = uneven and min(counts) < first.batches_left
            self.epoch_batch_limit = min(counts) if reached else None
            if reached:
                self.out_of_step_epoch = epoch
        if world > 1:
            snapshot.first_batches = self._absorb_digests([report.digests for report in reports])
        if first.random_state_sent:
            self.random_sent = True
            if world > 1 and self.setups:
                snapshot.augment = [setup.augment for setup in self.setups]
                snapshot.random_states = [report.random_state for report in reports]
        if first.param_sums is not None:
            snapshot.param_sums = [report.param_sums or [] for report in reports]
            snapshot.tensor_names, snapshot.buffers_checked = tensor_names, buffers_checked
        if first.metrics is not None:
            snapshot.metrics = [report.metrics or {} for report in reports]
        if first.timing is not None:
            snapshot.timings = [report.timing for report in reports if report.timing is not None]
            snapshot.loaders = [setup.loader for setup in self.setups]
        for report in reports:
            self.unreduced += [name for name in report.missing_grads or () if name not in self.unreduced]
        snapshot.unreduced = list(self.unreduced)
        if first.usage is not None:
            usage = [report.usage for report in reports if report.usage is not None]
            self._absorb_usage(usage)
            if first.usage.done:
                snapshot.usage = ParamUsage(self.use_counts, self.use_batches, param_names, find_unused)
        return snapshot

    def _absorb_digests(self, per_rank: list[dict[int, Optional[str]]]) -> list[FirstBatches]:
        arrived = []
        for epoch in sorted({epoch for digests in per_rank for epoch in digests}):
            digests = [d.get(epoch) for d in per_rank]
            self.epoch_digests[epoch] = digests
            arrived.append(FirstBatches(epoch, digests, self.epoch_digests.get(epoch - 1)))
        for old in sorted(self.epoch_digests)[:-2]:
            del self.epoch_digests[old]
        return arrived

    def _absorb_usage(self, usage: list[UsageReport]) -> None:
        if len(self.use_counts) != len(usage):
            self.use_counts = [[0] * len(u.counts) for u in usage]
            self.use_batches = [0] * len(usage)
        for rank, u in enumerate(usage):
            self.use_counts[rank] = [a + b for a, b in zip(self.use_counts[rank], u.counts)]
            self.use_batches[rank] += u.batches

    def record(self, found: list[Finding], step: int) -> list[Finding]:
        """Keep the findings of rules not reported before (stamped with ``step``); those are returned."""
        new = [f for f in found if f.rule not in self.reported]
        for finding in new:
            finding.step = step
            self.reported.add(finding.rule)
            self.findings.append(finding)
        return new

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        # Plain types only: checkpoints load with weights_only=True.
        return {
            "version": STATE_VERSION,
            "batches_seen": self.batches_seen,
            "checks": self.checks,
            "reported": sorted(self.reported),
            "findings": [f.as_dict() for f in self.findings],
            "epoch_digests": {str(epoch): list(digests) for epoch, digests in self.epoch_digests.items()},
            "use_counts": [list(c) for c in self.use_counts],
            "use_batches": list(self.use_batches),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> bool:
        """Take a :meth:`state_dict`; False (nothing loaded) when its version is unknown."""
        if state_dict.get("version") != STATE_VERSION:
            return False
        self.batches_seen = int(state_dict["batches_seen"])
        self.checks = int(state_dict["checks"])
        self.reported = set(state_dict["reported"])
        self.findings = [Finding.from_dict(f) for f in state_dict["findings"]]
        self.epoch_digests = {int(epoch): list(d) for epoch, d in state_dict["epoch_digests"].items()}
        self.use_counts = [[int(v) for v in c] for c in state_dict.get("use_counts", [])]
        self.use_batches = [int(v) for v in state_dict.get("use_batches", [])]
        return True
