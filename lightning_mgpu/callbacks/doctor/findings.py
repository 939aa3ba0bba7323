"""What the doctor reports: a :class:`Finding`, how the ranks' own findings merge, and the error/warning raised.

Plain Python, no torch: findings travel between ranks (pickled) and into checkpoints (as dicts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Union

__all__ = ["DistributedDoctorError", "DistributedDoctorWarning", "Finding", "merge_local", "name_list", "rank_list"]


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
    """A DistributedDoctor finding (``strict=False``)."""


class DistributedDoctorError(RuntimeError):
    """Raised on every rank at the same check when ``strict=True`` and a rule fires."""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = findings
        self.rules = [f.rule for f in findings]
        body = "\n".join(f.format() for f in findings)
        super().__init__(
            f"DistributedDoctor(strict=True) stopped the run on every rank: {', '.join(self.rules)}\n{body}\n"
            f"(turn a rule off with DistributedDoctor(disable=[...]) if this run is meant to be that way)"
        )

    def __reduce__(self) -> tuple[Any, tuple[list[Finding]]]:
        return type(self), (self.findings,)  # survives pickling (spawned processes, multiprocessing queues)
