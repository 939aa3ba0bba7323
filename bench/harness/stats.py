"""The benchmarks' statistics: the package's definitions (:mod:`lightning_mgpu.tuning.statistics`), one of each.

* median: :func:`statistics.median` (the mean of the two middle values for an even count);
* p90: :func:`lightning_mgpu.tuning.statistics.p90`, by nearest rank (an observed time, as
  ``comm_profile.json`` reports it); results written before this definition was shared used
  the interpolated value, which differs from it by less than one rank's gap;
* :func:`median_ci`: a distribution-free confidence interval of a median;
* :func:`paired_ratios`: one configuration over another within each round (both measured in
  the same stretch of the machine's load), the figure an interleaved comparison is judged by;
* :func:`center`: the median of per-run figures and their spread, :func:`against`: a ratio
  beside its limit.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Hashable, Sequence

from lightning_mgpu.tuning.statistics import p90

__all__ = ["against", "center", "median", "median_ci", "p90", "paired_ratios", "summarize"]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, p90, mean, min, max and count of a run's per-step times."""
    return {
        "median": median(values),
        "p90": p90(values),
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def center(values: Sequence[float]) -> tuple[float, list[float], float]:
    """The median of per-run figures, their range ``[min, max]`` and that range over the median."""
    middle = median(values)
    return middle, [min(values), max(values)], (max(values) - min(values)) / middle


def median_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median: the order statistics whose
    ranks a Binomial(n, 1/2) count puts around the middle (no normality assumed). With
    fewer than 6 values no interval reaches 95%: the range is returned instead."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median_ci of an empty sequence")
    alpha = 1 - confidence
    cumulative, k = 0.0, 0
    # largest k with P(X < k) <= alpha / 2, X ~ Binomial(n, 1/2)
    while k < n and cumulative + math.comb(n, k) / 2**n <= alpha / 2:
        cumulative += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def paired_ratios(
    runs: Sequence[dict[str, Any]],
    numerator: str,
    denominator: str,
    value: Callable[[dict[str, Any]], float],
    group: Callable[[dict[str, Any]], Hashable] = lambda run: run["round"],
) -> list[float]:
    """``value(numerator run) / value(denominator run)`` within each group of runs (a round, by default),
    groups in sorted order; a run's configuration is ``run["config"]``."""
    ratios = []
    for key in sorted({group(run) for run in runs}):  # type: ignore[type-var]
        mine = {run["config"]: run for run in runs if group(run) == key}
        ratios.append(value(mine[numerator]) / value(mine[denominator]))
    return ratios


def against(ratio: float, limit: float) -> dict[str, Any]:
    """A ratio beside its limit: ``{"ratio", "limit", "met": ratio <= limit}``."""
    return {"ratio": ratio, "limit": limit, "met": ratio <= limit}
