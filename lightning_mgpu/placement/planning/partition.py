"""Split a sequence of layers into ``k`` contiguous pipeline stages with the smallest bottleneck.

Pure algorithm on plain lists of numbers, no torch import (like torchgpipe's
``balance/blockpartition.py``): the torch-dependent measuring lives in ``profile.py``, the
checks of the input and its conversion to exact integers in ``partition_input.py``.

    >>> partition([1, 1, 1, 1, 4], 2)
    [4, 1]
    >>> partition([1, 1, 1, 1, 4], 2, memory=[1, 1, 1, 1, 4], capacity=[6, 3])
    Traceback (most recent call last):
    ...
    ValueError: layer 4 alone needs memory 4 but it can only go on stage 1 (every stage needs at least one layer), ...
    >>> partition([1, 1, 1, 1, 4], 2, cut_costs=[0, 0, 0, 3])
    [3, 2]

The model
---------
Layer ``i`` takes ``costs[i]`` (e.g. ms of forward + backward per micro-batch). Stage ``j``
(running on device ``j``) holds a run of consecutive layers; its cost is the sum of its
layers' costs plus, with ``cut_costs``, the cost of **each of its two boundaries**:
``cut_costs[i]`` is the cost of the cut between layer ``i`` and ``i + 1``, and it is added
to both stages it separates. Why both: in training every cut is crossed twice per
micro-batch, the activation forward (``j -> j+1``) and its gradient backward
(``j+1 -> j``), so each neighbour sends once and receives once; with blocking
point-to-point transfers (gloo; a simple send/recv pipeline on NCCL) a device is busy for
the whole transfer at both ends. A stage's steady-state time per micro-batch is then its
compute plus the transfers at its edges, and the slowest stage sets the pipeline's pace.
So give ``cut_costs[i]`` as the time the cut adds to *each* side (forward send + backward
receive, which carry the same number of bytes). If your transfers overlap with compute,
leave ``cut_costs`` out (or pass what is left exposed).

:func:`partition` returns the sizes of the ``k`` non-empty stages that minimise the largest
stage cost, **exactly**: among all ``C(L-1, k-1)`` splits none has a smaller bottleneck.
With ``memory`` and ``capacity``, a stage whose summed memory exceeds its device's capacity
is not allowed, and the bottleneck is minimised over the splits that fit.

Exactness: every finite float is a dyadic rational, so the inputs are converted to
integers over a common power-of-two denominator and all sums and comparisons are exact
(no rounding, no epsilon). Ties are therefore real ties, and are broken by a fixed rule:
among all optimal splits, the one whose sizes are **lexicographically smallest** (the
first stage as short as possible, then the second, ...). Early stages hold the most
in-flight activations in a 1F1B schedule, so short early stages are also the kinder
choice for memory.

The algorithm
-------------
Bisection on the bottleneck value ``T`` with an exact feasibility probe, snapped to
candidate values so that it ends on the optimum itself:

* probe(T) decides whether some split has every stage cost ``<= T`` (and fits). It sweeps
  the stages in order, keeping the set of reachable boundaries: with prefix sums ``P``,
  the stage ``[a, b)`` costs ``(P[b] + cut_after(b)) - (P[a] - cut_before(a))``, so ``b`` is
  reachable iff the largest ``P[a] - cut_before(a)`` over reachable ``a`` in ``b``'s window
  (the ``a`` for which ``[a, b)`` fits in memory, a window that slides right as ``b`` grows)
  is large enough: a sliding-window maximum (monotone deque), O(L) per stage, O(k L) per
  probe. Cut costs make stage costs non-monotone in ``b``, which rules out the classic
  greedy probe; the window maximum does not care. Without cut costs and capacities (and
  with ``T`` at least the largest layer) the reachable boundaries after ``j`` stages are
  every one from ``j`` up to the furthest, and the probe is that greedy one: each stage
  ends as far as ``T`` allows, found by binary search in ``P`` (O(k log L)); a ``T`` that
  fails then raises the lower bound to ``T + 1`` (integers: see below).
* on success the upper bound drops to the bottleneck of the split found (a real stage
  cost <= T); on failure the lower bound rises to the smallest stage cost the probe saw
  blocked (every unreachable ``b`` with a reachable ``a`` in its window had its cheapest
  stage cost > T): nothing changes for any threshold below that value, so it is a valid
  lower bound and itself a candidate. The search stops when the bounds meet, on the
  optimum.
* the tie rule is applied at the optimum with one backward sweep (which boundaries can
  still be completed) and one forward pass (take the earliest such boundary).

Time: O(L) set-up and O(k L) per probe. The bracket at least halves per probe, so there are
at most log2(B) + 1 probes, B the initial bracket counted in the inputs' common resolution
(for floats at most about 53 + log2(L) + their binary exponent spread bits; the snapping
ends it far sooner: 3 to 20 probes measured on L = 1000). Total O(k L log B); L = 1000,
k = 8 takes about 20 ms in CPython (``bench/planner.py`` measures it). Without cut costs and
capacities, O(k log L log B) for the search and O(k L) for the tie rule: L = 100,000 layers
in 0.14 s at k = 8 and 0.7 s at k = 64 (2.0 and 19 s with the window probe). Memory: O(k L).
An exact O(k L^2) dynamic programme gives the same bottleneck (the tests and the
benchmark check that).
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_right
from collections import deque
from itertools import accumulate
from typing import Optional, Sequence

from lightning_mgpu.placement.planning.partition_input import (
    INFINITE,
    Capacity,
    Number,
    capacity_units,
    common_units,
    cut_costs_of,
    layer_costs_of,
    memory_and_capacity,
    memory_units,
    numbers_of,
    show,
    stage_count,
)

__all__ = ["partition", "stage_costs"]


def partition(
    costs: Sequence[Number],
    k: int,
    *,
    memory: Optional[Sequence[Number]] = None,
    capacity: Optional[Capacity] = None,
    cut_costs: Optional[Sequence[Number]] = None,
) -> list[int]:
    """Sizes of ``k`` contiguous, non-empty stages minimising the largest stage cost (exact).

    Args:
        costs: one finite, non-negative number per layer (its time, in any unit).
        k: number of stages (devices), ``1 <= k <= len(costs)``.

    Keyword Args:
        memory: one finite, non-negative number per layer (what it needs on its device:
            parameters, gradients, optimizer state, activations; any unit shared with
            ``capacity``). Needs ``capacity``.
        capacity: what each stage's device holds, in ``memory``'s unit: one number for all
            stages, or a list of ``k`` numbers (stage ``i`` runs on device ``i``);
            ``math.inf`` for no limit. Needs ``memory``.
        cut_costs: ``len(costs) - 1`` finite, non-negative numbers; ``cut_costs[i]`` is what
            a cut between layer ``i`` and ``i + 1`` adds to each of the two stages it
            separates (see the module docstring for why both).

    Returns:
        ``k`` positive sizes summing to ``len(costs)``; stage ``j`` holds the next
        ``sizes[j]`` layers. Among optimal splits, the lexicographically smallest sizes.

    Raises:
        ValueError: for malformed input (the message names the argument, the value and
            the fix), and when no split fits the capacities (the message says which layer
            or stage cannot fit and by how much).
    """
    layer_costs = layer_costs_of(costs)
    num_layers = len(layer_costs)
    num_stages = stage_count(k, num_layers)

    cut_values = cut_costs_of(cut_costs, num_layers)

    memory_values, capacities = memory_and_capacity(memory, capacity, num_layers, num_stages)

    (cost_units, cut_units), _ = common_units([layer_costs, cut_values or []])
    problem = _Problem(
        cost_units,
        cut_units if cut_values is not None else None,
        num_stages,
        *memory_units(memory_values, capacities),
    )
    bottleneck = problem.optimum()
    if bottleneck is None:
        assert memory_values is not None and capacities is not None  # only memory can make it infeasible
        raise ValueError(_explain_infeasible(memory_values, capacities))
    return problem.smallest_sizes(bottleneck)


def stage_costs(
    costs: Sequence[Number],
    sizes: Sequence[int],
    *,
    cut_costs: Optional[Sequence[Number]] = None,
) -> list[float]:
    """The cost of every stage of the split ``sizes``, as :func:`partition` counts it.

    Each stage's layer costs plus, with ``cut_costs``, the cost of each of its boundaries;
    summed exactly and rounded once (``math.fsum``), so ``max(stage_costs(...))`` is the
    correctly rounded bottleneck.

    >>> stage_costs([1, 2, 3, 4], [2, 2], cut_costs=[0.5, 0.25, 0.5])
    [3.25, 7.25]
    """
    layer_costs = numbers_of("costs", costs, unit_hint="a layer's time")
    sizes = list(sizes)
    positive_integers = all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 1 for s in sizes)
    if not positive_integers or sum(sizes) != len(layer_costs):
        raise ValueError(f"sizes must be positive integers summing to len(costs) = {len(layer_costs)}, got {sizes}")
    cuts: list[float] = []
    if cut_costs is not None:
        cuts = numbers_of("cut_costs", cut_costs, unit_hint="a transfer time")
        if len(cuts) != len(layer_costs) - 1:
            raise ValueError(f"cut_costs needs len(costs) - 1 = {len(layer_costs) - 1} entries, got {len(cuts)}")
    ends = list(accumulate((int(size) for size in sizes), initial=0))
    result = []
    for start, stop in zip(ends, ends[1:]):
        terms = layer_costs[start:stop]
        if cuts and start > 0:
            terms.append(cuts[start - 1])
        if cuts and stop < len(layer_costs):
            terms.append(cuts[stop - 1])
        result.append(math.fsum(terms))
    return result


# ----------------------------------------------------------------------------- the exact search
class _Problem:
    """Integer-valued instance: stage ``j`` covering layers ``[a, b)`` costs ``exit[b] - entry[a]``.

    ``exit[b] = P[b] + cut after layer b-1`` and ``entry[a] = P[a] - cut before layer a``
    with ``P`` the prefix sums of the costs. ``first[j][b]`` is the smallest ``a`` such that
    ``[a, b)`` fits stage ``j``'s capacity (``None``: no memory limit on that stage).
    """

    def __init__(
        self,
        cost_units: list[int],
        cut_units: Optional[list[int]],
        num_stages: int,
        memory_units: Optional[list[int]] = None,
        capacity_units: Optional[list[Optional[int]]] = None,
    ) -> None:
        self.num_layers = len(cost_units)
        self.num_stages = num_stages
        prefix = list(accumulate(cost_units, initial=0))
        self.total = prefix[-1]
        self.largest_layer = max(cost_units)
        self.exit = list(prefix)
        self.entry = list(prefix)
        if cut_units is not None:
            for cut_index, cut in enumerate(cut_units):
                self.exit[cut_index + 1] += cut  # a stage ending after layer cut_index pays the cut
                self.entry[cut_index + 1] -= cut  # ...and so does the stage starting at layer cut_index + 1
        self.first: list[Optional[list[int]]] = [None] * num_stages
        self.plain = cut_units is None  # and no capacity (below): a stage costs the sum of its layers, nothing else
        if memory_units is not None and capacity_units is not None:
            memory_prefix = list(accumulate(memory_units, initial=0))
            windows: dict[int, list[int]] = {}
            for stage, limit in enumerate(capacity_units):
                if limit is None:
                    continue
                if limit not in windows:
                    windows[limit] = _window_starts(memory_prefix, limit)
                self.first[stage] = windows[limit]
                self.plain = False

    def probe(self, threshold: float, *, keep_path: bool = True) -> tuple[bool, Optional[int]]:
        """Is there a split with every stage cost <= ``threshold`` that fits?

        Returns ``(True, bottleneck of the split found)`` or ``(False, next)``, where ``next``
        is a lower bound on any feasible threshold (the smallest stage cost seen blocked;
        ``None`` when no threshold can help: the capacities alone rule everything out).
        """
        if self.plain and threshold >= self.largest_layer:
            return self._furthest_first(threshold)
        num_layers, num_stages = self.num_layers, self.num_stages
        exit_, entry = self.exit, self.entry
        previous = [-1] * (num_layers + 1)  # previous[a] >= 0: boundary a reachable after j - 1 stages
        previous[0] = 0
        paths: list[list[int]] = []
        next_threshold: Optional[int] = None
        for stage in range(1, num_stages + 1):
            first = self.first[stage - 1]
            # Every stage needs a layer: after `stage` stages the boundary lies in [stage, L - (k - stage)].
            lowest = num_layers if stage == num_stages else stage
            highest = num_layers - (num_stages - stage)
            reached = [-1] * (num_layers + 1)
            window: deque[int] = deque()  # reachable starts, entry[] decreasing from the left
            candidate = stage - 1
            any_reached = False
            for boundary in range(lowest, highest + 1):
                while candidate < boundary:
                    if previous[candidate] >= 0:
                        value = entry[candidate]
                        while window and entry[window[-1]] <= value:
                            window.pop()
                        window.append(candidate)
                    candidate += 1
                if first is not None:
                    start_limit = first[boundary]
                    while window and window[0] < start_limit:
                        window.popleft()
                if not window:
                    continue
                best_start = window[0]
                cost = exit_[boundary] - entry[best_start]
                if cost <= threshold:
                    reached[boundary] = best_start
                    any_reached = True
                elif next_threshold is None or cost < next_threshold:
                    next_threshold = cost
            if not any_reached:
                return False, next_threshold
            previous = reached
            if keep_path:
                paths.append(reached)
        if not keep_path:
            return True, None
        bottleneck = 0
        boundary = num_layers
        for reached in reversed(paths):
            start = reached[boundary]
            bottleneck = max(bottleneck, exit_[boundary] - entry[start])
            boundary = start
        return True, bottleneck

    def _furthest_first(self, threshold: float) -> tuple[bool, Optional[int]]:
        """:meth:`probe` of a plain instance (no cut costs, no capacities) with every layer within ``threshold``:
        the boundaries reachable after ``j`` stages are then ``j`` up to the furthest, so each stage ends as far
        as it can while leaving a layer for each stage after it (``k`` binary searches, not ``k`` passes). A
        threshold that fails answers the next integer: any feasible threshold is above it."""
        prefix, num_layers, num_stages = self.exit, self.num_layers, self.num_stages  # no cuts: the prefix sums
        start, bottleneck = 0, 0
        for stage in range(1, num_stages):
            highest = num_layers - (num_stages - stage)
            if threshold == INFINITE:  # exact integers can be beyond any float: no sum with infinity
                end = highest
            else:
                end = bisect_right(prefix, prefix[start] + threshold, start + 1, highest + 1) - 1
            bottleneck = max(bottleneck, prefix[end] - prefix[start])
            start = end
        last = prefix[num_layers] - prefix[start]
        if last > threshold:
            return False, int(threshold) + 1
        return True, max(bottleneck, last)

    def optimum(self) -> Optional[int]:
        """The smallest achievable bottleneck, or None when no split fits the capacities."""
        feasible, upper = self.probe(INFINITE)
        if not feasible:
            return None
        assert upper is not None
        # Every stage holds some layer, and the k stage costs add up to at least the total.
        lower = max(self.largest_layer, -(-self.total // self.num_stages))
        while lower < upper:
            middle = (lower + upper) // 2
            feasible, value = self.probe(middle)
            assert value is not None, "a feasible split exists, so some threshold must help"
            if feasible:
                upper = value  # <= middle < upper
            else:
                lower = value  # > middle >= lower
        return upper

    def smallest_sizes(self, threshold: float) -> list[int]:
        """The lexicographically smallest sizes among splits with every stage cost <= ``threshold``."""
        num_layers, num_stages = self.num_layers, self.num_stages
        exit_, entry = self.exit, self.entry
        # completable[j][a]: layers a.. can form stages j+1..k within the threshold.
        completable: list[list[bool]] = [[]] * (num_stages + 1)
        last = [False] * (num_layers + 1)
        last[num_layers] = True
        completable[num_stages] = last
        for stage in range(num_stages, 0, -1):
            ends = completable[stage]
            first = self.first[stage - 1]
            starts = [False] * (num_layers + 1)
            lowest_start = stage - 1
            highest_start = num_layers - (num_stages - stage + 1)
            # Ends b of stage `stage` starting at a: a < b <= furthest(a), furthest = last b with first[b] <= a.
            # As a decreases both limits decrease: a sliding window minimum of exit[] over usable ends.
            window: deque[int] = deque()  # usable ends, decreasing b from the left, exit[] increasing
            furthest = num_layers
            for start in range(num_layers - 1, lowest_start - 1, -1):
                end = start + 1
                if ends[end]:
                    value = exit_[end]
                    while window and exit_[window[-1]] >= value:
                        window.pop()
                    window.append(end)
                if first is not None:
                    while furthest > start and first[furthest] > start:
                        furthest -= 1
                    while window and window[0] > furthest:
                        window.popleft()
                if start > highest_start:
                    continue  # too few layers left for the later stages; its end is admitted all the same
                if window and exit_[window[0]] - entry[start] <= threshold:
                    starts[start] = True
            completable[stage - 1] = starts
        if not completable[0][0]:
            raise AssertionError(f"no split within {threshold}: the optimum was computed wrongly")
        sizes = []
        start = 0
        for stage in range(1, num_stages + 1):
            first = self.first[stage - 1]
            ends = completable[stage]
            end = start + 1
            while not (ends[end] and (first is None or first[end] <= start) and exit_[end] - entry[start] <= threshold):
                end += 1
            sizes.append(end - start)
            start = end
        return sizes


def _window_starts(prefix: list[int], limit: int) -> list[int]:
    """For each boundary b, the smallest a with ``prefix[b] - prefix[a] <= limit`` (b itself when none)."""
    starts = [0] * len(prefix)
    start = 0
    for boundary, total in enumerate(prefix):
        while total - prefix[start] > limit:
            start += 1
        starts[boundary] = start
    return starts


# ----------------------------------------------------------------------------- infeasible capacities
def _explain_infeasible(memory: list[float], capacities: list[float]) -> str:
    """Why no split fits, as precisely as is true: one layer, the total, or the least overflow."""
    num_layers, num_stages = len(memory), len(capacities)
    shown_capacities = "[" + ", ".join(show(c) for c in capacities) + "]"
    fix = "use more stages, give the stages more memory, or make the layers lighter (activation checkpointing)"
    (memory_units, finite_units), denominator = common_units([memory, [c for c in capacities if c != INFINITE]])
    capacity_of = capacity_units(capacities, finite_units)

    # One layer that fits on none of the stages that could hold it: every stage needs a
    # layer, so layer i can only be on stages max(0, k - (L - i)) .. min(k - 1, i).
    for layer, amount in enumerate(memory_units):
        low, high = max(0, num_stages - (num_layers - layer)), min(num_stages - 1, layer)
        limits = capacity_of[low : high + 1]
        if any(limit is None or amount <= limit for limit in limits):
            continue
        if len(set(capacities)) == 1:
            where = f"every stage's capacity is {show(capacities[0])}"
        elif low == 0 and high == num_stages - 1:
            where = f"no stage holds that much (capacities {shown_capacities})"
        elif low == high:
            where = (
                f"it can only go on stage {low} (every stage needs at least one layer), "
                f"whose capacity is {show(capacities[low])}"
            )
        else:
            shown = ", ".join(show(c) for c in capacities[low : high + 1])
            where = (
                f"it can only go on stages {low} to {high} (every stage needs at least one layer), "
                f"whose capacities are [{shown}]"
            )
        return f"layer {layer} alone needs memory {show(memory[layer])} but {where}; {fix}"

    finite_capacities = [limit for limit in capacity_of if limit is not None]
    if len(finite_capacities) == num_stages and sum(memory_units) > sum(finite_capacities):
        return (
            f"the {num_layers} layers need memory {show(math.fsum(memory))} in total but the {num_stages} stages "
            f"hold {show(math.fsum(capacities))} together (capacities {shown_capacities}); {fix}"
        )

    overflow_units, sizes = _least_overflow(memory_units, capacity_of, num_stages)
    overflow = show(overflow_units / denominator)
    ends = list(accumulate(sizes, initial=0))
    needs = [show(math.fsum(memory[start:stop])) for start, stop in zip(ends, ends[1:])]
    return (
        f"no way to place {num_layers} layers on {num_stages} stages within capacities {shown_capacities}: "
        f"every split overflows some stage by at least {overflow} (the best, sizes {sizes}, needs "
        f"[{', '.join(needs)}]); raising every capacity by {overflow} would make it fit. Or {fix}"
    )


def _least_overflow(
    memory_units: list[int], capacity_of: list[Optional[int]], num_stages: int
) -> tuple[int, list[int]]:
    """Smallest X (memory units) such that capacities + X admit a split, and that split."""

    def problem(extra: int) -> _Problem:
        raised = [None if c is None else c + extra for c in capacity_of]
        return _Problem([0] * len(memory_units), None, num_stages, memory_units, raised)

    lower, upper = 1, max(1, sum(memory_units))  # with +total memory every stage fits anything
    while lower < upper:
        middle = (lower + upper) // 2
        if problem(middle).probe(INFINITE, keep_path=False)[0]:
            upper = middle
        else:
            lower = middle + 1
    return upper, problem(upper).smallest_sizes(INFINITE)
