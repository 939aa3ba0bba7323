"""One micro-batch of the staged pipeline: the user's code runs in a thread of its own, taking turns with the stages.

A micro-batch's Python call stack cannot move between threads, so the staged pipeline
(:class:`~lightning_mgpu.placement.running.engine.StagedStep`) runs each micro-batch's function in
its own thread and lets the stages' worker threads decide when it may go on: at each split
point the micro-batch's thread calls :meth:`MicroRun.arrive` and waits there until the
stage that begins at that point calls :meth:`MicroRun.grant`; that stage's worker waits in
:meth:`MicroRun.wait_reached` until the thread reaches the next split point (or returns).
So a stage never runs two things at once, and the user's code runs unchanged.

:class:`MicroRun` also holds what the micro-batch's backward needs: the tensors that
crossed each split point (:class:`Cut`), the gradient edges they came from, the loss, and
what zero-bubble's deferred weight passes need.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["Aborted", "Cut", "MicroRun", "StagedStepError", "current_microbatch", "current_run", "running"]

_LOCAL = threading.local()


class StagedStepError(RuntimeError):
    """The model's code does something the staged pipeline cannot run; the message says what and how to fix it."""


class Aborted(BaseException):
    """Unwinds a micro-batch thread whose step was abandoned (another stage failed)."""


@dataclass
class Cut:
    """A tensor that crossed a split point: the original's gradient edge, and the new leaf the next stage got."""

    key: tuple[int, int]  # the source's identity: (id of its grad_fn, output number)
    source_stage: int
    leaf: torch.Tensor


@dataclass
class MicroRun:
    """One micro-batch's run through the stages: its turn-taking state and what its backward needs."""

    index: int
    weight: float
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    num_stages: int
    owner: object = None  # the StagedStep running it (another one's hooks leave it alone)
    cond: threading.Condition = field(default_factory=threading.Condition)
    granted: int = -1  # the segment the thread may run
    reached: int = 0  # the split point the thread waits at (num_stages: the function returned)
    error: Optional[BaseException] = None
    aborted: bool = False
    result: Any = None
    loss: Optional[torch.Tensor] = None
    trains: bool = False  # the loss needs a backward
    cuts: list[list[Cut]] = field(default_factory=list)  # cuts[j]: the leaves made when entering stage j
    sources: dict[tuple[int, int], tuple[int, GradientEdge]] = field(default_factory=dict)
    leaf_stage: dict[int, int] = field(default_factory=dict)  # id(leaf) -> its stage (pass-through detection)
    deferred: dict[int, Any] = field(default_factory=dict)  # stage -> what its W pass needs
    claimed: dict[Any, int] = field(default_factory=dict)  # autograd node -> the stage whose split backward reached it
    splitting: int = -1  # the stage running this micro-batch's split backward (B) now, if any
    linear_deferred: dict[int, list[Any]] = field(default_factory=dict)  # stage -> nn.Linear weight gradients for W

    def __post_init__(self) -> None:
        if not self.cuts:
            self.cuts = [[] for _ in range(self.num_stages)]

    # --- the hand-over between a stage's worker (grant, wait_reached) and the micro-batch's thread (arrive)
    def grant(self, segment: int) -> None:
        with self.cond:
            self.granted = segment
            self.cond.notify_all()

    def wait_reached(self, boundary: int) -> None:
        with self.cond:
            while self.reached < boundary and self.error is None and not self.aborted:
                self.cond.wait()
            if self.error is not None:
                raise self.error
            if self.aborted:
                raise Aborted()

    def arrive(self, boundary: int) -> None:
        """Called by the micro-batch's thread at a split point: segment ``boundary - 1`` is done; wait for its turn."""
        with self.cond:
            self.reached = boundary
            self.cond.notify_all()
            if boundary >= self.num_stages:
                return
            while self.granted < boundary and not self.aborted:
                self.cond.wait()
            if self.aborted:
                raise Aborted()

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            self.error = exc
            self.cond.notify_all()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()


@contextmanager
def running(micro: MicroRun) -> Iterator[None]:
    """Mark the calling thread as running ``micro`` (what the split-point hooks and ``self.log`` look at)."""
    _LOCAL.micro = micro
    try:
        yield
    finally:
        _LOCAL.micro = None


def current_run() -> Optional[MicroRun]:
    """The micro-batch the calling thread runs, or None outside a staged step."""
    micro: Optional[MicroRun] = getattr(_LOCAL, "micro", None)
    return micro


def current_microbatch() -> Optional[tuple[int, float]]:
    """``(index, share of the batch)`` of the micro-batch the calling thread runs, or None outside a staged step."""
    micro = current_run()
    return None if micro is None else (micro.index, micro.weight)
