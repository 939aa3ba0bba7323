"""From timed steps to a bucket size: medians per candidate, how sure we are, the choice, and the table.

Input is one time per timed step, already the *slowest rank's* (the strategy takes the
element-wise maximum over ranks: a DDP step ends when its slowest rank does). Each
candidate's figure is the median of all its timed steps over every round, so one slow
step (a hiccup of the machine) moves nothing.

The choice (:func:`decide`) leaves DDP's default only for a layout that is faster **with
confidence**: every other layout's steps are compared with the default's
(:func:`~lightning_mgpu.tuning.statistics.ratio_interval`: the Hodges-Lehmann ratio and its
distribution-free interval), and a layout qualifies when the whole interval lies below
``1 - min_gain``. The confidence holds for all comparisons together (Bonferroni: with 3
other layouts at 95%, each interval is a 98.3% one): a loaded machine that makes one of
many layouts look lucky does not move the run off DDP's default. Three outcomes:

* ``faster``: at least one layout qualifies; the one with the best estimate is chosen;
* ``not faster``: every other layout is, with confidence, not ``min_gain`` faster: keep the default;
* ``too noisy``: some layout *might* be ``min_gain`` faster but its interval straddles the
  threshold. The tuner then measures the default and those contenders again, if its step
  budget allows (:attr:`Verdict.contenders`), and decides again; when the budget is spent, it
  keeps DDP's default and says the machine was too noisy to decide.

The pooled steps treat every step as independent, and a machine that slows down for seconds
breaks that: on the two-node lab at 10 Gbit/s, the default's rounds measured 99, 131 and 125
ms while a 2 MiB layout's measured 103, 93 and 92, so the pooled interval called 2 MiB at
least 6% faster, although it was 4% slower over 500 steps. So a layout is also checked
**round by round** (:func:`round_ratios`, the same rounds of both): if it measured more than
half of ``min_gain`` slower than the default in any one round, the rounds contradict the
pooled verdict, and it is a contender to measure again (``too noisy``), never chosen outright.

Pure Python, no torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from lightning_mgpu.tuning.buckets import MIB
from lightning_mgpu.tuning.layout import Candidate
from lightning_mgpu.tuning.statistics import RatioInterval, ratio_interval, spread

FASTER, NOT_FASTER, NOISY = "faster", "not faster", "too noisy"
OUTCOMES = (FASTER, NOT_FASTER, NOISY)
DEFAULT_CONFIDENCE = 0.95


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
    samples_ms: tuple[float, ...] = ()
    """Every timed step (slowest rank's), in order; empty when only the medians are known."""
    vs_default: Optional[RatioInterval] = None
    """This candidate's step time over the default's, with its interval (None: the default itself, or not computed)."""
    round_ids: tuple[int, ...] = ()
    """The round each of ``round_ms`` belongs to (empty: not known, no round-by-round check)."""

    @property
    def spread(self) -> float:
        """Half the interquartile range of the timed steps over their median (0.04: +-4%)."""
        return spread(self.samples_ms)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.as_dict(),
            "step_ms": self.step_ms,
            "steps": self.steps,
            "round_ms": list(self.round_ms),
            "built_bytes": None if self.built_bytes is None else list(self.built_bytes),
            "samples_ms": list(self.samples_ms),
            "spread": self.spread,
            "vs_default": None if self.vs_default is None else self.vs_default.as_dict(),
            "round_ids": list(self.round_ids),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CandidateResult:
        candidate = Candidate.from_dict(data)
        built = data.get("built_bytes")
        versus = data.get("vs_default")
        return cls(
            candidate=candidate,
            step_ms=float(data["step_ms"]),
            steps=int(data["steps"]),
            round_ms=tuple(float(ms) for ms in data["round_ms"]),
            built_bytes=None if built is None else tuple(int(b) for b in built),
            samples_ms=tuple(float(ms) for ms in data.get("samples_ms", ())),
            vs_default=None if versus is None else RatioInterval.from_dict(versus),
            round_ids=tuple(int(r) for r in data.get("round_ids", ())),
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
                samples_ms=tuple(ms for _, ms in mine),
                round_ids=tuple(rounds),
            )
        )
    return results


def round_ratios(result: CandidateResult, default: CandidateResult) -> list[float]:
    """This candidate's median over the default's, round by round, for the rounds both were measured in."""
    if not result.round_ids or not default.round_ids:
        return []
    theirs = dict(zip(default.round_ids, default.round_ms))
    return [ms / theirs[r] for r, ms in zip(result.round_ids, result.round_ms) if theirs.get(r, 0) > 0]


def contradicting_round(result: CandidateResult, default: CandidateResult, min_gain: float) -> Optional[float]:
    """The worst round's ratio when a round measured this candidate over ``min_gain / 2`` slower, else None.

    Needs two shared rounds at least: with one, the round is the pooled figure.
    """
    ratios = round_ratios(result, default)
    if len(ratios) < 2 or max(ratios) <= 1.0 + min_gain / 2:
        return None
    return max(ratios)


@dataclass(frozen=True)
class Verdict:
    """What :func:`decide` concluded."""

    chosen: int
    """Index of the candidate to use (DDP's default unless another is faster with confidence)."""
    outcome: str
    """``faster``, ``not faster`` or ``too noisy`` (see the module docstring)."""
    contenders: tuple[int, ...] = ()
    """When too noisy: the default and every layout that might be faster, to measure again."""
    results: tuple[CandidateResult, ...] = field(default_factory=tuple)
    """The results, each non-default one with its interval against the default."""

    def as_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "outcome": self.outcome, "contenders": list(self.contenders)}


def _against_default(result: CandidateResult, default: CandidateResult, confidence: float) -> RatioInterval:
    if result.samples_ms and default.samples_ms:
        return ratio_interval(result.samples_ms, default.samples_ms, confidence=confidence)
    ratio = result.step_ms / default.step_ms  # medians only: no interval, the point estimate decides
    return RatioInterval(ratio, ratio, ratio, confidence)


def decide(results: Sequence[CandidateResult], *, min_gain: float, confidence: float = DEFAULT_CONFIDENCE) -> Verdict:
    """The choice and how sure it is (see the module docstring).

    Args:
        results: one per candidate (:func:`summarize`); ``samples_ms`` give the intervals.
        min_gain: leave the default only for a layout at least this much faster (0.02: 2%).
        confidence: one-sided, for all comparisons together: the chance that a layout is
            chosen while it is not ``min_gain`` faster stays below ``1 - confidence``.
    """
    if not results:
        raise ValueError("no candidate to choose from")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be within (0, 1), e.g. 0.95, got {confidence!r}")
    default_index = next((i for i, r in enumerate(results) if r.candidate.is_default), None)
    if default_index is None:  # nothing to keep: the fastest median
        best = min(range(len(results)), key=lambda i: (results[i].step_ms, i))
        return Verdict(best, FASTER, (), tuple(results))
    default = results[default_index]
    others = [i for i in range(len(results)) if i != default_index]
    # Bonferroni over the comparisons; a two-sided interval whose upper end is the one-sided bound.
    two_sided = 1 - 2 * (1 - confidence) / max(1, len(others))
    intervals = {i: _against_default(results[i], default, two_sided) for i in others}
    annotated = tuple(replace(r, vs_default=intervals[i]) if i in intervals else r for i, r in enumerate(results))
    threshold = 1.0 - min_gain
    faster = [
        i
        for i in others
        if intervals[i].high < threshold and contradicting_round(results[i], default, min_gain) is None
    ]
    if faster:
        best = min(faster, key=lambda i: (intervals[i].ratio, i))
        return Verdict(best, FASTER, (), annotated)
    maybe = sorted((i for i in others if intervals[i].low < threshold), key=lambda i: (intervals[i].ratio, i))
    if not maybe:
        return Verdict(default_index, NOT_FASTER, (), annotated)
    return Verdict(default_index, NOISY, (default_index, *maybe), annotated)


def choose(results: Sequence[CandidateResult], min_gain: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """Index of the chosen candidate: :func:`decide`'s ``chosen``."""
    return decide(results, min_gain=min_gain, confidence=confidence).chosen


def gain_over_default(results: Sequence[CandidateResult], chosen: int) -> Optional[float]:
    """How much faster the chosen layout measured than DDP's default (0.1: 10% less time).

    The Hodges-Lehmann ratio when the decision computed one (the figure its interval is about),
    else the ratio of the medians.
    """
    default = next((r for r in results if r.candidate.is_default), None)
    if default is None or default.step_ms <= 0:
        return None
    interval = results[chosen].vs_default
    if interval is not None and not results[chosen].candidate.is_default:
        return 1.0 - interval.ratio
    return 1.0 - results[chosen].step_ms / default.step_ms


def _mib(values: Sequence[int]) -> str:
    return ", ".join(f"{v / MIB:.2f}" for v in values)


def _size(value: float) -> str:
    return f"{value:g}"


def versus_default(result: CandidateResult, default: Optional[CandidateResult]) -> str:
    """``-10.0% [-12.3, -7.5]``: step time against the default's, with the interval when known."""
    if default is None or result.candidate.is_default or default.step_ms <= 0:
        return "-"
    interval = result.vs_default
    if interval is None:
        return f"{result.step_ms / default.step_ms - 1:+.1%}"
    text = f"{interval.ratio - 1:+.1%}"
    if interval.bounded and interval.low != interval.high:
        text += f" [{(interval.low - 1) * 100:+.1f}, {(interval.high - 1) * 100:+.1f}]"
    elif not interval.bounded:
        text += " [too few steps]"
    return text


def noise_note(results: Sequence[CandidateResult], outcome: str, min_gain: float) -> str:
    """One sentence for the table's foot: why DDP's default was kept, or nothing."""
    if outcome != NOISY:
        return ""
    others = [r for r in results if not r.candidate.is_default and r.vs_default is not None]
    best = min(others, key=lambda r: r.vs_default.ratio if r.vs_default is not None else 1.0, default=None)
    noise = max((r.spread for r in results), default=0.0)
    text = f"too noisy to decide: step times scatter by up to +-{noise:.0%}"
    default = next((r for r in results if r.candidate.is_default), None)
    if best is not None and best.vs_default is not None:
        worst = None if default is None else contradicting_round(best, default, min_gain)
        if best.vs_default.high < 1.0 - min_gain and worst is not None:
            text += (
                f"; {best.candidate.cap_mb:g} MiB measured {best.vs_default.ratio - 1:+.1%} over all its steps, but "
                f"{worst - 1:+.1%} in one round (the machine's speed drifted between rounds)"
            )
        else:
            text += (
                f"; {best.candidate.cap_mb:g} MiB measured {best.vs_default.ratio - 1:+.1%}, but its interval does "
                f"not rule out less than a {min_gain:.0%} gain"
            )
    return text + ". Kept DDP's default: run the tuning on a quieter machine, or with more tune_steps."


COLUMNS = (
    "bucket_cap_mb",
    "same layout",
    "buckets (MiB, launch order)",
    "step ms",
    "spread",
    "per round",
    "vs default [interval, %]",
)
"""The columns of a tuning table, in the log (:func:`format_table`) and in ``lightning-mgpu tune``'s."""


def _cells(result: CandidateResult, default: Optional[CandidateResult], layout: Sequence[int]) -> list[str]:
    """One candidate's cells under :data:`COLUMNS`, ``layout`` (bucket bytes) as its buckets."""
    candidate = result.candidate
    others = [s for s in candidate.equivalent_mb if s != candidate.cap_mb]
    return [
        _size(candidate.cap_mb) + (" (DDP default)" if candidate.is_default else ""),
        ", ".join(_size(s) for s in others) or "-",
        _mib(layout),
        f"{result.step_ms:.2f}",
        f"+-{result.spread:.0%}" if result.samples_ms else "-",
        " / ".join(f"{ms:.1f}" for ms in result.round_ms),
        versus_default(result, default),
    ]


def format_table(results: Sequence[CandidateResult], chosen: int) -> str:
    """The candidates as a plain-text table (for ``rank_zero_info``; logs have no colours)."""
    default = next((r for r in results if r.candidate.is_default), None)
    header = ("", *COLUMNS)
    rows: list[tuple[str, ...]] = [header]
    for index, result in enumerate(results):
        layout = result.built_bytes if result.built_bytes is not None else result.candidate.bucket_bytes
        rows.append(("*" if index == chosen else "", *_cells(result, default, layout)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {4, 5, 6, 7}
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
