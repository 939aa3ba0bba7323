"""CommProfiler's arithmetic: one rank's profiled steps, and the figures over every rank.

:class:`CommStats` is a plain class, tested without a Trainer or a process group (as
Lightning's ``Throughput`` next to its ``ThroughputMonitor``): the callback feeds it one
:class:`~lightning_mgpu.comm.timing.StepTimeline` per profiled step, moves what it hands out
between ranks (``gather_objects``) and logs what it returns. Here live the medians, the
slowest-rank combination, bus bandwidth, overlap, the per-bucket table and the
``comm_profile.json`` document (schema in DESIGN.md).

Across ranks, times take the slowest rank's median (a collective finishes when its last
rank does), the overlap ratio the smallest, and bandwidth comes from the slowest rank's
communication span. A bucket's row is one rank's own (its median step for that bucket, from the
rank that finished the bucket last), so launch + duration = done in every row.

What was not measured is never reported as zero: without timed buckets (a strategy whose
communication the profiler cannot see, e.g. FSDP), the communication figures are None in the
profile ("not measured" on the console) and are not logged at all.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Mapping, Optional, Sequence

from lightning_mgpu.comm.bandwidth import algbw_gbps, bus_factor
from lightning_mgpu.comm.timing import StepBreakdown, StepTimeline, step_breakdown

RankMedians = dict[str, float]
"""One rank's medians over some profiled steps (:func:`rank_medians`)."""


def median(values: Sequence[float]) -> float:
    """The median, 0.0 for no values."""
    return float(statistics.median(values)) if values else 0.0


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (nearest rank), 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)])


_TIMES = ("step_ms", "forward_ms", "backward_compute_ms", "comm_ms", "exposed_comm_ms", "optimizer_ms")

ALWAYS_MEASURED = ("comm/step_ms", "comm/forward_ms", "comm/optimizer_ms")
"""Logged whatever the strategy: they need no view of the communication."""


def rank_medians(steps: Sequence[StepBreakdown]) -> RankMedians:
    """One rank's medians: the times of :data:`_TIMES`, overlap, bytes, and compute (forward + backward compute)."""
    medians = {name: median([getattr(s, name) for s in steps]) for name in _TIMES}
    medians["overlap_ratio"] = median([s.overlap_ratio for s in steps])
    medians["bytes"] = median([s.bytes for s in steps])
    medians["wire_bytes"] = median([s.wire_bytes for s in steps])
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


def combine_buckets(
    per_rank: Sequence[Sequence[Mapping[str, Any]]], *, world_size: int, wire_ratio: Optional[float] = None
) -> list[dict[str, Any]]:
    """The per-bucket table: rank 0's layout, each bucket's row from the rank that finished it last.

    ``per_rank``: every rank's :meth:`CommStats.local_buckets` (one consistent row per bucket:
    launch, done, duration in ms from the start of backward, and the bytes sent). The row is
    taken whole from one rank, never column by column, so that it agrees with itself.
    Bandwidth counts the bytes sent (``wire_bytes``; ``wire_ratio`` only for rows without them).
    """
    factor = bus_factor("all_reduce", world_size)
    table = []
    for position, bucket in enumerate(per_rank[0]):
        # the collective finishes when its last rank does: that rank's row
        ranks = [buckets[position] for buckets in per_rank if len(buckets) > position]
        row = max(ranks, key=lambda r: r["done_ms"])
        wire = row.get("wire_bytes", bucket["bytes"] * (wire_ratio or 1.0))
        duration = row["duration_ms"]
        algbw = algbw_gbps(wire, duration / 1e3) if duration > 0 else 0.0
        table.append(
            {
                **bucket,
                "launch_ms": row["launch_ms"],
                "done_ms": row["done_ms"],
                "duration_ms": duration,
                "wire_bytes": int(wire),
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * factor,
            }
        )
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
        # per (layout, bucket index): (launch, done) in ms from the start of backward, and bytes sent
        self._bucket_times: dict[tuple[int, int], deque[tuple[float, float, int]]] = {}
        self._bucket_params: dict[tuple[int, int], int] = {}
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
        backward_start = timeline.forward_end_ms
        for bucket in timeline.buckets:
            key = (hash(layout), bucket.index)
            if key not in self._bucket_times:  # a new layout (DDP rebuilt): fresh statistics
                self._bucket_times[key] = deque(maxlen=self.history)
                self._bucket_params[key] = bucket.num_params
            self._bucket_times[key].append(
                (bucket.launch_ms - backward_start, bucket.done_ms - backward_start, bucket.wire_bytes)
            )
        self._layout = layout
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

    def local_buckets(self) -> list[dict[str, Any]]:
        """One row per bucket of the layout in force at the end (DDP may rebuild once): the step
        whose duration is this rank's median for that bucket, whole (launch and completion in ms
        from the start of backward, duration = done - launch, bytes sent)."""
        layout = self._layout
        out = []
        for index, nbytes in enumerate(layout):
            key = (hash(layout), index)
            times = sorted(self._bucket_times.get(key, ()), key=lambda t: t[1] - t[0])
            launch, done, wire = times[(len(times) - 1) // 2] if times else (0.0, 0.0, 0)
            out.append(
                {
                    "index": index,
                    "bytes": nbytes,
                    "num_params": self._bucket_params.get(key, 0),
                    "launch_ms": launch,
                    "done_ms": done,
                    "duration_ms": done - launch,
                    "wire_bytes": wire,
                }
            )
        return out

    def local_report(self) -> dict[str, Any]:
        """What this rank contributes to the profile (plain data: it is gathered by pickling)."""
        steps = zip(self._step_numbers, self._steps)
        return {
            "medians": rank_medians(list(self._steps)) if self._steps else None,
            "steps": [(n, s.step_ms, s.comm_ms, s.exposed_comm_ms) for n, s in steps],
            "buckets": self.local_buckets(),
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
    ) -> Optional[dict[str, Any]]:
        """The ``comm_profile.json`` document from every rank's :meth:`local_report` (rank order);
        None if no rank profiled a step. Steps and their p90 are rank 0's."""
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
        buckets = combine_buckets(
            [report["buckets"] for report in gathered], world_size=world_size, wire_ratio=self.wire_ratio
        )
        # the median of what was logged during the fit; the end-of-fit figure if nothing was
        straggler = metrics["comm/straggler_ms"]
        if self._straggler_ms and self.measures_comm:
            straggler = median(list(self._straggler_ms))
        summary = {
            "steps": len(rank0_steps),
            "step_ms": {"median": metrics["comm/step_ms"], "p90": p90([s[1] for s in rank0_steps])},
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
            "steps": [
                {
                    "step": n,
                    "step_ms": step_ms,
                    "comm_ms": comm_ms if self.measures_comm else None,
                    "exposed_comm_ms": exposed if self.measures_comm else None,
                }
                for n, step_ms, comm_ms, exposed in rank0_steps
            ],
        }


_STEP_ONLY = ("step_ms", "forward_ms", "optimizer_ms")


def _seen(medians: Mapping[str, float], measures_comm: bool) -> dict[str, Optional[float]]:
    """One rank's medians, with what was not measured as None."""
    return {key: (value if measures_comm or key in _STEP_ONLY else None) for key, value in medians.items()}


def _int_or_none(value: Optional[float]) -> Optional[int]:
    return None if value is None else int(value)
