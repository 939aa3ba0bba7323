"""How sure can the bucket tuner be that one layout is faster than another? Distribution-free answers.

This module is also the one definition of every figure the package and its benchmarks
(``bench/``) report from step times: the median (:func:`statistics.median`), the p90
(:func:`p90`: nearest rank, always an observed time, as ``comm_profile.json`` reports it),
quartiles (:func:`quantile`: interpolated) and the order in which a measurement visits its
configurations round after round against drift (:func:`round_order`).

Step times on a shared machine are not normal: most steps sit near a floor, a few are far
slower (another job, the allocator, the OS). A mean and a t-interval would let those few
steps decide. The figures here assume nothing about the distribution:

* :func:`ratio_interval`: the Hodges-Lehmann estimate of how much faster one layout's steps
  are than another's (the median of every pairwise ratio of their step times) and its
  distribution-free confidence interval from the Mann-Whitney statistic (the interval's ends
  are order statistics of those pairwise ratios; normal approximation of the statistic's
  distribution, fine from about four steps each). Ratios are taken as differences of
  logarithms, so "10% faster" means the same at 50 ms and at 3 s per step.
* :func:`spread`: half the interquartile range over the median, the noise the table shows
  ("+-4%"): what a single step's time scatters by.

Timed steps of one candidate are not strictly independent (the machine's load drifts). The
tuner's interleaved rounds (A B C, C B A: :func:`round_order`) spread a drift over every
candidate, and the decision rule asks for the whole interval to clear the threshold, not only
the estimate.

Pure Python, no torch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Literal, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RatioInterval:
    """Candidate step time over baseline step time: estimate and confidence interval (0.9: 10% faster)."""

    ratio: float
    low: float
    high: float
    """``low <= ratio <= high``; ``0`` and ``inf`` when there are too few steps to bound it."""
    confidence: float
    """Two-sided coverage of ``[low, high]``."""

    @property
    def bounded(self) -> bool:
        return self.low > 0 and math.isfinite(self.high)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "low": self.low if self.bounded else None,
            "high": self.high if self.bounded else None,
            "confidence": self.confidence,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RatioInterval:
        low, high = data.get("low"), data.get("high")
        return cls(
            ratio=float(data["ratio"]),
            low=0.0 if low is None else float(low),
            high=math.inf if high is None else float(high),
            confidence=float(data["confidence"]),
        )


def _check_confidence(confidence: float) -> None:
    if not (isinstance(confidence, (int, float)) and 0 < confidence < 1):
        raise ValueError(f"confidence must be within (0, 1), e.g. 0.95, got {confidence!r}")


def ratio_interval(candidate: Sequence[float], baseline: Sequence[float], *, confidence: float) -> RatioInterval:
    """Hodges-Lehmann estimate and Mann-Whitney interval of ``candidate / baseline`` step times.

    Args:
        candidate, baseline: step times (positive) of the two layouts.
        confidence: two-sided coverage of the interval (0.95: each end is wrong 2.5% of the time).

    The ``n*m`` pairwise log-ratios, sorted: the estimate is their median; the interval runs
    from the ``(C+1)``-th to the ``(n*m-C)``-th, with ``C = floor(n*m/2 - z * sqrt(n*m*(n+m+1)/12))``
    (``z`` the normal quantile of ``(1+confidence)/2``). ``C < 0`` (too few steps): unbounded.
    """
    _check_confidence(confidence)
    if not candidate or not baseline:
        raise ValueError(f"ratio_interval needs step times on both sides, got {len(candidate)} and {len(baseline)}")
    if min(candidate) <= 0 or min(baseline) <= 0:
        raise ValueError("step times must be positive")
    logs_c = [math.log(x) for x in candidate]
    logs_b = [math.log(y) for y in baseline]
    differences = sorted(c - b for c in logs_c for b in logs_b)
    n, m = len(logs_c), len(logs_b)
    total = n * m
    estimate = math.exp(statistics.median(differences))
    z = statistics.NormalDist().inv_cdf((1 + confidence) / 2)
    cut = math.floor(total / 2 - z * math.sqrt(total * (n + m + 1) / 12))
    if cut < 0:
        return RatioInterval(estimate, 0.0, math.inf, confidence)
    return RatioInterval(estimate, math.exp(differences[cut]), math.exp(differences[total - cut - 1]), confidence)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def p90(values: Sequence[float]) -> float:
    """The 90th percentile by nearest rank: the smallest value with at least 90% of all values at or below it.

    Always an observed value (a step that really took that long), unlike an interpolated one.
    """
    if not values:
        raise ValueError("p90 of no values")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)])


def round_order(
    items: Sequence[T], round_index: int, *, scheme: Literal["alternate", "rotate"] = "alternate"
) -> list[T]:
    """The order in which round ``round_index`` of an interleaved measurement visits ``items``.

    Whatever the machine's load does over a measurement, interleaving keeps it from favouring
    one configuration:

    * ``"alternate"``: as given in even rounds, reversed in odd ones (A B C, C B A, ...; ABBA
      for two): over each pair of rounds a linear drift weighs the same on every item;
    * ``"rotate"``: shifted by one each round (A B C, B C A, C A B, ...): every item takes every
      position once in ``len(items)`` rounds (what separate launches, each paying its own start,
      want).
    """
    ordered = list(items)
    if scheme == "alternate":
        return ordered[::-1] if round_index % 2 else ordered
    if scheme == "rotate":
        shift = round_index % max(1, len(ordered))
        return ordered[shift:] + ordered[:shift]
    raise ValueError(f"scheme must be 'alternate' or 'rotate', got {scheme!r}")


def spread(values: Sequence[float]) -> float:
    """Half the interquartile range over the median (0.04: a typical step is within +-4% of the median)."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    if middle <= 0:
        return 0.0
    return (quantile(values, 0.75) - quantile(values, 0.25)) / 2 / middle
