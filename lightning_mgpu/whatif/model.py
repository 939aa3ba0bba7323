"""The replay model: one profiled step, replayed on another system.

From a :class:`~lightning_mgpu.whatif.records.ProfiledRun` the backward timeline is rebuilt
(when each gradient, hence each bucket, becomes ready, in ms from the start of backward), the
buckets are laid out as DDP would lay them out for the scenario's bucket size, and each
bucket's all-reduce is simulated on the target :class:`System`:

* cost of one all-reduce of ``S`` bytes over ``n`` ranks (ring): ``alpha * 2(n-1) +
  S * 2(n-1)/n / busbw`` (tree: ``alpha * 2 ceil(log2 n)``, same bandwidth term). Two levels
  (``nodes x devices_per_node``): ranks of a node sit next to each other in the ring, so every
  byte crosses both levels once and the slower one sets the pace: ``busbw = min(intra,
  inter)``, ``alpha`` the larger;
* on CPU (gloo) the host moves every byte itself: for links not measured end to end, the
  host's own cost (fitted to the profile's buckets: a per-all-reduce overhead and a busbw)
  runs beside the wire's (``max``; ``host_overlap`` < 1 adds part of the shorter one);
* buckets take turns on the link in DDP's order; a bucket starts when it is ready and the link
  is free; compression work (:mod:`~lightning_mgpu.whatif.compression`) is placed where its
  hook does it (the autograd thread delays the rest of backward);
* the step is ``forward + backward compute + exposed communication + optimizer + other``,
  where exposed is what runs past the end of backward compute;
* with gradient accumulation the step is the whole optimizer step: the synchronising
  micro-batch above plus the window's micro-batches that do not communicate
  (:attr:`~lightning_mgpu.whatif.records.ProfiledRun.accumulation_ms`: their forward and
  backward scaled by ``compute_scale``, the rest as profiled). Speed-up, efficiency and every
  lever are then about optimizer steps, as a user's throughput is.

What the model ignores (``docs/whatif.md`` discusses it): contention between compute and
communication for the same cores or memory bandwidth beyond the compression work and the host's
all-reduce work it places on backward's cores (a loopback profile's compute already carries the
contention of a fast all-reduce; a 1-rank profile carries none, and gets the CPU share bench-comm
measured over the link, when it did: that work slows backward and, as the cores are shared, the
all-reduce by as much); stragglers beyond the
profiled slowest rank; collectives running concurrently (gloo has two threads; one bucket at a
time on the link gives the same end time when the link is the bottleneck); congestion from other
jobs; the steps before PowerSGD starts; network topology beyond two levels; the data loader.

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

from lightning_mgpu.tuning.buckets import assign_buckets, bucket_limits, first_cap
from lightning_mgpu.whatif.compression import (
    NO_COSTS,
    BucketPlan,
    CompressionCosts,
    WIRE_DTYPES,
    check_compression,
    plan_bucket,
)
from lightning_mgpu.whatif.links import Link, bus_factor
from lightning_mgpu.whatif.records import Gradient, ProfiledRun

HOST_OVERLAP = 1.0
"""Default :attr:`System.host_overlap`."""
ALGORITHMS = ("ring", "tree")


@dataclass(frozen=True, kw_only=True)
class System:
    """Where the step is replayed: ``nodes x devices_per_node`` ranks and their links."""

    nodes: int = 1
    devices_per_node: int = 1
    inter: Link
    """Between nodes (per node); with one node and one level, simply the link."""
    intra: Optional[Link] = None
    """Between the devices of a node (needed when ``devices_per_node > 1`` and ``nodes > 1``)."""
    algorithm: str = "ring"
    host: Optional[Link] = None
    """CPU/gloo: the host's own cost of an all-reduce (the profile's, on loopback), for links that
    do not include it (presets, given rates)."""
    host_overlap: float = HOST_OVERLAP
    """How far the host's work hides behind the wire's: 1, fully (the all-reduce takes the longer
    of the two, as when a NIC moves the bytes while the host copies and sums); 0, not at all (the
    two add up, as when the "wire" is itself the CPU: a veth pair, loopback)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"System: {name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.host_overlap <= 1.0:
            raise ValueError(f"System: host_overlap must be between 0 and 1, got {self.host_overlap!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"System: algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def links(self) -> tuple[Link, ...]:
        """The levels every byte of a ring all-reduce crosses."""
        if self.nodes == 1:
            return (self.intra or self.inter,)
        if self.devices_per_node == 1 or self.intra is None:
            return (self.inter,)
        return (self.inter, self.intra)

    def steps(self) -> int:
        n = self.world_size
        if n == 1:
            return 0
        return 2 * (n - 1) if self.algorithm == "ring" else 2 * math.ceil(math.log2(n))

    def allreduce_ms(
        self, nbytes: float, *, host_extra_ms: float = 0.0, dtype: Optional[str] = None, beside: bool = False
    ) -> float:
        """Time of one all-reduce of ``nbytes`` (per rank) of ``dtype`` (None: float32) on this system, in ms.

        The wire's time (each link's curve for ``dtype`` where it was measured with it, see
        :meth:`Link.for_dtype`; ``beside``: its curve beside compute, for links measured so, see
        :meth:`measures_beside`) and the host's (its own cost where the links do not include it, plus
        ``host_extra_ms``) combine as ``max + (1 - host_overlap) * min``.
        """
        if self.world_size == 1:
            return 0.0
        links = [link.for_dtype(dtype) for link in self.links]
        if beside:
            links = [link.beside_compute() or link for link in links]
        wire = max(self._link_seconds(link, nbytes) for link in links) * 1e3
        host = self.host_ms(nbytes, host_extra_ms=host_extra_ms)
        return max(wire, host) + (1.0 - self.host_overlap) * min(wire, host)

    def host_ms(self, nbytes: float, *, host_extra_ms: float = 0.0) -> float:
        """The host's own work in one all-reduce (ms of CPU time), as far as it is known: its
        cost where the links do not include it, plus ``host_extra_ms``."""
        if self.world_size == 1:
            return 0.0
        host = host_extra_ms
        if self.host is not None and not all(link.includes_host for link in self.links):
            host += self._link_seconds(self.host, nbytes) * 1e3
        return host

    def measures_beside(self, dtype: Optional[str]) -> bool:
        """Whether every link was measured with compute beside its all-reduces of ``dtype`` (bench-comm
        ``--beside-compute``)."""
        return self.world_size > 1 and all(link.for_dtype(dtype).beside for link in self.links)

    def compute_kept_at(self, nbytes: float, *, dtype: Optional[str] = None) -> float:
        """The share of its rate compute keeps beside one all-reduce of ``nbytes`` of ``dtype`` (the worst link's)."""
        return min(link.for_dtype(dtype).compute_kept_at(nbytes) for link in self.links)

    def measures(self, dtype: Optional[str]) -> bool:
        """Whether every link was measured all-reducing ``dtype`` (its time then holds the host's sums of it)."""
        return all(link.measures(dtype) for link in self.links)

    def contention_ms(
        self,
        nbytes: float,
        took_ms: float,
        *,
        host_extra_ms: float = 0.0,
        measured_cpu: bool = True,
        dtype: Optional[str] = None,
    ) -> float:
        """CPU time one all-reduce of ``nbytes`` lasting ``took_ms`` takes from the cores backward runs on: the host's
        own work as :meth:`host_ms` knows it, and (``measured_cpu``), on a link measured end to end with its CPU time
        (bench-comm), the measured share of the all-reduce's time (the host's part of such a link is in its time,
        not in :meth:`host_ms`)."""
        measured = self.measured_cpu_ms(nbytes, took_ms, dtype=dtype) if measured_cpu else 0.0
        return self.host_ms(nbytes, host_extra_ms=host_extra_ms) + measured

    def measured_cpu_ms(self, nbytes: float, took_ms: float, *, dtype: Optional[str] = None) -> float:
        """The CPU time of one all-reduce of ``nbytes`` of ``dtype`` lasting ``took_ms``, as the links measured it end
        to end (bench-comm's ``cpu_us``; 0 where they did not)."""
        if self.world_size == 1:
            return 0.0
        return max(link.for_dtype(dtype).cpu_share_at(nbytes) for link in self.links) * took_ms

    def _link_seconds(self, link: Link, nbytes: float) -> float:
        steps = self.steps()
        if link.curve and link.measured_world_size:
            # the measured small-message busbw already holds its own steps' latency
            steps = max(0, steps - 2 * (link.measured_world_size - 1))
        busbw = link.busbw_at(nbytes)
        wire = 0.0 if math.isinf(busbw) else bus_factor(self.world_size) * nbytes / (busbw * 1e9)
        return wire + link.latency_us * 1e-6 * steps

    def describe(self) -> str:
        if self.nodes > 1 and self.devices_per_node > 1:
            intra = self.intra.name if self.intra is not None else self.inter.name
            return f"{self.nodes} nodes x {self.devices_per_node} ({self.inter.name} between, {intra} within)"
        return f"{self.world_size} rank(s) over {self.links[0].name}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "inter": self.inter.as_dict(),
            "intra": self.intra.as_dict() if self.intra is not None else None,
            "algorithm": self.algorithm,
            "host": self.host.as_dict() if self.host is not None else None,
        }


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """What to change relative to the profiled run."""

    system: System
    bucket_cap_mb: Optional[float] = None
    """None: the recorded layout. A size: DDP's assignment rule re-run on the gradients."""
    first_bucket_cap_mb: Optional[float] = None
    """None: DDP's 1 MiB (capped at ``bucket_cap_mb``)."""
    compression: Optional[str] = None
    powersgd_rank: int = 1
    compute_scale: float = 1.0
    """Multiplies forward, backward and optimizer time (0.25: a device four times faster)."""
    costs: CompressionCosts = NO_COSTS
    shared_compute: bool = True
    """Compression work in the hook's callbacks (PowerSGD's products, fp16's copy back) runs on the
    cores (CPU) or the device (GPU stream) backward runs on: while backward still runs, it pushes
    backward back by as long. False: it runs beside backward for free."""
    host_contention: bool = True
    """CPU/gloo: the host's own all-reduce work (copying, summing) while backward computes takes
    backward's cores too: backward is pushed back by it, net of what the profile's backward
    already carried from its own buckets. From a 1-rank profile (whose backward carried none) over
    a link bench-comm measured with its CPU time, that work is the measured share of each
    all-reduce's time (:attr:`Link.cpu_share`, of the 16-bit sweep for fp16/bf16 when the link has
    one), and the all-reduce, waiting for the same cores, takes as much longer. False: it runs beside
    backward for free."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", check_compression(self.compression))
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0 or not math.isfinite(value)):
                raise ValueError(f"Scenario: {name} must be a size in MiB > 0 or None, got {value!r}")
        if not self.compute_scale > 0 or not math.isfinite(self.compute_scale):
            raise ValueError(f"Scenario: compute_scale must be > 0, got {self.compute_scale!r}")
        if isinstance(self.powersgd_rank, bool) or not isinstance(self.powersgd_rank, int) or self.powersgd_rank < 1:
            raise ValueError(f"Scenario: powersgd_rank must be an integer >= 1, got {self.powersgd_rank!r}")

    def label(self, *, with_system: bool = True) -> str:
        """``"2 rank(s) over 1gbe, buckets 8 MiB, fp16"`` (without the system: only the options)."""
        parts = [self.system.describe()] if with_system else [f"over {self.system.links[0].name}"]
        if self.bucket_cap_mb is not None:
            parts.append(f"buckets {self.bucket_cap_mb:g} MiB")
        if self.compression == "powersgd":
            parts.append(f"powersgd rank {self.powersgd_rank}")
        elif self.compression:
            parts.append(self.compression)
        if self.compute_scale != 1.0:
            parts.append(f"compute x{self.compute_scale:g}")
        return ", ".join(parts)

    def with_changes(self, **changes: Any) -> Scenario:
        return replace(self, **changes)


@dataclass(frozen=True)
class PredictedBucket:
    bytes: int
    wire_bytes: int
    ready_ms: float
    """Its last gradient ready (ms from the start of backward, compression work included)."""
    start_ms: float
    done_ms: float


@dataclass(frozen=True)
class Prediction:
    """One scenario's predicted step (ms; medians of the profile replayed)."""

    scenario: Scenario
    step_ms: float
    comm_ms: float
    """First bucket launched -> last bucket done (the profiler's ``comm_ms``)."""
    exposed_comm_ms: float
    forward_ms: float
    backward_compute_ms: float
    optimizer_ms: float
    other_ms: float
    single_device_step_ms: float
    """The same step on one device: no communication, no compression."""
    buckets: tuple[PredictedBucket, ...]
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    accumulation_ms: float = 0.0
    """The optimizer step's micro-batches that do not communicate (included in ``step_ms``)."""
    micro_batches: int = 1
    """Micro-batches per optimizer step (``accumulate_grad_batches``)."""

    @property
    def world_size(self) -> int:
        return self.scenario.system.world_size

    @property
    def speedup(self) -> float:
        """Throughput over one device: ``n * T1 / Tn`` (samples per second, per-rank batch fixed)."""
        return self.world_size * self.single_device_step_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def efficiency(self) -> float:
        """Scaling efficiency, ``speedup / n``."""
        return self.single_device_step_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def wire_bytes(self) -> int:
        return sum(b.wire_bytes for b in self.buckets)

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_ms": self.step_ms,
            "comm_ms": self.comm_ms,
            "exposed_comm_ms": self.exposed_comm_ms,
            "speedup": self.speedup,
            "efficiency": self.efficiency,
            "world_size": self.world_size,
            "forward_ms": self.forward_ms,
            "backward_compute_ms": self.backward_compute_ms,
            "optimizer_ms": self.optimizer_ms,
            "other_ms": self.other_ms,
            "single_device_step_ms": self.single_device_step_ms,
            "accumulate_grad_batches": self.micro_batches,
            "accumulation_ms": self.accumulation_ms,
            "wire_bytes_per_step": self.wire_bytes,
            "buckets": [asdict(b) for b in self.buckets],
        }


# ------------------------------------------------------------------------ the backward timeline


def gradient_timeline(run: ProfiledRun) -> list[tuple[Gradient, float]]:
    """Every gradient in DDP's order with the time it became ready (ms from the start of backward).

    A bucket launches when its last gradient is ready, so that gradient's time is the bucket's
    launch; the others are placed between the previous bucket's launch and this one in
    proportion to their bytes (backward computes gradients at a rate roughly proportional to
    their size). Without recorded gradients each bucket is split into ``num_params`` equal ones.
    """
    buckets = sorted(run.buckets, key=lambda b: b.index)
    by_bucket: dict[int, list[Gradient]] = {}
    for gradient in run.parameters:
        by_bucket.setdefault(gradient.bucket, []).append(gradient)
    out: list[tuple[Gradient, float]] = []
    previous = 0.0
    for position, bucket in enumerate(buckets):
        gradients = by_bucket.get(position) or _equal_split(bucket.bytes, bucket.num_params, position)
        total = sum(g.bytes for g in gradients) or 1
        span = max(0.0, bucket.launch_ms - previous)
        filled = 0
        for gradient in gradients:
            filled += gradient.bytes
            out.append((gradient, previous + span * filled / total))
        previous = max(previous, bucket.launch_ms)
    return out


def _equal_split(nbytes: int, count: int, bucket: int) -> list[Gradient]:
    elements = max(1, nbytes // 4)
    count = max(1, min(count, elements))
    base, extra = divmod(elements, count)
    return [Gradient(shape=(base + (1 if i < extra else 0),), bucket=bucket) for i in range(count)]


def layout(run: ProfiledRun, scenario: Scenario) -> list[tuple[int, float, list[Gradient]]]:
    """The buckets of the scenario: (bytes, ready ms, gradients) in launch order."""
    timeline = gradient_timeline(run)
    if scenario.bucket_cap_mb is None:
        groups: dict[int, list[Gradient]] = {}
        for gradient, _ in timeline:
            groups.setdefault(gradient.bucket, []).append(gradient)
        buckets = sorted(run.buckets, key=lambda b: b.index)
        return [(bucket.bytes, bucket.launch_ms, groups.get(position, [])) for position, bucket in enumerate(buckets)]
    cap = scenario.bucket_cap_mb
    first = first_cap(cap, given_cap=cap, given_first=scenario.first_bucket_cap_mb)
    positions = assign_buckets([g.bytes for g, _ in timeline], bucket_limits(first, cap))
    out = []
    launch = 0.0
    for assigned in positions:
        members = [timeline[p] for p in assigned]
        launch = max(launch, max(ready for _, ready in members))  # DDP launches buckets in order
        out.append((sum(g.bytes for g, _ in members), launch, [g for g, _ in members]))
    return out


# ------------------------------------------------------------------------ the simulation


def predict(run: ProfiledRun, scenario: Scenario) -> Prediction:
    """Replay ``run`` on ``scenario`` (see the module docstring)."""
    system = scenario.system
    scale = scenario.compute_scale
    assumptions = list(run.notes)
    forward = run.forward_ms * scale
    backward = run.backward_compute_ms * scale
    optimizer = run.optimizer_ms * scale
    other = run.other_ms
    accumulation = accumulation_ms(run, scale)
    single = forward + backward + optimizer + other + accumulation
    if run.compression is not None and run.compression != scenario.compression:
        assumptions.append(
            f"profiled with {run.compression}: its hook's work on the autograd thread stays in the backward times"
        )
    if system.nodes > 1 and system.inter.caveat:
        assumptions.append(system.inter.caveat)
    measured_links = [link for link in system.links if link.curve]
    # a 1-rank CPU profile over a measured link: what the link says of the host decides the all-reduces' cost to backward
    from_one_rank = run.world_size == 1 and run.device_type == "cpu" and scenario.host_contention and measured_links
    if from_one_rank and not any(link.cpu_share for link in measured_links):
        assumptions.append(
            "the link's CPU time was not measured (a bench-comm result from before it recorded cpu_us): the "
            "all-reduces' work on backward's cores is not counted, and the step may be predicted fast"
        )
    elif from_one_rank and not all(link.beside for link in measured_links):
        assumptions.append(
            "the link was not measured beside compute (bench-comm --beside-compute): what the all-reduces that "
            "overlap backward cost it is estimated from their CPU time, which on a busy host undercounts it"
        )
    wire_dtype = WIRE_DTYPES.get(scenario.compression or "")
    if wire_dtype is not None and run.device_type == "cpu" and measured_links and not system.measures(wire_dtype):
        assumptions.append(
            f"the link was measured in float32 only: {scenario.compression}'s {wire_dtype} all-reduces are predicted "
            f"from it and gloo's 16-bit sum timed on this host's loopback (bench-comm --dtype float32,{wire_dtype} "
            "measures them over the link)"
        )
    if system.world_size == 1:
        return Prediction(
            scenario,
            single,
            0.0,
            0.0,
            forward,
            backward,
            optimizer,
            other,
            single,
            (),
            tuple(assumptions),
            accumulation_ms=accumulation,
            micro_batches=run.accumulate_grad_batches,
        )
    if scenario.bucket_cap_mb is not None and not run.has_parameters:
        assumptions.append("re-bucketed from equal splits of the recorded buckets (the profile lists no gradients)")
    same_hook = run.compression is not None and run.compression == scenario.compression
    buckets = layout(run, scenario)
    plans: list[BucketPlan] = [
        plan_bucket(
            nbytes,
            gradients if run.has_parameters else [],
            compression=scenario.compression,
            powersgd_rank=scenario.powersgd_rank,
            costs=scenario.costs,
            pre_in_profile=same_hook,
        )
        for nbytes, _, gradients in buckets
    ]
    delay = 0.0  # hook work so far that backward had to wait for: it pushes the rest of backward later
    link_free = 0.0
    predicted: list[PredictedBucket] = []
    first_launch: Optional[float] = None
    last_ready = max((ready * scale for _, ready, _ in buckets), default=0.0)
    undelayed_end = max(backward, last_ready)
    profiled = _profiled_host_work(run, system, scale) if scenario.host_contention else []
    included_total = _host_work_before(profiled, undelayed_end)
    contention = 0.0  # the host's all-reduce work while backward computes, in this scenario
    fresh = run.world_size == 1  # the profile's backward carried no all-reduce: the measured CPU share is all new
    summed_on_link = wire_dtype is not None and system.measures(wire_dtype)  # the link's time holds the 16-bit sums
    beside_measured = system.measures_beside(wire_dtype)
    previous_hook = 0.0
    for (nbytes, ready, _), plan in zip(buckets, plans):
        pre = plan.pre_ms * scale
        already = _host_work_before(profiled, ready * scale)  # the profile's ready time carries it
        hook_at = max(previous_hook, ready * scale + delay + contention - already)
        previous_hook = hook_at
        delay += pre  # on the autograd thread itself
        first_launch = hook_at if first_launch is None else first_launch
        start = max(hook_at + pre, link_free)
        clock = start
        segments = list(plan.segments)
        for index, (kind, amount) in enumerate(segments):
            compute_end_now = undelayed_end + delay + contention - included_total
            if kind == "host":
                continue  # taken with the all-reduce it belongs to
            if kind == "allreduce":
                following = segments[index + 1] if index + 1 < len(segments) else ("", 0.0)
                extra = following[1] * scale if following[0] == "host" and not summed_on_link else 0.0
                took = system.allreduce_ms(amount, host_extra_ms=extra, dtype=wire_dtype)
                if scenario.host_contention and took > 0 and clock < compute_end_now:
                    if fresh and beside_measured:
                        # measured beside compute: how long it takes there, and how much compute it costs
                        slowed = system.allreduce_ms(amount, host_extra_ms=extra, dtype=wire_dtype, beside=True)
                        share = min(1.0, (compute_end_now - clock) / slowed)
                        lost = 1.0 - system.compute_kept_at(amount, dtype=wire_dtype)
                        contention += share * (slowed * lost + system.host_ms(amount, host_extra_ms=extra))
                        took = share * slowed + (1.0 - share) * took
                    else:
                        share = min(1.0, (compute_end_now - clock) / took)
                        contention += share * system.contention_ms(
                            amount, took, host_extra_ms=extra, measured_cpu=fresh, dtype=wire_dtype
                        )
                        if fresh:  # the cores are shared both ways: the all-reduce's own CPU work waits as long
                            took += share * system.measured_cpu_ms(amount, took, dtype=wire_dtype)
                clock += took
                continue
            work = amount * scale
            if scenario.shared_compute and clock < compute_end_now:
                delay += work  # the same cores / stream as backward, which is still running
            clock += work
        link_free = clock
        predicted.append(PredictedBucket(nbytes, plan.wire_bytes, hook_at, start, clock))
    compute_end = max(undelayed_end + delay + contention - included_total, previous_hook)
    last_done = max((b.done_ms for b in predicted), default=0.0)
    exposed = max(0.0, last_done - compute_end)
    comm = last_done - (first_launch or 0.0)
    step = forward + compute_end + exposed + optimizer + other + accumulation
    if scenario.compression in ("fp16", "bf16", "powersgd") and scenario.costs is NO_COSTS:
        assumptions.append(f"{scenario.compression}'s compute not measured: counted as 0")
    return Prediction(
        scenario=scenario,
        step_ms=step,
        comm_ms=comm,
        exposed_comm_ms=exposed,
        forward_ms=forward,
        backward_compute_ms=compute_end,
        optimizer_ms=optimizer,
        other_ms=other,
        single_device_step_ms=single,
        buckets=tuple(predicted),
        assumptions=tuple(dict.fromkeys(assumptions)),
        accumulation_ms=accumulation,
        micro_batches=run.accumulate_grad_batches,
    )


def accumulation_ms(run: ProfiledRun, compute_scale: float = 1.0) -> float:
    """The optimizer step's micro-batches without communication, on a device ``compute_scale``
    times as slow: their forward and backward scaled, the loop's own time between as profiled."""
    compute = min(run.accumulation_compute_ms, run.accumulation_ms)
    return compute * compute_scale + (run.accumulation_ms - compute)


def _profiled_host_work(run: ProfiledRun, system: System, scale: float) -> list[tuple[float, float, float]]:
    """(start, end, host ms) of each profiled bucket's time on the link, as this system's host
    would have spent it at the profiled world size (empty when the host's cost is not known)."""
    if system.host is None:
        return []
    at_profile = replace(system, nodes=run.world_size, devices_per_node=1, intra=None)
    out, previous_done = [], 0.0
    for bucket in sorted(run.buckets, key=lambda b: b.index):
        start = max(bucket.launch_ms, previous_done)
        previous_done = max(previous_done, bucket.done_ms)
        ratio = run.wire_ratio if run.wire_ratio is not None else 1.0
        out.append((start * scale, bucket.done_ms * scale, at_profile.host_ms(bucket.bytes * ratio)))
    return out


def _host_work_before(work: Sequence[tuple[float, float, float]], until: float) -> float:
    """Host ms of ``work`` spent before ``until`` (each interval's share, spread evenly)."""
    total = 0.0
    for start, end, host in work:
        if end <= start:
            total += host if start < until else 0.0
        elif start < until:
            total += host * min(1.0, (until - start) / (end - start))
    return total


def sweep_world_sizes(run: ProfiledRun, scenario: Scenario, world_sizes: Sequence[int]) -> list[Prediction]:
    """The scenario at each world size: ``n`` nodes of ``devices_per_node`` ranks each when the
    scenario has one device per node, else ``n / devices_per_node`` nodes (``n`` a multiple)."""
    out = []
    per_node = scenario.system.devices_per_node
    for n in world_sizes:
        if n % per_node:
            raise ValueError(f"world size {n} is not a multiple of {per_node} devices per node")
        system = replace(scenario.system, nodes=n // per_node)
        out.append(predict(run, scenario.with_changes(system=system)))
    return out


__all__ = [
    "ALGORITHMS",
    "accumulation_ms",
    "PredictedBucket",
    "Prediction",
    "Scenario",
    "System",
    "gradient_timeline",
    "layout",
    "predict",
    "sweep_world_sizes",
]
