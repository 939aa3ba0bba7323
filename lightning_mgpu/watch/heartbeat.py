"""What the main thread is doing, kept in plain attribute writes that the watch thread reads: phase, batch, collective.

The main thread only assigns attributes here (a few per Lightning hook, two per collective): no lock,
no clock read outside a collective, nothing that could block. The watch thread reads them once a
second; under the GIL each read sees a whole value, and two fields read a hook apart blur the
picture by one hook at most.

Phases (:data:`PHASES`) belong to *families*: ranks blocked in one family are excused by a rank
still working in the same family (rank 0 writing a checkpoint while the others wait at the barrier
after it), never by a rank working in another (rank 0 still validating while the others train).
"""

from __future__ import annotations

import time
from typing import Any, Optional

__all__ = ["PHASES", "Heartbeat", "family"]

PHASES: dict[str, tuple[str, str]] = {
    # phase: (family, in words)
    "setup": ("setup", "setting up"),
    "data_fetch": ("train", "between training batches"),
    "forward": ("train", "in training_step"),
    "backward": ("train", "in backward"),
    "optimizer": ("train", "in the optimizer step"),
    "train_epoch_end": ("train", "at the end of a training epoch"),
    "train_end": ("train", "at the end of training"),
    "validation": ("validation", "in validation"),
    "checkpoint_save": ("checkpoint", "saving a checkpoint"),
    "test": ("test", "in test"),
    "predict": ("predict", "in predict"),
    "teardown": ("end", "tearing down"),
    "failed": ("end", "failing with an exception"),
    "after_run": ("end", "past the end of its run"),
}
"""Every phase a rank reports, its family and how the report says it."""


def family(phase: str) -> str:
    return PHASES.get(phase, (phase, phase))[0]


class Heartbeat:
    """One rank's state, written by its main thread (see the module docstring)."""

    def __init__(self) -> None:
        self.reset(stage=None)

    def reset(self, *, stage: Optional[str]) -> None:
        self.stage = stage
        """``fit``, ``validate``, ``test`` or ``predict``: the Trainer call this rank is in (None: none)."""
        self.phase = "setup"
        self.epoch = 0
        self.step = 0
        """The Trainer's global step (optimizer steps)."""
        self.batch: Optional[int] = None
        """The batch index in the current loop (training, validation, ...), from 0."""
        self.batches: Optional[int] = None
        """How many batches that loop has on this rank (None: unknown or infinite)."""
        self.batches_done = 0
        """Training batches finished in this run."""
        self.backwards = 0
        self.progress = 0
        """Bumped at every phase change, batch and collective exit: the watch's first sign of progress."""
        self.collectives = 0
        """Collectives entered from the main thread (their sequence numbers, from 1)."""
        self.collective: Optional[tuple[str, int, int, float]] = None
        """The collective the main thread is in: (kind, sequence number, group size, monotonic entry time)."""
        self.last_collective: Optional[tuple[str, int]] = None
        self.failure: Optional[str] = None

    # ------------------------------------------------------------------ phases (main thread)

    def enter_phase(self, phase: str, *, batch: Optional[int] = None, batches: Optional[int] = None) -> None:
        self.phase = phase
        if batch is not None:
            self.batch, self.batches = batch, batches
        self.progress += 1

    def backward_started(self) -> None:
        self.backwards += 1
        self.enter_phase("backward")

    def batch_finished(self, *, step: int) -> None:
        self.batches_done += 1
        self.step = step
        self.enter_phase("data_fetch")

    # ------------------------------------------------------------------ collectives (main thread)

    def entered(self, kind: str, group_size: int) -> None:
        self.collectives += 1
        self.collective = (kind, self.collectives, group_size, time.monotonic())

    def left(self) -> None:
        current = self.collective
        if current is not None:
            self.last_collective = (current[0], current[1])
        self.collective = None
        self.progress += 1

    # ------------------------------------------------------------------ reading (watch thread)

    def snapshot(self) -> dict[str, Any]:
        """The fields as plain data, the collective's entry time turned into seconds spent in it."""
        collective = self.collective
        last = self.last_collective
        return {
            "stage": self.stage,
            "phase": self.phase,
            "epoch": self.epoch,
            "step": self.step,
            "batch": self.batch,
            "batches": self.batches,
            "batches_done": self.batches_done,
            "backwards": self.backwards,
            "collectives": self.collectives,
            "collective": None
            if collective is None
            else {
                "kind": collective[0],
                "seq": collective[1],
                "group_size": collective[2],
                "for_s": round(time.monotonic() - collective[3], 1),
            },
            "last_collective": None if last is None else {"kind": last[0], "seq": last[1]},
            "failure": self.failure,
        }
