"""What a doctor rule is: its catalogue entry (:class:`Rule`) and the :class:`Watch` that observes and judges for it.

The callback makes one watch of each kind and calls every watch at each of its hooks. At a check,
every rank sends a :class:`RankReport` (each watch's :meth:`~Watch.report`, and the findings a rank
made on its own); every rank gathers the same reports, and every watch judges them
(:meth:`~Watch.judge`) the same way on every rank, so all reach the same verdict and keep the
same agreed state (checkpointed through :meth:`~Watch.state_dict`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional

from lightning_mgpu.callbacks.doctor.findings import Finding

if TYPE_CHECKING:
    import lightning as L
    import torch

    from lightning_mgpu.callbacks.doctor.callback import DistributedDoctor

__all__ = ["SEVERITIES", "Check", "CheckKind", "RankReport", "Rule", "Severity", "Watch"]

Severity = Literal["fatal", "wrong", "wasteful"]

SEVERITIES: dict[Severity, str] = {
    "fatal": "the run crashes or hangs",
    "wrong": "training, or what is recorded of it, is silently not what was meant",
    "wasteful": "the run is correct but pays for time or devices it does not use",
}

CheckKind = Literal["epoch_start", "epoch_first_batch", "periodic", "epoch_end", "validation_end", "train_end"]


@dataclass(frozen=True)
class Rule:
    """One named check: what it catches, how it is detected, what it costs and the usual fix."""

    id: str
    """Stable id (``DistributedDoctor(disable=[id])``, ``Finding.rule``)."""
    catches: str
    detection: str
    cost: str
    fix: str
    """The usual fix; a finding may give a more specific one."""
    severity: Severity

    def finding(self, seen: str, why: str, fix: Optional[str] = None, severity: Optional[str] = None) -> Finding:
        """A finding of this rule (its usual fix unless ``fix``; its severity unless ``severity``)."""
        return Finding(self.id, seen=seen, why=why, fix=self.fix if fix is None else fix, severity=severity)


@dataclass
class RankReport:
    """One rank's part of a check (pickled between ranks); per watch, by its class's name."""

    local_findings: list[Finding] = field(default_factory=list)
    """Findings this rank made on its own since the last check."""
    setups: Optional[dict[str, Any]] = None
    """What each watch saw at fit start (:attr:`Watch.setup`), with the fit's first check."""
    payloads: dict[str, Any] = field(default_factory=dict)
    """What each watch sends at this check (:meth:`Watch.report`; None: nothing)."""


@dataclass
class Check:
    """One check as every rank holds it; ``first``: the fit's first, every watch's :attr:`~Watch.setups` with it."""

    epoch: int
    reports: list[RankReport]
    first: bool = False

    def of(self, watch: type[Watch]) -> list[Any]:
        """What ``watch`` sent at this check, by rank."""
        return [report.payloads.get(watch.__name__) for report in self.reports]


class Watch:
    """One rule's work in one callback: observe on this rank, report at checks, judge what the ranks sent.

    Every hook does nothing here; a watch overrides those it needs. Whether a check is made, and what
    each watch sends at it, is decided from state every rank shares, so the reports always match up.
    """

    rules: ClassVar[tuple[Rule, ...]]
    """The rules whose findings this watch makes."""
    needs_replicas: ClassVar[bool] = False
    """Its rules compare DDP replicas: not checked when a run on several ranks has none (e.g. FSDP)."""

    def __init__(self, doctor: DistributedDoctor) -> None:
        self.doctor = doctor
        self.reset()

    def reset(self) -> None:
        """A new fit: forget everything (a checkpoint's state, if any, is loaded afterwards)."""
        self.local: list[Finding] = []
        """Findings this rank made on its own, sent with the next check."""
        self.setup: Any = None
        """What this rank saw at fit start (set by :meth:`start`); every rank's in :attr:`setups` from the fit's
        first check on."""
        self.setups: list[Any] = []

    # ------------------------------------------------------------------ this rank

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Fit start, the model wrapped and the train loader made."""

    def first_batch(self, batch: Any) -> None:
        """The fit's first training batch, before :meth:`batch_start`."""

    def batch_start(self, trainer: L.Trainer, batch: Any, batch_idx: int) -> None:
        """Every training batch."""

    def before_first_backward(self, loss: torch.Tensor) -> Optional[list[Finding]]:
        """Findings to exchange in a meeting of their own before the fit's first backward (None: no meeting)."""
        return None

    def after_backward(self) -> None:
        """Every backward."""

    def on_exception(self, trainer: L.Trainer, exception: BaseException) -> None:
        """The fit failed with ``exception`` (a ``DistributedDoctorError`` of ours included)."""

    def finish(self) -> None:
        """The fit ended (or failed): undo whatever was hooked in."""

    # ------------------------------------------------------------------ checks

    def may_check(self, epoch: int, batch_idx: Optional[int] = None, *, during: bool = False) -> bool:
        """Whether every rank is certain to reach a check made now (see :meth:`DistributedDoctor._may_check`)."""
        return True

    def out_of_step(self) -> Optional[str]:
        """Why checks stopped before the end of the fit, for its summary (None: they did not)."""
        return None

    def report(self, trainer: L.Trainer, kind: CheckKind) -> Any:
        """What this rank sends at a check (None: nothing)."""
        return None

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        """The findings in every rank's :meth:`report` (``reports``, by rank; ``check``: what the other watches
        sent); also where the watch keeps what the ranks agreed on, so it runs (and is consumed) whether or
        not its rules are disabled: their findings are dropped afterwards."""
        return ()

    def state_dict(self) -> dict[str, Any]:
        """What the ranks agreed on that a resumed fit needs (plain types: checkpoints load weights-only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
