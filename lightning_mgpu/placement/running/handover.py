"""One micro-batch in the pipeline: the user's code runs in a thread of its own, taking turns with the stages.

A micro-batch's Python call stack cannot move between threads, so the pipeline
(:class:`~lightning_mgpu.placement.running.engine.Pipeline`) runs each micro-batch's function in
its own thread and lets the stages' worker threads decide when it may go on: at each split
point the micro-batch's thread calls :meth:`MicroRun.arrive` and waits there until the
stage that begins at that point calls :meth:`MicroRun.grant`; that stage's worker waits in
:meth:`MicroRun.wait_reached` until the thread reaches the next split point (or returns).
So a stage never runs two things at once, and the user's code runs unchanged.

:class:`MicroRun` also holds what the micro-batch's backward needs: the tensors that
crossed each split point (:class:`Cut`), the gradient edges they came from, the loss, and
what zero-bubble's deferred weight passes need. :class:`CopyStreams` moves what crosses a split
point to the next stage's device (on CUDA through a copy stream per destination device).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.autograd.graph import GradientEdge

__all__ = [
    "Aborted",
    "CopyStreams",
    "Cut",
    "MicroRun",
    "PipelineModelError",
    "current_microbatch",
    "current_run",
    "current_stage",
    "running",
]

_LOCAL = threading.local()


class PipelineModelError(RuntimeError):
    """The model's code does something the pipeline cannot run; the message says what and how to fix it."""


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
    owner: object = None  # the Pipeline running it (another one's hooks leave it alone)
    recompute: bool = False  # its stage forwards run again in backward (activation checkpointing)
    loss_inside: bool = True  # the function's result is the loss (else an output, whose gradient comes from outside)
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
        """Called by a stage's worker: wait until the micro-batch's thread has reached ``boundary`` (or failed)."""
        with self.cond:
            self._wait(lambda: self.reached >= boundary)

    def arrive(self, boundary: int) -> None:
        """Called by the micro-batch's thread at a split point: segment ``boundary - 1`` is done; wait for its turn."""
        with self.cond:
            self.reached = boundary
            self.cond.notify_all()
            if boundary < self.num_stages:
                self._wait(lambda: self.granted >= boundary)

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Holding ``cond``: wait until ``ready()``; a failed micro-batch raises its error, an abandoned step Aborted."""
        self.cond.wait_for(lambda: ready() or self.error is not None or self.aborted)
        if self.error is not None:
            raise self.error
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
def running(micro: MicroRun, stage: Optional[int] = None) -> Iterator[None]:
    """Mark the calling thread as running ``micro`` (what the split-point hooks, the ``nn.Linear`` fast path, shared
    parameters and ``self.log`` look at); ``stage``: as that stage (a forward recomputed in a backward), else the
    segment the micro-batch has reached."""
    previous = getattr(_LOCAL, "where", None)
    _LOCAL.where = (micro, stage)
    try:
        yield
    finally:
        _LOCAL.where = previous


def current_run() -> Optional[MicroRun]:
    """The micro-batch the calling thread runs, or None outside a pipelined step."""
    where: Optional[tuple[MicroRun, Optional[int]]] = getattr(_LOCAL, "where", None)
    return None if where is None else where[0]


def current_stage() -> int:
    """The stage whose code the calling thread runs (call only where :func:`current_run` is not None)."""
    micro, stage = _LOCAL.where
    return micro.reached if stage is None else stage  # type: ignore[no-any-return]


def current_microbatch() -> Optional[tuple[int, float]]:
    """``(index, share of the batch)`` of the micro-batch the calling thread runs, or None outside a pipelined step."""
    micro = current_run()
    return None if micro is None else (micro.index, micro.weight)


class CopyStreams:
    """Moves tensors across stage boundaries, keeping one copy stream per CUDA device.

    A copy to a GPU runs on that device's copy stream, so it overlaps with the stages' kernels;
    the consumer's current stream waits for it, and both tensors are recorded on the streams
    that use them so that the caching allocator does not reuse them too early. Anything else
    (to the CPU, between CPU stages) is a plain ``tensor.to(device)``.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def move(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device`` (itself if already there)."""
        if tensor.device == device:
            return tensor
        if device.type != "cuda":
            return tensor.to(device)  # device -> host (or cpu -> cpu-like): a plain, synchronous copy
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # untyped in torch
        consumer = torch.cuda.current_stream(device)
        if tensor.is_cuda:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            moved = tensor.to(device, non_blocking=True)
        consumer.wait_stream(stream)
        if tensor.is_cuda:
            tensor.record_stream(stream)
        moved.record_stream(consumer)
        return moved
