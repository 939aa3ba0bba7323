"""Timing DDP's gradient communication, bucket by bucket, without disturbing it.

The pieces:

* :class:`HostClock` / :class:`CudaClock` make *stamps*: a host time on CPU, a recorded
  ``torch.cuda.Event`` on GPU. Stamps are resolved to milliseconds later, at step end
  (host) or one step later (CUDA events: no synchronize per bucket, none on the hot path).
* :class:`BucketTimer` wraps a DDP communication hook. On the autograd thread it stamps the
  bucket's launch; a ``Future.then`` callback (on gloo's thread: kept to one stamp and one
  list append) stamps its completion.
* :func:`step_breakdown` turns one step's marks and bucket intervals into the numbers the
  profiler reports: communication span, backward compute, exposed communication, overlap.

Definitions (times in ms, relative to the step's start):

* backward compute ends when autograd has finished the backward graph: stamped by an
  autograd-engine callback queued at the first bucket, which runs just before DDP's own
  finalize callback (so it is the instant DDP's logging calls ``backward_compute_end``);
  never earlier than the last bucket's launch;
* communication span: first bucket launched -> last bucket done;
* busy communication: the union of the bucket intervals (buckets may run concurrently);
* exposed communication: the part of the span after backward compute ended;
* overlap ratio: the share of the span hidden behind backward compute;
* with gradient accumulation, the optimizer step is every micro-batch of its accumulation
  window: the ones that do not communicate (:class:`MicroBatch`, DDP's ``no_sync``) and the
  synchronising one (the :class:`StepTimeline` itself), each from its start to its end (as
  ``step_ms``, the data loading between batches is not counted).

No ``from __future__ import annotations``: DDP inspects the wrapped hook's annotations.
"""

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_mgpu._compat.torch import queue_autograd_callback
from lightning_mgpu.comm.compression import CommHook, PrescaledAllreduce

Stamp = Union[int, "torch.cuda.Event"]


# ----------------------------------------------------------------------------- clocks


class HostClock:
    """Stamps are ``time.perf_counter_ns()``; valid on CPU, where work is synchronous."""

    device_type = "cpu"

    def stamp(self) -> Stamp:
        return time.perf_counter_ns()

    def ready(self, stamp: Stamp) -> bool:
        return True

    def elapsed_ms(self, start: Stamp, end: Stamp) -> float:
        assert isinstance(start, int) and isinstance(end, int)
        return (end - start) / 1e6


class CudaClock:
    """Stamps are CUDA events recorded on the current stream; read them after the step."""

    device_type = "cuda"

    def stamp(self) -> Stamp:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def ready(self, stamp: Stamp) -> bool:
        assert not isinstance(stamp, int)
        return bool(stamp.query())  # type: ignore[no-untyped-call]

    def elapsed_ms(self, start: Stamp, end: Stamp) -> float:
        assert not isinstance(start, int) and not isinstance(end, int)
        end.synchronize()
        return float(start.elapsed_time(end))


Clock = Union[HostClock, CudaClock]


def clock_for(device: torch.device) -> Clock:
    return CudaClock() if device.type == "cuda" else HostClock()


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class BucketInterval:
    """One bucket's communication in one step, in ms from the step's start."""

    index: int
    bytes: int
    wire_bytes: int
    num_params: int
    launch_ms: float
    done_ms: float

    @property
    def duration_ms(self) -> float:
        return self.done_ms - self.launch_ms


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of an accumulation window that did not communicate (DDP's ``no_sync``),
    in ms from its own start."""

    start_ns: int
    """Host time of its start (perf_counter_ns), to place it on the step's axis."""
    forward_end_ms: float
    backward_end_ms: float
    """When its backward ended (no bucket is reduced: all of it is compute)."""
    end_ms: float
    """When the batch ended (``on_train_batch_end``): the micro-batch's whole time."""

    @property
    def compute_ms(self) -> float:
        """Forward and backward: what a faster device would shorten."""
        return self.backward_end_ms


@dataclass(frozen=True)
class StepTimeline:
    """Everything measured in one synchronising step on one rank (ms from the step's start)."""

    step: int
    rank: int
    start_ns: int
    """Host time of the step's start (perf_counter_ns), to place steps on a common axis."""
    forward_end_ms: float
    compute_end_ms: Optional[float]
    """When autograd finished the backward graph (None: no DDP bucket fired)."""
    backward_end_ms: float
    optimizer_start_ms: float
    step_ms: float
    buckets: tuple[BucketInterval, ...] = field(default_factory=tuple)
    micro_batches: tuple[MicroBatch, ...] = field(default_factory=tuple)
    """The accumulation window's micro-batches before this one, which did not communicate
    (empty without gradient accumulation)."""

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["buckets"] = [asdict(b) for b in self.buckets]
        data["micro_batches"] = [asdict(m) for m in self.micro_batches]
        return data


@dataclass(frozen=True)
class StepBreakdown:
    step_ms: float
    forward_ms: float
    backward_compute_ms: float
    comm_ms: float
    comm_busy_ms: float
    exposed_comm_ms: float
    overlap_ratio: float
    optimizer_ms: float
    bytes: int
    wire_bytes: int
    accumulation_ms: float = 0.0
    """The accumulation window's micro-batches that did not communicate, together (0: none)."""
    accumulation_compute_ms: float = 0.0
    """Their forward and backward (the rest of ``accumulation_ms`` is the loop's own time)."""
    micro_batches: int = 1
    """Micro-batches in the optimizer step, the synchronising one included."""

    @property
    def optimizer_step_ms(self) -> float:
        """The whole optimizer step: every micro-batch of its accumulation window."""
        return self.step_ms + self.accumulation_ms


def union_ms(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total = 0.0
    current_start: Optional[float] = None
    current_end = 0.0
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ends before it starts: ({start}, {end})")
        if current_start is None or start > current_end:
            if current_start is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_start is not None:
        total += current_end - current_start
    return total


def step_breakdown(timeline: StepTimeline) -> StepBreakdown:
    """The reported numbers of one step (see the module docstring for the definitions)."""
    buckets = timeline.buckets
    forward_ms = timeline.forward_end_ms
    optimizer_ms = max(0.0, timeline.step_ms - timeline.optimizer_start_ms)
    micro = timeline.micro_batches
    accumulation_ms = sum(m.end_ms for m in micro)
    accumulation_compute_ms = sum(m.compute_ms for m in micro)
    if buckets:
        first_launch = min(b.launch_ms for b in buckets)
        last_launch = max(b.launch_ms for b in buckets)
        compute_end = last_launch if timeline.compute_end_ms is None else max(timeline.compute_end_ms, last_launch)
        last_done = max(b.done_ms for b in buckets)
        comm_ms = last_done - first_launch
        exposed = max(0.0, last_done - compute_end)
    else:  # nothing communicated: the whole backward is compute
        compute_end, comm_ms, exposed = timeline.backward_end_ms, 0.0, 0.0
    overlap = 1.0 - exposed / comm_ms if comm_ms > 0 else 0.0
    return StepBreakdown(
        step_ms=timeline.step_ms,
        forward_ms=forward_ms,
        backward_compute_ms=max(0.0, compute_end - forward_ms),
        comm_ms=comm_ms,
        comm_busy_ms=union_ms([(b.launch_ms, b.done_ms) for b in buckets]),
        exposed_comm_ms=exposed,
        overlap_ratio=overlap,
        optimizer_ms=optimizer_ms,
        bytes=sum(b.bytes for b in buckets),
        wire_bytes=sum(b.wire_bytes for b in buckets),
        accumulation_ms=accumulation_ms,
        accumulation_compute_ms=accumulation_compute_ms,
        micro_batches=1 + len(micro),
    )


# ----------------------------------------------------------------------------- the hook wrapper


class BucketTimer:
    """Wraps a DDP communication hook to stamp each bucket's launch and completion.

    ``wire_ratio`` is bytes on the wire per byte of gradient (0.5 for fp16/bf16 casting
    hooks, 1.0 for a plain all-reduce); ``None`` when unknown (PowerSGD). PowerSGD's bytes are
    measured per bucket instead: its state counts the elements it sends
    (``total_numel_after_compression``) while the hook runs; the difference is this bucket's.
    """

    def __init__(self, clock: Clock, queue_callback: Optional[Callable[[Callable[[], None]], None]] = None) -> None:
        self.clock = clock
        # autograd's "run this when the backward graph is done"; injectable for tests
        self._queue_callback = queue_callback or queue_autograd_callback
        self.wire_ratio: Optional[float] = 1.0
        self.compute_end: Optional[Stamp] = None
        # (bucket index, bytes, parameters, launch stamp, bytes sent when the hook counted them)
        self._launches: list[tuple[int, int, int, Stamp, Optional[int]]] = []
        self._dones: list[tuple[int, Stamp]] = []
        self._num_params: dict[tuple[int, int], int] = {}

    def wrap(self, hook: CommHook) -> CommHook:
        # Our own averaging all-reduce reports completion from the callback it already has:
        # one future per bucket instead of two.
        fused = isinstance(hook, PrescaledAllreduce)
        if isinstance(hook, PrescaledAllreduce):
            hook.on_done = lambda index: self._dones.append((index, self.clock.stamp()))

        def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            index = bucket.index()
            buffer = bucket.buffer()
            nbytes = buffer.numel() * buffer.element_size()
            key = (index, nbytes)
            if key not in self._num_params:
                self._num_params[key] = len(bucket.parameters())
            if not self._launches:
                # Runs when autograd has finished the whole backward graph, before DDP's own
                # finalize callback (queued after the last bucket): DDP's "compute end".
                self._queue_callback(self._mark_compute_end)
            launch = self.clock.stamp()
            sent_before = getattr(state, "total_numel_after_compression", None)  # PowerSGD counts what it sends
            future = hook(state, bucket)
            sent = getattr(state, "total_numel_after_compression", None)
            wire: Optional[int] = None  # a fixed share of the bytes (wire_ratio): PowerSGD's first steps too
            if isinstance(sent_before, int) and isinstance(sent, int) and sent > sent_before:
                wire = (sent - sent_before) * buffer.element_size()

            def on_done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                self._dones.append((index, self.clock.stamp()))  # gloo's thread: one stamp, one append
                return fut.value()

            self._launches.append((index, nbytes, self._num_params[key], launch, wire))
            if fused:
                return future
            # ``then``, not ``add_done_callback``: DDP waits on the returned future, so the
            # stamp is guaranteed to be taken before the step goes on (a done-callback may
            # run after the waiter has woken up and land in the next step's record).
            return future.then(on_done)

        timed_hook.__name__ = timed_hook.__qualname__ = f"timed_{getattr(hook, '__name__', 'hook')}"
        return timed_hook

    def _mark_compute_end(self) -> None:
        self.compute_end = self.clock.stamp()

    def take(
        self,
    ) -> tuple[list[tuple[int, int, int, Stamp, Optional[int]]], list[tuple[int, Stamp]], Optional[Stamp]]:
        """Launches, completions and the backward-compute end recorded since the last call."""
        launches, dones, compute_end = self._launches, self._dones, self.compute_end
        self._launches, self._dones, self.compute_end = [], [], None
        return launches, dones, compute_end

    def intervals(
        self,
        step_start: Stamp,
        launches: list[tuple[int, int, int, Stamp, Optional[int]]],
        dones: list[tuple[int, Stamp]],
    ) -> tuple[BucketInterval, ...]:
        done_by_index = {index: stamp for index, stamp in dones}
        out = []
        for index, nbytes, num_params, launch, sent in launches:
            done = done_by_index.get(index)
            if done is None:  # not complete: DDP waits for every bucket, so this is a bug upstream
                continue
            launch_ms, done_ms = self.clock.elapsed_ms(step_start, launch), self.clock.elapsed_ms(step_start, done)
            if done_ms < launch_ms:  # never let a stray stamp break training: drop it
                continue
            wire = sent
            if wire is None:
                wire = int(nbytes * self.wire_ratio) if self.wire_ratio is not None else nbytes
            out.append(
                BucketInterval(
                    index=index,
                    bytes=nbytes,
                    wire_bytes=wire,
                    num_params=num_params,
                    launch_ms=launch_ms,
                    done_ms=done_ms,
                )
            )
        out.sort(key=lambda b: b.index)
        return tuple(out)
