"""Pipeline schedules as data: each stage's ordered list of actions, made by a pure function (no torch).

An :class:`Action` is one piece of a stage's work on one micro-batch: ``F`` (its forward)
or ``B`` (its backward). A schedule is a list with one action list per stage;
:class:`~lightning_mgpu.placement.worker.StageWorkers` runs any such lists, each stage in its
own thread, a forward's output going to the next stage and a backward's input gradient
to the previous one. A new schedule is a new generator here, not a new executor.

    >>> fill_drain(2, 3)
    [[F0, F1, F2, B2, B1, B0], [F0, F1, F2, B2, B1, B0]]
    >>> phase(fill_drain(2, 3), FORWARD)
    [[F0, F1, F2], [F0, F1, F2]]

:class:`~lightning_mgpu.placement.pipeline.Pipeline` runs a schedule's ``F`` actions in
``forward`` and its ``B`` actions in ``backward`` (the loss is computed between them by
the caller's code); micro-batches are numbered in forward order across every forward
call whose backward is pending.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BACKWARD", "FORWARD", "Action", "Schedule", "fill_drain", "phase"]

FORWARD = "F"
BACKWARD = "B"


class Action(NamedTuple):
    """Run ``kind`` (:data:`FORWARD` or :data:`BACKWARD`) of one stage on micro-batch ``microbatch``."""

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


def phase(schedule: Schedule, kind: str) -> Schedule:
    """The schedule restricted to actions of one ``kind``, each stage's order kept."""
    return [[action for action in actions if action.kind == kind] for actions in schedule]
