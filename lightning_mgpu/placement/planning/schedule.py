"""Pipeline schedules as data: each stage's ordered list of actions, made by a pure function (no torch).

An :class:`Action` is one piece of a stage's work on one micro-batch: ``F`` (its forward),
``B`` (its backward; with :func:`zero_bubble`, only the gradient with respect to the
stage's inputs) or ``W`` (the gradient with respect to the stage's weights, split off
``B`` so that it can wait). A schedule is a list with one action list per stage;
:class:`~lightning_mgpu.placement.running.worker.StageWorkers` runs any such lists, each stage in its
own thread, a forward's output going to the next stage and a backward's input gradient
to the previous one. A new schedule is a new generator here, not a new executor.

    >>> fill_drain(2, 3)
    [[F0, F1, F2, B2, B1, B0], [F0, F1, F2, B2, B1, B0]]
    >>> phase(fill_drain(2, 3), FORWARD)
    [[F0, F1, F2], [F0, F1, F2]]
    >>> one_f_one_b(2, 4)
    [[F0, F1, B0, F2, B1, F3, B2, B3], [F0, B0, F1, B1, F2, B2, F3, B3]]
    >>> zero_bubble(2, 3)
    [[F0, F1, F2, B0, W0, B1, W1, B2, W2], [F0, B0, F1, B1, W0, F2, B2, W1, W2]]

The three schedules (``SCHEDULES``):

* ``"gpipe"`` (:func:`fill_drain`): all forwards, then all backwards. A stage holds the
  activations of all ``M`` micro-batches at once.
* ``"1f1b"`` (:func:`one_f_one_b`, PipeDream-flush): stage ``j`` runs ``K - 1 - j``
  forwards ahead, then alternates one forward and one backward. Stage ``j`` holds at most
  ``K - j`` micro-batches of activations (``K`` at most), whatever ``M`` is; same bubble as
  GPipe.
* ``"zero_bubble"`` (:func:`zero_bubble`, ZB-H1 of Qi et al., ICLR 2024): as 1F1B, but the
  backward is split into ``B`` (input gradient: what the previous stage waits for) and
  ``W`` (weight gradient: nobody waits for it), and the ``W`` passes fill the gaps where a
  stage would otherwise wait. A micro-batch's activations stay until its ``W`` ran, and
  stage ``j`` holds at most ``K - j + 1`` of them (one more than 1F1B: with unit times
  that extra one is what closes the bubble, ``3M + K - 1`` slots instead of 1F1B's
  ``3(M + K - 1)``), still independent of ``M``.

The orders come from :func:`simulate`, an event-driven run of the stages with given
action times (unit times by default): every stage runs, whenever it is free, a ready
``B`` first, else a ``F`` if it holds fewer micro-batches than its limit, else a pending
``W``. :func:`check_schedule` runs any schedule against the pipeline's dependencies and
says why it would deadlock or is incomplete.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Callable, NamedTuple, Optional

__all__ = [
    "BACKWARD",
    "FORWARD",
    "SCHEDULES",
    "WEIGHT",
    "Action",
    "Schedule",
    "check_schedule",
    "fill_drain",
    "make_schedule",
    "one_f_one_b",
    "peak_in_flight",
    "phase",
    "simulate",
    "zero_bubble",
]

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"


class Action(NamedTuple):
    """Run ``kind`` (:data:`FORWARD`, :data:`BACKWARD` or :data:`WEIGHT`) of one stage on micro-batch ``microbatch``."""

    kind: str
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Schedule = list[list[Action]]
"""``schedule[stage]``: that stage's actions, in the order it runs them."""


def fill_drain(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe's schedule: every stage runs all forwards in order, then all backwards in reverse order."""
    actions = [Action(FORWARD, i) for i in range(num_microbatches)]
    actions += [Action(BACKWARD, i) for i in reversed(range(num_microbatches))]
    return [list(actions) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): ``K - 1 - j`` forwards ahead on stage ``j``, then one forward, one backward."""
    schedule: Schedule = []
    for stage in range(num_stages):
        ahead = min(num_stages - 1 - stage, num_microbatches)
        actions = [Action(FORWARD, i) for i in range(ahead)]
        for i in range(num_microbatches - ahead):
            actions += [Action(FORWARD, ahead + i), Action(BACKWARD, i)]
        actions += [Action(BACKWARD, i) for i in range(num_microbatches - ahead, num_microbatches)]
        schedule.append(actions)
    return schedule


def zero_bubble(num_stages: int, num_microbatches: int, *, times: Optional[Mapping[str, float]] = None) -> Schedule:
    """ZB-H1: 1F1B's memory bound, backward split into ``B`` and ``W``, ``W`` s deferred into the gaps."""
    return simulate(
        num_stages, num_microbatches, split_weight=True, times=times, limit=lambda stage: num_stages - stage + 1
    )[0]


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": fill_drain,
    "1f1b": one_f_one_b,
    "zero_bubble": zero_bubble,
}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`) for K stages and M micro-batches."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {name!r}")
    for what, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return SCHEDULES[name](num_stages, num_microbatches)


def phase(schedule: Schedule, kind: str) -> Schedule:
    """The schedule restricted to actions of one ``kind``, each stage's order kept."""
    return [[action for action in actions if action.kind == kind] for actions in schedule]


def simulate(
    num_stages: int,
    num_microbatches: int,
    *,
    split_weight: bool,
    times: Optional[Mapping[str, float]] = None,
    limit: Optional[Callable[[int], int]] = None,
) -> tuple[Schedule, float]:
    """Greedy event-driven pipeline run: (each stage's order, makespan). See the module docstring.

    ``times``: duration of ``F``, ``B`` and ``W`` (defaults 1, 1, 1; without ``split_weight``
    a ``B`` takes ``B + W``). ``limit(stage)``: how many micro-batches a stage may hold (from
    its ``F`` to the end of its backward), default ``K - stage``.
    """
    k, m = num_stages, num_microbatches
    cost = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0, **(times or {})}
    if not split_weight:
        cost[BACKWARD] += cost[WEIGHT]
    hold = limit or (lambda stage: k - stage)
    order: Schedule = [[] for _ in range(k)]
    free_at = [0.0] * k
    next_f = [0] * k
    held = [0] * k
    forward_done: list[dict[int, float]] = [{} for _ in range(k)]  # stage -> micro-batch -> finish time
    backward_done: list[dict[int, float]] = [{} for _ in range(k)]
    pending_w: list[list[int]] = [[] for _ in range(k)]
    started_b: list[set[int]] = [set() for _ in range(k)]

    def pick(stage: int, clock: float) -> Optional[Action]:
        # B first (the previous stage waits for it), in micro-batch order.
        for i in sorted(forward_done[stage]):
            if i in started_b[stage] or forward_done[stage][i] > clock:
                continue
            if stage == k - 1 or backward_done[stage + 1].get(i, float("inf")) <= clock:
                return Action(BACKWARD, i)
            break  # the oldest micro-batch's gradient is not there yet: keep the order
        i = next_f[stage]
        arrived = stage == 0 or forward_done[stage - 1].get(i, float("inf")) <= clock
        if i < m and held[stage] < hold(stage) and arrived:
            return Action(FORWARD, i)
        if pending_w[stage]:
            return Action(WEIGHT, pending_w[stage][0])
        return None

    total = k * m * (3 if split_weight else 2)
    clock = 0.0
    events: list[float] = [0.0]
    while sum(len(actions) for actions in order) < total:
        clock = heapq.heappop(events) if events else clock
        progressed = True
        while progressed:
            progressed = False
            for stage in range(k):
                if free_at[stage] > clock:
                    continue
                action = pick(stage, clock)
                if action is None:
                    continue
                end = clock + cost[action.kind]
                order[stage].append(action)
                free_at[stage] = end
                i = action.microbatch
                if action.kind == FORWARD:
                    next_f[stage] += 1
                    held[stage] += 1
                    forward_done[stage][i] = end
                elif action.kind == BACKWARD:
                    started_b[stage].add(i)
                    backward_done[stage][i] = end
                    if split_weight:
                        pending_w[stage].append(i)
                    else:
                        held[stage] -= 1
                else:
                    pending_w[stage].remove(i)
                    held[stage] -= 1
                heapq.heappush(events, end)
                progressed = True
        if not events and sum(len(actions) for actions in order) < total:  # pragma: no cover - the rules never stall
            raise RuntimeError("schedule simulation stalled")
    return order, max(free_at)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once (from ``F`` to the end of its backward)."""
    peaks = []
    for actions in schedule:
        splits = any(action.kind == WEIGHT for action in actions)
        held = peak = 0
        for action in actions:
            if action.kind == FORWARD:
                held += 1
                peak = max(peak, held)
            elif action.kind == (WEIGHT if splits else BACKWARD):
                held -= 1
        peaks.append(peak)
    return peaks


def check_schedule(schedule: Schedule, num_microbatches: int) -> None:
    """Raise ``ValueError`` unless every stage runs each micro-batch's ``F``, ``B`` (and, if any, ``W``) exactly once,
    in that order, and the stages can run their lists without waiting on each other forever."""
    k = len(schedule)
    for stage, actions in enumerate(schedule):
        kinds = {action.kind for action in actions}
        wanted = {FORWARD, BACKWARD} | ({WEIGHT} if WEIGHT in kinds else set())
        if not kinds <= {FORWARD, BACKWARD, WEIGHT}:
            raise ValueError(f"stage {stage}: unknown action kinds {sorted(kinds - {FORWARD, BACKWARD, WEIGHT})}")
        expected = sorted(Action(kind, i) for kind in wanted for i in range(num_microbatches))
        if sorted(actions) != expected:
            raise ValueError(
                f"stage {stage} must run each of {sorted(wanted)} once for micro-batches 0..{num_microbatches - 1}, "
                f"got {actions}"
            )
        position = {action: n for n, action in enumerate(actions)}
        for i in range(num_microbatches):
            if position[Action(BACKWARD, i)] < position[Action(FORWARD, i)]:
                raise ValueError(f"stage {stage}: B{i} comes before F{i}")
            if WEIGHT in wanted and position[Action(WEIGHT, i)] < position[Action(BACKWARD, i)]:
                raise ValueError(f"stage {stage}: W{i} comes before B{i}")
    done: set[tuple[int, Action]] = set()
    cursor = [0] * k
    while any(cursor[stage] < len(schedule[stage]) for stage in range(k)):
        moved = False
        for stage in range(k):
            while cursor[stage] < len(schedule[stage]):
                action = schedule[stage][cursor[stage]]
                source = {FORWARD: stage - 1, BACKWARD: stage + 1}.get(action.kind, -1)  # the stage it waits on
                if 0 <= source < k and (source, action) not in done:
                    break
                done.add((stage, action))
                cursor[stage] += 1
                moved = True
        if not moved:
            waiting = {
                stage: schedule[stage][cursor[stage]] for stage in range(k) if cursor[stage] < len(schedule[stage])
            }
            raise ValueError(f"the schedule deadlocks: each stage waits on another, next actions {waiting}")
