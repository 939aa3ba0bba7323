"""What the doctor reports: a :class:`Finding`, how the ranks' own findings merge, and the error/warning raised.

Plain Python, no torch: findings travel between ranks (pickled) and into checkpoints (as dicts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Union

__all__ = [
    "DistributedDoctorError",
    "DistributedDoctorOutOfStep",
    "DistributedDoctorWarning",
    "Finding",
    "merge_local",
    "name_list",
    "rank_list",
]


@dataclass
class Finding:
    """What a rule saw, why it matters and how to fix it."""

    rule: str
    seen: str
    why: str
    fix: str
    step: int = -1
    """The global step of the check that reported it (-1 until reported)."""
    ranks: list[int] = field(default_factory=list)
    """The ranks that saw it, for findings a rank makes on its own (empty for findings over gathered data)."""
    severity: Optional[str] = None
    """This finding's severity where it is not its rule's (see ``rules.SEVERITIES``); None: the rule's."""

    def format(self) -> str:
        where = f" at step {self.step}" if self.step >= 0 else ""
        return f"[{self.rule}]{where}: {self.seen}\n  why: {self.why}\n  fix: {self.fix}"

    def as_dict(self) -> dict[str, Any]:
        """Plain types only: checkpoints load with ``weights_only=True``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        return cls(
            rule=str(data["rule"]),
            seen=str(data["seen"]),
            why=str(data["why"]),
            fix=str(data["fix"]),
            step=int(data.get("step", -1)),
            ranks=[int(r) for r in data.get("ranks", [])],
            severity=None if data.get("severity") is None else str(data["severity"]),
        )


def merge_local(per_rank: Sequence[Sequence[Union[Finding, Mapping[str, Any]]]]) -> list[Finding]:
    """Findings each rank made on its own, one per rule: the lowest rank's words, every rank named.

    ``per_rank[r]`` holds rank ``r``'s findings (as :class:`Finding` or its ``as_dict()``); the
    inputs are left unchanged.
    """
    merged: dict[str, Finding] = {}
    for rank, findings in enumerate(per_rank):
        for item in findings:
            finding = Finding.from_dict(item) if isinstance(item, Mapping) else replace(item, ranks=[])
            if finding.rule in merged:
                merged[finding.rule].ranks.append(rank)
            else:
                finding.ranks = [rank]
                merged[finding.rule] = finding
    for finding in merged.values():
        if len(finding.ranks) == len(per_rank) and len(per_rank) > 1:
            finding.seen += " (on every rank)"
        elif len(per_rank) > 1:
            finding.seen += f" (on rank{'s' if len(finding.ranks) > 1 else ''} {rank_list(finding.ranks)})"
    return list(merged.values())


def rank_list(ranks: Sequence[int]) -> str:
    """``"0, 2, 3"``."""
    return ", ".join(str(r) for r in ranks)


def name_list(names: Sequence[str], limit: int = 5) -> str:
    """The first ``limit`` names, then how many more: ``"a, b, c, d, e and 7 more"``."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class DistributedDoctorWarning(UserWarning):
    """A DistributedDoctor finding that does not stop the run (``strict=False``: a rule that is not fatal)."""


class DistributedDoctorError(RuntimeError):
    """Raised on every rank at the same check when a finding stops the run: any finding with
    ``strict=True``; by default a fatal one (the run would crash or hang), which comes with the
    check's other new findings."""

    def __init__(self, findings: list[Finding], strict: bool = True, fatal: Optional[list[str]] = None) -> None:
        """``fatal``: the rules that stopped the run when not ``strict`` (the others come with them)."""
        self.findings = findings
        self.rules = [f.rule for f in findings]
        self.strict = strict
        self.fatal = list(self.rules if fatal is None else fatal)
        body = "\n".join(f.format() for f in findings)
        if strict:
            head = f"DistributedDoctor(strict=True) stopped the run on every rank: {', '.join(self.rules)}"
            tail = "turn a rule off with DistributedDoctor(disable=[...]) if this run is meant to be that way"
        else:
            others = [rule for rule in self.rules if rule not in self.fatal]
            head = (
                f"DistributedDoctor stopped the run on every rank: {', '.join(self.fatal)} (fatal: the run would crash or "
                f"hang){'; also found: ' + ', '.join(others) if others else ''}"
            )
            tail = (
                "DistributedDoctor(stop_on_fatal=False) only warns, and the run then goes on into the crash or hang "
                "the finding predicts"
            )
        super().__init__(f"{head}\n{body}\n({tail})")

    def __reduce__(self) -> tuple[Any, tuple[list[Finding], bool, list[str]]]:
        return type(self), (
            self.findings,
            self.strict,
            self.fatal,
        )  # survives pickling (spawned processes, multiprocessing queues)


class DistributedDoctorOutOfStep(RuntimeError):
    """Raised on a rank that cannot meet the others at a check: another rank left the run (an exception,
    the end of its fit, its process gone) or did not arrive within ``check_timeout``.

    ``missing`` names the ranks that did not arrive; the message says where each was last seen.
    """

    def __init__(self, message: str, missing: Optional[list[int]] = None) -> None:
        self.missing = list(missing or [])
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, tuple[str, list[int]]]:
        return type(self), (str(self), self.missing)
