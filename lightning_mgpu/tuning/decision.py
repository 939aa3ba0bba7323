"""From timed steps to a bucket size: medians per candidate, the choice, and the table.

Input is one time per timed step, already the *slowest rank's* (the strategy takes the
element-wise maximum over ranks: a DDP step ends when its slowest rank does). Each
candidate's figure is the median of all its timed steps over every round, so one slow
step (a hiccup of the machine) moves nothing.

The choice is the candidate with the smallest median, except that DDP's default is kept
unless another layout beats it by at least ``min_gain``: between layouts that measure
the same, keep the one nobody has to explain.

Pure Python, no torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_mgpu.tuning.layout import MIB, Candidate


@dataclass(frozen=True)
class CandidateResult:
    candidate: Candidate
    step_ms: float
    """Median over every timed step of this candidate (slowest rank's step times)."""
    steps: int
    round_ms: tuple[float, ...]
    """Median per round, for judging noise."""
    built_bytes: Optional[tuple[int, ...]] = None
    """Bucket sizes DDP actually built for this candidate (None: not read)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.as_dict(),
            "step_ms": self.step_ms,
            "steps": self.steps,
            "round_ms": list(self.round_ms),
            "built_bytes": None if self.built_bytes is None else list(self.built_bytes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CandidateResult:
        candidate = Candidate.from_dict(data)
        built = data.get("built_bytes")
        return cls(
            candidate=candidate,
            step_ms=float(data["step_ms"]),
            steps=int(data["steps"]),
            round_ms=tuple(float(ms) for ms in data["round_ms"]),
            built_bytes=None if built is None else tuple(int(b) for b in built),
        )


def summarize(
    candidates: Sequence[Candidate],
    timed: Sequence[tuple[int, int, float]],
    built: Optional[dict[int, tuple[int, ...]]] = None,
) -> list[CandidateResult]:
    """One result per candidate from ``(candidate, round, ms)`` triples."""
    results = []
    for index, candidate in enumerate(candidates):
        mine = [(r, ms) for c, r, ms in timed if c == index]
        if not mine:
            raise ValueError(f"candidate {index} ({candidate.cap_mb:g} MiB) has no timed step")
        rounds = sorted({r for r, _ in mine})
        results.append(
            CandidateResult(
                candidate=candidate,
                step_ms=float(statistics.median(ms for _, ms in mine)),
                steps=len(mine),
                round_ms=tuple(float(statistics.median(ms for r2, ms in mine if r2 == r)) for r in rounds),
                built_bytes=(built or {}).get(index),
            )
        )
    return results


def choose(results: Sequence[CandidateResult], min_gain: float) -> int:
    """Index of the chosen candidate (see the module docstring)."""
    if not results:
        raise ValueError("no candidate to choose from")
    best = min(range(len(results)), key=lambda i: (results[i].step_ms, i))
    default = next((i for i, r in enumerate(results) if r.candidate.is_default), None)
    if default is None or best == default:
        return best
    if results[best].step_ms <= results[default].step_ms * (1.0 - min_gain):
        return best
    return default


def gain_over_default(results: Sequence[CandidateResult], chosen: int) -> Optional[float]:
    """How much faster the chosen layout measured than DDP's default (0.1: 10% less time)."""
    default = next((r for r in results if r.candidate.is_default), None)
    if default is None or default.step_ms <= 0:
        return None
    return 1.0 - results[chosen].step_ms / default.step_ms


def _mib(values: Sequence[int]) -> str:
    return ", ".join(f"{v / MIB:.2f}" for v in values)


def _size(value: float) -> str:
    return f"{value:g}"


def format_table(results: Sequence[CandidateResult], chosen: int) -> str:
    """The candidates as a plain-text table (for ``rank_zero_info``; logs have no colours)."""
    default = next((r for r in results if r.candidate.is_default), None)
    header = ("", "bucket_cap_mb", "same layout", "buckets (MiB, launch order)", "step ms", "per round", "vs default")
    rows = [header]
    for index, result in enumerate(results):
        candidate = result.candidate
        others = [s for s in candidate.equivalent_mb if s != candidate.cap_mb]
        label = _size(candidate.cap_mb) + (" (DDP default)" if candidate.is_default else "")
        versus = "-" if default is None or candidate.is_default else f"{result.step_ms / default.step_ms - 1:+.1%}"
        layout = result.built_bytes if result.built_bytes is not None else candidate.bucket_bytes
        rows.append(
            (
                "*" if index == chosen else "",
                label,
                ", ".join(_size(s) for s in others) or "-",
                _mib(layout),
                f"{result.step_ms:.2f}",
                " / ".join(f"{ms:.1f}" for ms in result.round_ms),
                versus,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {4, 5, 6}
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
