"""CommProfiler's arithmetic: one rank's profiled steps, and the figures over every rank.

:class:`CommStats` is a plain class, tested without a Trainer or a process group (as
Lightning's ``Throughput`` next to its ``ThroughputMonitor``): the callback feeds it one
:class:`~lightning_mgpu.comm.timing.StepTimeline` per profiled step, moves what it hands out
between ranks (``gather_objects``) and logs what it returns. Here live the medians, the
slowest-rank combination, bus bandwidth, overlap, the per-bucket table and the
``comm_profile.json`` document (schema in DESIGN.md).

Across ranks, times take the slowest rank's median (a collective finishes when its last
rank does), the overlap ratio the smallest, and bandwidth comes from the slowest rank's
communication span. The per-bucket table is one step of one rank, whole: the step whose
communication span is that rank's median, from the rank whose communication ended last. Rows
never mix steps or ranks, so buckets appear in launch order, none after that step's backward
compute ended, and launch + duration = done in every row (``bucket_step`` in the profile says
which step it is, with its own forward, backward compute and span).

With gradient accumulation a profiled step is the synchronising micro-batch; the optimizer step
(``optimizer_step_ms``) adds the window's micro-batches that did not communicate
(``accumulation_ms``, of which ``accumulation_compute_ms`` forward and backward).

What was not measured is never reported as zero: without timed buckets (a strategy whose
communication the profiler cannot see, e.g. FSDP), the communication figures are None in the
profile ("not measured" on the console) and are not logged at all.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

from lightning_mgpu.comm.bandwidth import algbw_gbps, bus_factor
from lightning_mgpu.comm.timing import StepBreakdown, StepTimeline, step_breakdown
from lightning_mgpu.tuning.statistics import p90 as statistics_p90

RankMedians = dict[str, float]
"""One rank's medians over some profiled steps (:func:`rank_medians`)."""


def median(values: Sequence[float]) -> float:
    """The median, 0.0 for no values."""
    return float(statistics.median(values)) if values else 0.0


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (:func:`lightning_mgpu.tuning.statistics.p90`: nearest rank), 0.0 for no values."""
    return statistics_p90(values) if values else 0.0


_TIMES = (
    "step_ms",
    "forward_ms",
    "backward_compute_ms",
    "comm_ms",
    "exposed_comm_ms",
    "optimizer_ms",
    "optimizer_step_ms",
    "accumulation_ms",
    "accumulation_compute_ms",
)

ALWAYS_MEASURED = ("comm/step_ms", "comm/forward_ms", "comm/optimizer_ms", "comm/optimizer_step_ms")
"""Logged whatever the strategy: they need no view of the communication."""


def rank_medians(steps: Sequence[StepBreakdown]) -> RankMedians:
    """One rank's medians: the times of :data:`_TIMES`, overlap, bytes, micro-batches per optimizer
    step, and compute (forward + backward compute)."""
    names = (*_TIMES, "micro_batches", "overlap_ratio", "bytes", "wire_bytes")
    medians = {name: median([getattr(s, name) for s in steps]) for name in names}
    medians["compute_ms"] = median([s.forward_ms + s.backward_compute_ms for s in steps])
    return medians


def combine_ranks(
    per_rank: Sequence[Mapping[str, float]],
    *,
    world_size: int,
    wire_ratio: Optional[float],
    peak_busbw_gbps: Optional[float] = None,
    measures_comm: bool = True,
) -> dict[str, float]:
    """The logged metrics (keys of :data:`~.metrics.METRICS`) from every rank's :func:`rank_medians`.

    ``wire_ratio``: kept for callers; the wire bytes themselves come with each bucket (a fixed
    share of the gradient, or what PowerSGD actually sent). ``peak_busbw_gbps``: the machine's
    peak from ``bench-comm`` (gives ``comm/busbw_fraction``). ``measures_comm=False``: only
    :data:`ALWAYS_MEASURED` (the rest was not seen, and is not reported as zero).
    """
    slowest = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    metrics = {
        "comm/step_ms": slowest["step_ms"],
        "comm/forward_ms": slowest["forward_ms"],
        "comm/backward_compute_ms": slowest["backward_compute_ms"],
        "comm/comm_ms": slowest["comm_ms"],
        "comm/exposed_ms": slowest["exposed_comm_ms"],
        "comm/overlap_ratio": min(r["overlap_ratio"] for r in per_rank),
        "comm/optimizer_ms": slowest["optimizer_ms"],
        "comm/optimizer_step_ms": slowest["optimizer_step_ms"],
        "comm/bytes_per_step": slowest["bytes"],
        "comm/wire_bytes_per_step": slowest["wire_bytes"],
        "comm/straggler_ms": slowest["compute_ms"] - min(r["compute_ms"] for r in per_rank),
    }
    if not measures_comm:
        return {key: metrics[key] for key in ALWAYS_MEASURED}
    algbw = algbw_gbps(slowest["wire_bytes"], slowest["comm_ms"] / 1e3) if slowest["comm_ms"] > 0 else 0.0
    metrics["comm/algbw_gbps"] = algbw
    metrics["comm/busbw_gbps"] = algbw * bus_factor("all_reduce", world_size)
    if slowest["wire_bytes"] > 0:
        metrics["comm/compression_ratio"] = slowest["bytes"] / slowest["wire_bytes"]
    if peak_busbw_gbps:
        metrics["comm/busbw_fraction"] = metrics["comm/busbw_gbps"] / peak_busbw_gbps
    return metrics


def bucket_rank(per_rank: Sequence[Sequence[Mapping[str, Any]]]) -> int:
    """Which rank's step the per-bucket table shows: among the ranks that saw rank 0's layout (as
    many buckets), the one whose communication ended last (a collective finishes when its last
    rank does)."""
    count = len(per_rank[0])
    candidates = [rank for rank, rows in enumerate(per_rank) if len(rows) == count]
    return max(candidates, key=lambda rank: max((row["done_ms"] for row in per_rank[rank]), default=0.0))


def combine_buckets(
    per_rank: Sequence[Sequence[Mapping[str, Any]]], *, world_size: int, wire_ratio: Optional[float] = None
) -> list[dict[str, Any]]:
    """The per-bucket table: one rank's rows (:func:`bucket_rank`), whole, with bandwidth.

    ``per_rank``: every rank's :meth:`CommStats.local_buckets` (one step's buckets: launch, done,
    duration in ms from the start of backward, and the bytes sent). The table is taken whole from
    one rank, never bucket by bucket or column by column, so that its rows are one step: in launch
    order, and agreeing with each other and with that step. Bandwidth counts the bytes sent
    (``wire_bytes``; ``wire_ratio`` only for rows without them).
    """
    if not per_rank or not per_rank[0]:
        return []
    factor = bus_factor("all_reduce", world_size)
    table = []
    for row in per_rank[bucket_rank(per_rank)]:
        wire = row.get("wire_bytes", row["bytes"] * (wire_ratio or 1.0))
        duration = row["duration_ms"]
        algbw = algbw_gbps(wire, duration / 1e3) if duration > 0 else 0.0
        table.append({**row, "wire_bytes": int(wire), "algbw_gbps": algbw, "busbw_gbps": algbw * factor})
    return table


class CommStats:
    """One rank's profiled steps, bounded in memory, and the figures over every rank.

    Feed it with :meth:`add`. To log: gather every rank's :meth:`take_unlogged`, pass the list
    to :meth:`metrics`. At the end: gather every rank's :meth:`local_report`, pass the list to
    :meth:`profile`.

    Args:
        history: profiled steps kept for the medians (and logged straggler figures).
        timeline_steps: the first this many profiled steps are kept whole (plot and trace).
        measures_comm: the buckets were timed (a hook was in DDP); reported in the summary.
        wire_ratio: bytes on the wire per gradient byte, if a fixed ratio (see :func:`combine_ranks`).
        peak_busbw_gbps: the machine's peak bus bandwidth, if known (from ``bench-comm``).
    """

    def __init__(
        self,
        *,
        history: int = 10_000,
        timeline_steps: int = 4,
        measures_comm: bool = True,
        wire_ratio: Optional[float] = 1.0,
        peak_busbw_gbps: Optional[float] = None,
    ) -> None:
        self.history = history
        self.timeline_steps = timeline_steps
        self.measures_comm = measures_comm
        self.wire_ratio = wire_ratio
        self.peak_busbw_gbps = peak_busbw_gbps
        self._steps: deque[StepBreakdown] = deque(maxlen=history)
        self._step_numbers: deque[int] = deque(maxlen=history)
        self._unlogged: list[StepBreakdown] = []
        # the steps on the bucket layout in force (DDP may rebuild it once): each with its buckets
        self._bucket_steps: deque[_BucketStep] = deque(maxlen=history)
        self._layout: tuple[int, ...] = ()
        self._timelines: list[StepTimeline] = []
        self._straggler_ms: deque[float] = deque(maxlen=history)

    # ------------------------------------------------------------------ feeding

    def add(self, timeline: StepTimeline) -> StepBreakdown:
        """Record one profiled step (its number is ``timeline.step``); returns its breakdown."""
        breakdown = step_breakdown(timeline)
        self._steps.append(breakdown)
        self._step_numbers.append(timeline.step)
        self._unlogged.append(breakdown)
        if len(self._timelines) < self.timeline_steps:
            self._timelines.append(timeline)
        layout = tuple(b.bytes for b in timeline.buckets)
        if layout != self._layout:  # a new layout (DDP rebuilt): fresh statistics
            self._bucket_steps.clear()
            self._layout = layout
        if timeline.buckets:
            self._bucket_steps.append(_BucketStep(replace(timeline, micro_batches=()), breakdown))
        return breakdown

    @property
    def profiled_steps(self) -> int:
        """Profiled steps kept (at most ``history``)."""
        return len(self._steps)

    @property
    def step_numbers(self) -> list[int]:
        """The number (global step) of each profiled step kept, oldest first."""
        return list(self._step_numbers)

    @property
    def kept_timelines(self) -> list[StepTimeline]:
        """This rank's first ``timeline_steps`` profiled steps, whole."""
        return list(self._timelines)

    @property
    def unlogged_steps(self) -> int:
        """Profiled steps since the last :meth:`take_unlogged`."""
        return len(self._unlogged)

    # ------------------------------------------------------------------ logging

    def take_unlogged(self) -> RankMedians:
        """This rank's medians over the steps since the last call (to gather from every rank)."""
        medians = rank_medians(self._unlogged)
        self._unlogged = []
        return medians

    def metrics(self, per_rank: Sequence[Mapping[str, float]], *, world_size: int) -> dict[str, float]:
        """The metrics to log from every rank's :meth:`take_unlogged`; the straggler figure is
        kept for the summary (every rank computes the same from the same gathered values)."""
        metrics = combine_ranks(
            per_rank,
            world_size=world_size,
            wire_ratio=self.wire_ratio,
            peak_busbw_gbps=self.peak_busbw_gbps,
            measures_comm=self.measures_comm,
        )
        if "comm/straggler_ms" in metrics:
            self._straggler_ms.append(metrics["comm/straggler_ms"])
        return metrics

    # ------------------------------------------------------------------ end of fit

    def bucket_step(self) -> Optional[_BucketStep]:
        """The step the per-bucket table shows: of the steps on the layout in force at the end,
        the one whose communication span is this rank's median (the lower one of two)."""
        steps = sorted(self._bucket_steps, key=lambda kept: kept.breakdown.comm_ms)
        return steps[(len(steps) - 1) // 2] if steps else None

    def local_buckets(self) -> list[dict[str, Any]]:
        """One row per bucket of :meth:`bucket_step`, in launch order: launch and completion in
        ms from the start of backward, duration = done - launch, bytes sent."""
        kept = self.bucket_step()
        if kept is None:
            return []
        backward_start = kept.timeline.forward_end_ms
        return [
            {
                "index": bucket.index,
                "bytes": bucket.bytes,
                "num_params": bucket.num_params,
                "launch_ms": bucket.launch_ms - backward_start,
                "done_ms": bucket.done_ms - backward_start,
                "duration_ms": bucket.done_ms - bucket.launch_ms,
                "wire_bytes": bucket.wire_bytes,
            }
            for bucket in kept.timeline.buckets
        ]

    def local_report(self) -> dict[str, Any]:
        """What this rank contributes to the profile (plain data: it is gathered by pickling)."""
        steps = zip(self._step_numbers, self._steps)
        kept = self.bucket_step()
        return {
            "medians": rank_medians(list(self._steps)) if self._steps else None,
            "steps": [(n, s.step_ms, s.comm_ms, s.exposed_comm_ms, s.optimizer_step_ms) for n, s in steps],
            "buckets": self.local_buckets(),
            "bucket_step": kept.as_dict() if kept is not None else None,
            "timelines": [t.as_dict() for t in self._timelines],
        }

    @staticmethod
    def gathered_timelines(gathered: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Every rank's kept timelines (``StepTimeline.as_dict()``), for the plot and the trace."""
        return [t for report in gathered for t in report["timelines"]]

    def profile(
        self,
        gathered: Sequence[Mapping[str, Any]],
        *,
        world_size: int,
        backend: str,
        device_type: str,
        schedule: Mapping[str, Optional[int]],
        accumulate_grad_batches: int = 1,
    ) -> Optional[dict[str, Any]]:
        """The ``comm_profile.json`` document from every rank's :meth:`local_report` (rank order);
        None if no rank profiled a step. Steps are rank 0's; the summary's figures the slowest rank's, each p90 too
        (a median and a p90 of two ranks could read p90 < median). ``accumulate_grad_batches``:
        the Trainer's (micro-batches per optimizer step; the last window of an epoch may have fewer)."""
        per_rank = [report["medians"] for report in gathered if report["medians"] is not None]
        if not per_rank:
            return None
        metrics: dict[str, Optional[float]] = dict(
            combine_ranks(
                per_rank, world_size=world_size, wire_ratio=self.wire_ratio, peak_busbw_gbps=self.peak_busbw_gbps
            )
        )
        if not self.measures_comm:  # not seen: null in the profile, never a fabricated 0
            metrics = {key: (value if key in ALWAYS_MEASURED else None) for key, value in metrics.items()}
        rank0_steps = gathered[0]["steps"]
        rows = [report["buckets"] for report in gathered]
        buckets = combine_buckets(rows, world_size=world_size, wire_ratio=self.wire_ratio)
        bucket_step = None
        if buckets:
            chosen = bucket_rank(rows)
            bucket_step = {"rank": chosen, **gathered[chosen]["bucket_step"]}
        # the median of what was logged during the fit; the end-of-fit figure if nothing was
        straggler = metrics["comm/straggler_ms"]
        if self._straggler_ms and self.measures_comm:
            straggler = median(list(self._straggler_ms))

        def slowest_p90(column: int) -> float:
            return max(p90([s[column] for s in report["steps"]]) for report in gathered)

        summary = {
            "steps": len(rank0_steps),
            "step_ms": {"median": metrics["comm/step_ms"], "p90": slowest_p90(1)},
            "accumulate_grad_batches": accumulate_grad_batches,
            "optimizer_step_ms": {"median": metrics["comm/optimizer_step_ms"], "p90": slowest_p90(4)},
            "accumulation_ms": max(r["accumulation_ms"] for r in per_rank),
            "accumulation_compute_ms": max(r["accumulation_compute_ms"] for r in per_rank),
            "forward_ms": metrics["comm/forward_ms"],
            "backward_compute_ms": metrics["comm/backward_compute_ms"],
            "comm_ms": metrics["comm/comm_ms"],
            "exposed_comm_ms": metrics["comm/exposed_ms"],
            "overlap_ratio": metrics["comm/overlap_ratio"],
            "optimizer_ms": metrics["comm/optimizer_ms"],
            "bytes_per_step": _int_or_none(metrics["comm/bytes_per_step"]),
            "wire_bytes_per_step": _int_or_none(metrics["comm/wire_bytes_per_step"]),
            "compression_ratio": metrics.get("comm/compression_ratio"),
            "algbw_gbps": metrics["comm/algbw_gbps"],
            "busbw_gbps": metrics["comm/busbw_gbps"],
            "busbw_fraction": metrics.get("comm/busbw_fraction"),
            "straggler_ms": straggler,
            "measures_comm": self.measures_comm,
            "schedule": dict(schedule),
        }
        return {
            "world_size": world_size,
            "backend": backend,
            "device_type": device_type,
            "summary": summary,
            "ranks": [{"rank": rank, **_seen(medians, self.measures_comm)} for rank, medians in enumerate(per_rank)],
            "buckets": buckets,
            "bucket_step": bucket_step,
            "steps": [
                {
                    "step": n,
                    "step_ms": step_ms,
                    "comm_ms": comm_ms if self.measures_comm else None,
                    "exposed_comm_ms": exposed if self.measures_comm else None,
                    "optimizer_step_ms": optimizer_step_ms,
                }
                for n, step_ms, comm_ms, exposed, optimizer_step_ms in rank0_steps
            ],
        }


@dataclass(eq=False, slots=True)
class _BucketStep:
    """A profiled step kept for the per-bucket table: its timeline and its breakdown."""

    timeline: StepTimeline
    breakdown: StepBreakdown

    def as_dict(self) -> dict[str, Any]:
        """The step as ``bucket_step`` of comm_profile.json (ms; compute and span from the start of backward)."""
        b = self.breakdown
        first_launch = min(bucket.launch_ms for bucket in self.timeline.buckets) - self.timeline.forward_end_ms
        return {
            "step": self.timeline.step,
            "step_ms": b.step_ms,
            "forward_ms": b.forward_ms,
            "backward_compute_ms": b.backward_compute_ms,
            "comm_ms": b.comm_ms,
            "first_launch_ms": first_launch,
            "exposed_comm_ms": b.exposed_comm_ms,
        }


_STEP_ONLY = (
    *(key.removeprefix("comm/") for key in ALWAYS_MEASURED),
    "accumulation_ms",
    "accumulation_compute_ms",
    "micro_batches",
)


def _seen(medians: Mapping[str, float], measures_comm: bool) -> dict[str, Optional[float]]:
    """One rank's medians, with what was not measured as None."""
    return {key: (value if measures_comm or key in _STEP_ONLY else None) for key, value in medians.items()}


def _int_or_none(value: Optional[float]) -> Optional[int]:
    return None if value is None else int(value)
