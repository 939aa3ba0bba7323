"""The tuning schedule: which layout runs during which training step, and which steps are timed.

Every step of the schedule is an ordinary training step; only the bucket layout changes.
A *visit* runs one candidate for a few consecutive steps:

* after a re-wrap, DDP's first iteration (built with its initial, unordered buckets) and
  its second (which rebuilds them in gradient-ready order) are never timed, nor are
  ``settle`` more steps after them;
* then ``measure`` steps are timed.

Candidates are visited in ``rounds`` rounds, the order reversed every other round
(A B C, C B A, A B C, ...): a machine that slowly gets faster or slower then affects every
candidate about equally instead of favouring whichever came last. Where a round ends
with the candidate the next one starts with, the model is not re-wrapped: that visit
needs no unmeasured steps. The very first visit also absorbs the first steps of the fit
(data loader, allocator and caches warming up) in ``initial_warmup`` more untimed steps.

When the planned rounds leave the decision open (a layout *might* be faster, see
:mod:`~lightning_mgpu.tuning.decision`), :func:`extension_visits` plans one more round of the
default and those contenders only, in the alternating order the rounds had, and the tuner
runs such rounds while ``extra_steps`` allows.

Pure Python, no torch: tested on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from lightning_mgpu.tuning.buckets import DEFAULT_GRID_MB
from lightning_mgpu.tuning.statistics import round_order

DDP_UNTIMED_STEPS = 2
"""Steps after a re-wrap that DDP itself makes slow: its first iteration and its bucket rebuild."""


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_candidates(name: str, value: object) -> tuple[float, ...]:
    """A non-empty sequence of positive, finite sizes in MiB, as floats (``name`` in errors)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise ValueError(f"{name} must be a non-empty list of bucket sizes in MiB, e.g. [1, 4, 16, 64], got {value!r}")
    sizes = []
    for size in value:
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size) or size <= 0:
            raise ValueError(f"{name} must hold positive, finite sizes in MiB, got {size!r} in {list(value)!r}")
        if size > 1024 * 1024:
            raise ValueError(f"{name}: {size!r} MiB is larger than any model's gradients (limit 1 TiB)")
        sizes.append(float(size))
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True, kw_only=True)
class TuningSettings:
    """How ``bucket_cap_mb="auto"`` searches (``TunedDDPStrategy``'s ``tune_*`` arguments)."""

    candidates_mb: tuple[float, ...] = DEFAULT_GRID_MB
    """Bucket sizes to consider (MiB); DDP's default 25 MiB is always added. Sizes giving
    the same layout are measured once."""
    steps: Optional[int] = None
    """Most training steps tuning may take. None: what the plan needs with ``measure``
    timed steps per visit. Given: the timed steps per visit are as many as fit (at least
    ``min_measure``; if even that does not fit, tuning is skipped)."""
    rounds: int = 2
    """Visits per candidate, in alternating order."""
    measure: int = 4
    """Timed steps per visit when ``steps`` is None."""
    settle: int = 1
    """Untimed steps after DDP's first iteration and bucket rebuild, per re-wrap."""
    initial_warmup: int = 3
    """Further untimed steps in the fit's very first visit (caches, allocator, data loader
    workers all warm up in the first steps of a fit; those must not count against DDP's
    default, which the fit starts with)."""
    min_measure: int = 2
    """Fewest timed steps per visit worth taking."""
    min_run_multiple: float = 4.0
    """Tune only if the fit has at least this many times the tuning steps left."""
    min_gain: float = 0.02
    """Leave DDP's default only for a layout at least this much faster (0.02: 2%)."""
    confidence: float = 0.95
    """How sure the search must be, over all layouts together, that a layout is ``min_gain``
    faster before it leaves DDP's default (see :mod:`~lightning_mgpu.tuning.decision`)."""
    extra_steps: Optional[int] = None
    """Most further steps for measuring the default and the contenders again when the planned
    rounds leave the decision open. None: as many as the planned rounds took when ``steps``
    is None, none when ``steps`` is given (it caps the whole search); 0: never. Never more
    than leaves the fit ``min_run_multiple`` times longer than the search."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates_mb", check_candidates("tune_candidates", self.candidates_mb))
        if self.steps is not None:
            _positive_int("tune_steps", self.steps)
        _positive_int("tune_rounds", self.rounds)
        _positive_int("measure", self.measure)
        _positive_int("settle", self.settle, 0)
        _positive_int("initial_warmup", self.initial_warmup, 0)
        _positive_int("min_measure", self.min_measure)
        if not (isinstance(self.min_run_multiple, (int, float)) and self.min_run_multiple >= 1):
            raise ValueError(f"min_run_multiple must be a number >= 1, got {self.min_run_multiple!r}")
        if not (isinstance(self.min_gain, (int, float)) and 0 <= self.min_gain < 1):
            raise ValueError(f"min_gain must be within [0, 1), got {self.min_gain!r}")
        if not (isinstance(self.confidence, (int, float)) and 0.5 <= self.confidence < 1):
            raise ValueError(f"confidence must be within [0.5, 1), e.g. 0.95, got {self.confidence!r}")
        if self.extra_steps is not None:
            _positive_int("extra_steps", self.extra_steps, 0)


@dataclass(frozen=True)
class Visit:
    """``skip`` untimed then ``measure`` timed training steps of one candidate."""

    candidate: int
    round: int
    rewrap: bool
    """The model is re-wrapped (at the optimizer-step boundary) just before this visit."""
    skip: int
    measure: int

    @property
    def steps(self) -> int:
        return self.skip + self.measure


@dataclass(frozen=True)
class Plan:
    visits: tuple[Visit, ...] = field(default_factory=tuple)
    measure: int = 0

    @property
    def steps(self) -> int:
        """Training steps the schedule takes, the fit's first step included."""
        return sum(v.steps for v in self.visits)

    @property
    def rewraps(self) -> int:
        return sum(v.rewrap for v in self.visits)


def visit_order(num_candidates: int, rounds: int) -> list[tuple[int, int]]:
    """(candidate, round) pairs: 0..n-1, then n-1..0, and so on."""
    return [
        (candidate, round_index)
        for round_index in range(rounds)
        for candidate in round_order(range(num_candidates), round_index)
    ]


def _visits(num_candidates: int, settings: TuningSettings, measure: int) -> tuple[Visit, ...]:
    visits = []
    previous: Optional[int] = 0  # the fit starts wrapped with candidate 0 (DDP's default)
    for position, (candidate, round_index) in enumerate(visit_order(num_candidates, settings.rounds)):
        rewrap = position > 0 and candidate != previous
        if position == 0:  # the fit's own first steps: DDP's first iteration and rebuild
            skip = DDP_UNTIMED_STEPS + settings.settle + settings.initial_warmup
        else:
            skip = DDP_UNTIMED_STEPS + settings.settle if rewrap else 0
        visits.append(Visit(candidate=candidate, round=round_index, rewrap=rewrap, skip=skip, measure=measure))
        previous = candidate
    return tuple(visits)


def make_plan(num_candidates: int, settings: TuningSettings) -> Optional[Plan]:
    """The schedule for ``num_candidates`` layouts, or None if ``settings.steps`` is too small.

    With one candidate there is nothing to compare: an empty plan.
    """
    if num_candidates < 1:
        raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
    if num_candidates == 1:
        return Plan()
    if settings.steps is None:
        return Plan(_visits(num_candidates, settings, settings.measure), settings.measure)
    untimed = sum(v.skip for v in _visits(num_candidates, settings, 0))
    timed_visits = num_candidates * settings.rounds
    measure = (settings.steps - untimed) // timed_visits
    if measure < settings.min_measure:
        return None
    return Plan(_visits(num_candidates, settings, measure), measure)


def steps_needed(num_candidates: int, settings: TuningSettings) -> int:
    """Fewest ``tune_steps`` that allow ``settings.min_measure`` timed steps per visit."""
    if num_candidates <= 1:
        return 0
    return sum(v.steps for v in _visits(num_candidates, settings, settings.min_measure))


def extra_budget(settings: TuningSettings, plan: Plan, remaining_steps: Optional[float]) -> int:
    """Steps the search may add to ``plan`` to settle an open decision (see ``TuningSettings.extra_steps``)."""
    if settings.extra_steps is not None:
        budget = settings.extra_steps
    else:
        budget = 0 if settings.steps is not None else plan.steps
    if remaining_steps is not None:
        budget = min(budget, int(remaining_steps / settings.min_run_multiple) - plan.steps)
    return max(0, budget)


def extension_visits(
    contenders: Sequence[int], *, previous: int, round_index: int, settings: TuningSettings, measure: int
) -> tuple[Visit, ...]:
    """One more round over ``contenders``: ascending in even rounds, descending in odd ones (as the
    planned rounds alternate), each visit re-wrapped unless it continues the previous candidate."""
    ordered = round_order(sorted(set(contenders)), round_index)
    visits = []
    for candidate in ordered:
        rewrap = candidate != previous
        skip = DDP_UNTIMED_STEPS + settings.settle if rewrap else 0
        visits.append(Visit(candidate=candidate, round=round_index, rewrap=rewrap, skip=skip, measure=measure))
        previous = candidate
    return tuple(visits)
