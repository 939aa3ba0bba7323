"""Links the replay model sends buckets over: named presets with their sources, measured ones.

A :class:`Link` is what one all-reduce needs to know about the wire: the *bus bandwidth* it
sustains (nccl-tests' busbw, GB/s = 10^9 B/s: for a network link, the payload rate in each
direction; for NVLink / PCIe, what nccl-tests reports) and the latency of one ring step.

Three ways to get one:

* :data:`PRESETS` (``--link 10gbe``): figures from vendors' specifications and nccl-tests
  reports; each preset names its source (``docs/whatif.md`` lists them with links);
* :func:`link_from_gbps` (``--link-gbps 2.5``): a payload rate in Gbit/s, as ``iperf3`` or
  the netlab's socket test report it;
* :func:`link_from_bench_comm` (``--link-bench FILE``): a ``lightning-mgpu bench-comm --json``
  result measured on the link itself: its whole busbw-by-size curve, host costs included (and,
  from ``bench-comm --dtype float32,float16``, the curve of 16-bit all-reduces, which fp16 / bf16
  compression sends: on CPU gloo sums them slower than float32);
* :func:`link_from_profile`: the link as the profile saw it (each bucket's service time), the
  default when no link is named.

Pure Python: no torch import.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

from lightning_mgpu.whatif.compression import WIRE_DTYPES
from lightning_mgpu.whatif.records import ProfileError, ProfiledRun, read_json

GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""
TCP_EFFICIENCY = 1448 / 1538
"""Payload share of a full-size Ethernet frame carrying TCP with timestamps (MTU 1500: 1448 payload
bytes of 1538 on the wire with preamble, header, FCS and inter-frame gap): 94.1%, the rate
``iperf3`` reaches on an idle 1/10 GbE link."""
TCP_STEP_LATENCY_US = 50.0
"""Assumed latency of one ring step over kernel TCP (gloo, NCCL's socket transport); an order of
magnitude, not a measurement: measure the link (``--link-bench``) when small buckets matter."""


def bus_factor(world_size: int) -> float:
    """nccl-tests' all_reduce factor ``2(n-1)/n`` (0 for one rank)."""
    return 2 * (world_size - 1) / world_size


@dataclass(frozen=True, kw_only=True)
class Link:
    """One level of the interconnect, as one all-reduce sees it."""

    name: str
    busbw_gbps: float
    """Bus bandwidth in GB/s (10^9 B/s), large messages. ``math.inf``: costs nothing (loopback)."""
    latency_us: float = 0.0
    """Latency of one ring step (a ring all-reduce over n ranks takes 2(n-1) of them)."""
    includes_host: bool = False
    """Measured end to end (bench-comm, or the profile): the host's own per-byte cost is in it."""
    curve: tuple[tuple[int, float], ...] = ()
    """Measured (bytes, busbw GB/s) points, increasing in size; :meth:`busbw_at` interpolates them."""
    cpu_share: tuple[tuple[int, float], ...] = ()
    """Measured (bytes, CPU share) points, increasing in size: the CPU time a rank's process spent per all-reduce
    over the all-reduce's time (bench-comm's ``cpu_us / time_us``: gloo's copies, sums and waiting, the kernel's
    socket work charged to it), capped at 1 (one core); :meth:`cpu_share_at` interpolates them."""
    beside: tuple[tuple[int, float], ...] = ()
    """Measured (bytes, busbw GB/s) points of the all-reduce timed with compute running beside it on every rank
    (bench-comm ``--beside-compute``: ``beside_time_us``), increasing in size: the all-reduces that overlap backward.
    Empty: not measured."""
    compute_kept: tuple[tuple[int, float], ...] = ()
    """Measured (bytes, share) points: the share of its rate the compute kept while that all-reduce ran
    (``beside_compute_share``, the worst-hit rank's), capped at 1."""
    measured_world_size: int = 0
    """Ranks the curve was measured with (its small-message busbw holds 2(n-1) steps of latency)."""
    measured_nodes: Optional[int] = None
    """Nodes the curve was measured across (1: one host's loopback); None: not recorded, or not measured."""
    caveat: str = ""
    """What a prediction across nodes must say about this link (see :func:`link_from_bench_comm`)."""
    by_dtype: tuple[tuple[str, Link], ...] = ()
    """The same link measured all-reducing other element types (``("float16", link)``, ...; bench-comm's
    ``--dtype``): :meth:`for_dtype` picks one."""
    nominal: str = ""
    """The rate as sold (``"10 Gbit/s"``), for tables."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        if not self.busbw_gbps > 0:  # NaN too
            raise ValueError(f"link {self.name!r}: busbw_gbps must be > 0, got {self.busbw_gbps!r}")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ValueError(f"link {self.name!r}: latency_us must be a finite number >= 0, got {self.latency_us!r}")

    def busbw_at(self, nbytes: float) -> float:
        """Bus bandwidth (GB/s) for one all-reduce of ``nbytes``: the measured curve, interpolated
        in log(size) and held flat beyond its ends, or :attr:`busbw_gbps`."""
        return _interpolate(self.curve, nbytes) if self.curve else self.busbw_gbps

    def for_dtype(self, dtype: Optional[str]) -> Link:
        """This link as measured all-reducing ``dtype`` (``"float16"``, ...): that sweep when there was one, else
        this link itself (float32, or not measured per type)."""
        return dict(self.by_dtype).get(dtype or "float32", self)

    def measures(self, dtype: Optional[str]) -> bool:
        """Whether the link was measured all-reducing ``dtype`` itself (float32: whenever it was measured)."""
        return dtype in dict(self.by_dtype) or (bool(self.curve) and dtype in (None, "float32"))

    def beside_compute(self) -> Optional[Link]:
        """This link as an all-reduce beside compute crosses it (its :attr:`beside` curve), None when not measured."""
        if not self.beside:
            return None
        return replace(self, curve=self.beside, busbw_gbps=max(b for _, b in self.beside), beside=(), by_dtype=())

    def compute_kept_at(self, nbytes: float) -> float:
        """The share of its rate compute keeps beside one all-reduce of ``nbytes`` (see :attr:`compute_kept`); 1 when
        not measured."""
        return _interpolate(self.compute_kept, nbytes) if self.compute_kept else 1.0

    def cpu_share_at(self, nbytes: float) -> float:
        """The measured CPU share of one all-reduce of ``nbytes`` (see :attr:`cpu_share`), 0 when not measured."""
        return _interpolate(self.cpu_share, nbytes) if self.cpu_share else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "busbw_gbps": None if math.isinf(self.busbw_gbps) else self.busbw_gbps,
            "latency_us": self.latency_us,
            "includes_host": self.includes_host,
            "measured": bool(self.curve),
            "measured_nodes": self.measured_nodes,
            "measured_dtypes": [name for name, _ in self.by_dtype],
            "nominal": self.nominal,
            "source": self.source,
        }


def _interpolate(points: tuple[tuple[int, float], ...], nbytes: float) -> float:
    """``points`` (size, value), increasing in size: interpolated in log(size), held flat beyond the ends."""
    sizes = [size for size, _ in points]
    if nbytes <= sizes[0]:
        return points[0][1]
    if nbytes >= sizes[-1]:
        return points[-1][1]
    i = bisect.bisect_right(sizes, nbytes)
    (s0, v0), (s1, v1) = points[i - 1], points[i]
    w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return v0 + w * (v1 - v0)


def _ethernet(gbit: float, name: str) -> Link:
    return Link(
        name=name,
        busbw_gbps=gbit * TCP_EFFICIENCY * GBIT / 1e9,
        latency_us=TCP_STEP_LATENCY_US,
        nominal=f"{gbit:g} Gbit/s",
        source=f"IEEE 802.3 {gbit:g} Gbit/s line rate x {TCP_EFFICIENCY:.3f} TCP payload share "
        "(1448 of 1538 bytes per frame); 50 us per ring step assumed",
    )


PRESETS: dict[str, Link] = {
    link.name: link
    for link in (
        Link(
            name="loopback",
            busbw_gbps=math.inf,
            nominal="one machine",
            source="no wire: only the host's own cost (the profile's) remains",
        ),
        _ethernet(1, "1gbe"),
        _ethernet(10, "10gbe"),
        _ethernet(25, "25gbe"),
        Link(
            name="100gbe",
            busbw_gbps=12.0,
            latency_us=10.0,
            nominal="100 Gbit/s",
            source="nccl-tests busbw 12 GB/s per 100G NIC (NCCL maintainer, NVIDIA/nccl-tests#119); "
            "a kernel-TCP transport (gloo) reaches less",
        ),
        Link(
            name="ib-hdr",
            busbw_gbps=24.0,
            latency_us=10.0,
            nominal="200 Gbit/s InfiniBand HDR",
            source="nccl-tests busbw 24 GB/s per 200G HDR NIC (NVIDIA/nccl-tests#119, NVIDIA/nccl#1048); "
            "~19 us for a 2-rank 8-byte all_reduce (NVIDIA/nccl-tests#150): ~10 us per ring step",
        ),
        Link(
            name="pcie4-x16",
            busbw_gbps=24.0,
            latency_us=5.0,
            nominal="PCIe 4.0 x16, 31.5 GB/s per direction",
            source="PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction; "
            "~80% after packet overhead (the ratio NCCL's maintainers give for NVLink, NVIDIA/nccl-tests#149) "
            "-> 24 GB/s, assumed; latency assumed",
        ),
        Link(
            name="nvlink3",
            busbw_gbps=230.0,
            latency_us=5.0,
            nominal="NVLink 3 (A100 SXM), 300 GB/s per direction",
            source="nccl-tests all_reduce busbw ~230 GB/s on 8x A100 SXM (NVIDIA/nccl-tests#149, "
            "NVIDIA/nccl#1048: 232.5 GB/s); ~10 us for a 2-rank 8-byte all_reduce (NVIDIA/nccl-tests#331)",
        ),
        Link(
            name="nvlink4",
            busbw_gbps=370.0,
            latency_us=5.0,
            nominal="NVLink 4 (H100 SXM), 450 GB/s per direction",
            source="ring all_reduce busbw ~370 GB/s on 8x H100 SXM, ~480 with NVLink SHARP "
            "(NCCL maintainer, NVIDIA/nccl-tests#212); latency as NVLink 3, assumed",
        ),
    )
}
"""Named links (``--link NAME``); :func:`resolve_link` also takes ``NAME`` case-insensitively."""


def link_from_gbps(gbps: float, *, latency_us: float = TCP_STEP_LATENCY_US, name: Optional[str] = None) -> Link:
    """A link carrying ``gbps`` Gbit/s of payload in each direction (what iperf3 reports)."""
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not (gbps > 0 and math.isfinite(gbps)):
        raise ValueError(f"link rate must be a number of Gbit/s > 0, got {gbps!r}")
    return Link(
        name=name or f"{gbps:g} Gbit/s",
        busbw_gbps=gbps * GBIT / 1e9,
        latency_us=latency_us,
        nominal=f"{gbps:g} Gbit/s payload",
        source="given rate (payload, each direction)",
    )


def link_from_bench_comm(report: Union[str, os.PathLike[str], Mapping[str, Any]]) -> Link:
    """The link a ``lightning-mgpu bench-comm --json`` result measured: busbw by size, host included (its float32
    sweep; any other dtype's sweep as :attr:`Link.by_dtype`)."""
    where = "bench-comm result" if isinstance(report, Mapping) else str(report)
    expected = "a `lightning-mgpu bench-comm --json FILE` result"
    document: Any = report if isinstance(report, Mapping) else read_json(report, expected=expected)
    if not isinstance(document, Mapping) or not isinstance(document.get("rows"), list):
        raise ProfileError(f"{where}: no 'rows' list; expected {expected}")
    world_size = document.get("world_size", 0)
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ProfileError(f"{where}: 'world_size' must be an integer, got {world_size!r:.60}; expected {expected}")
    others = document.get("other_dtypes", {})
    if not isinstance(others, Mapping) or not all(
        isinstance(sweep, Mapping) and isinstance(sweep.get("rows"), list) for sweep in others.values()
    ):
        raise ProfileError(f"{where}: 'other_dtypes' must map each dtype to an object with a 'rows' list")
    top = str(document.get("dtype", "float32"))
    if top != "float32":
        raise ValueError(
            f"{where}: a {top} sweep only; the link's curve is its float32 sweep: run "
            f"`lightning-mgpu bench-comm --dtype float32,{top} --json FILE` across the link"
        )
    if world_size < 2:
        raise ValueError(
            f"{where}: needs a bench-comm run with --nproc >= 2 (busbw is 0 for one process by definition); "
            "run `lightning-mgpu bench-comm --json FILE` across the link"
        )
    on_cpu = document.get("device_type", "cpu") == "cpu"
    sweep = _measured_rows(document["rows"], where, "rows", world_size)
    latency_us = document.get("latency_us", 0.0)
    if isinstance(latency_us, bool) or not isinstance(latency_us, (int, float)) or not latency_us >= 0:
        raise ProfileError(f"{where}: 'latency_us' must be a number >= 0, got {latency_us!r:.60}")
    nodes, placed = _placement(document, where)
    caveat = ""
    if nodes is None:
        caveat = (
            f"{where} does not record where its ranks ran (a bench-comm from before it crossed nodes): if they "
            "ran on one host it measured that host's loopback, not a link between nodes"
        )
    link = Link(
        name=f"measured: {Path(where).name}",
        busbw_gbps=max(b for _, b in sweep.curve),
        latency_us=float(latency_us) / (2 * (world_size - 1)),
        includes_host=True,
        measured_world_size=world_size,
        measured_nodes=nodes,
        caveat=caveat,
        nominal=f"{world_size} ranks, {document.get('backend', '?')}",
        source=f"lightning-mgpu bench-comm {placed}: {where}",
    )
    by_dtype = []
    for dtype, other in others.items():
        measured = _measured_rows(other["rows"], where, f"other_dtypes.{dtype}.rows", world_size)
        by_dtype.append((str(dtype), measured.onto(replace(link, name=f"{link.name} ({dtype})"), on_cpu)))
    return replace(sweep.onto(link, on_cpu), by_dtype=tuple(by_dtype))


Points = tuple[tuple[int, float], ...]


class _Sweep(NamedTuple):
    """One bench-comm sweep's measured points, by size (see :class:`Link`)."""

    curve: Points
    cpu_share: Points
    beside: Points
    compute_kept: Points

    def onto(self, link: Link, on_cpu: bool) -> Link:
        """``link`` with these points; the CPU's figures only for a CPU sweep (a GPU's host time is not backward's)."""
        return replace(
            link,
            busbw_gbps=max(b for _, b in self.curve),
            curve=self.curve,
            cpu_share=self.cpu_share if on_cpu else (),
            beside=self.beside if on_cpu else (),
            compute_kept=self.compute_kept if on_cpu else (),
        )


def _measured_rows(rows: list[Any], where: str, field: str, world_size: int) -> _Sweep:
    """One sweep's rows, checked -> its points (busbw; CPU share; beside compute, when every row has it)."""
    kept = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ProfileError(f"{where}: {field}[{i}] must be an object; expected a bench-comm --json result")
        # time_us and cpu_us are absent in old results, cpu_us None where not measured, the beside figures only
        # with --beside-compute
        for key in ("bytes", "busbw_gbps", "time_us", "cpu_us", "beside_time_us", "beside_compute_share"):
            value = row.get(key, 0)
            if value is None and key == "cpu_us":
                continue  # not measured (see _cpu_share)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ProfileError(f"{where}: {field}[{i}].{key} must be a number >= 0, got {value!r:.60}")
        if row.get("busbw_gbps", 0) > 0:
            kept.append(row)
    if not kept:
        raise ValueError(
            f"{where}: {field} has no row with busbw > 0; run `lightning-mgpu bench-comm --json FILE` across the link"
        )
    curve = tuple(sorted((int(row["bytes"]), float(row["busbw_gbps"])) for row in kept))
    beside: Points = ()
    compute_kept: Points = ()
    if all(row.get("beside_time_us", 0) > 0 and "beside_compute_share" in row for row in kept):
        factor = bus_factor(world_size)
        beside = tuple(sorted((int(r["bytes"]), factor * r["bytes"] / (r["beside_time_us"] * 1e3)) for r in kept))
        compute_kept = tuple(sorted((int(r["bytes"]), min(1.0, float(r["beside_compute_share"]))) for r in kept))
    return _Sweep(curve, _cpu_share(kept), beside, compute_kept)


def _cpu_share(rows: list[Any]) -> tuple[tuple[int, float], ...]:
    """Each (checked) row's ``cpu_us / time_us`` capped at 1, by size; () when a row lacks ``cpu_us`` (bench-comm
    before it recorded CPU time)."""
    if any(row.get("cpu_us") is None or row.get("time_us") is None for row in rows):
        return ()
    return tuple(
        sorted(
            (int(row["bytes"]), min(1.0, row["cpu_us"] / row["time_us"]) if row["time_us"] > 0 else 0.0) for row in rows
        )
    )


def _placement(report: Mapping[str, Any], where: str) -> tuple[Optional[int], str]:
    """How many nodes a bench-comm result's ranks ran on (None: not recorded), and those words for its source."""
    nodes = report.get("nodes")
    if nodes is None:
        return None, "(where its ranks ran not recorded)"
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ProfileError(f"{where}: 'nodes' must be an integer >= 1, got {nodes!r:.60}")
    hosts = report.get("hosts")
    names = [str(h.get("hostname")) for h in hosts if isinstance(h, Mapping)] if isinstance(hosts, list) else []
    launcher = report.get("launcher", "?")
    if nodes == 1:
        return 1, f"on one host ({', '.join(names[:1]) or '?'}, {launcher}: loopback)"
    return nodes, f"across {nodes} nodes ({launcher}: {', '.join(names)})"


def refuse_one_host_sweep(link: Link, nodes: int, where: str) -> None:
    """``ValueError`` when a bench-comm sweep on one host (the file ``where``) would stand for the link between
    ``nodes`` > 1 nodes.

    Such a sweep timed one machine's loopback (memory copies and the CPU), which says nothing of the
    wire between nodes: a prediction from it would look measured and be wrong.
    """
    if nodes > 1 and link.measured_nodes == 1:
        raise ValueError(
            f"{where} is a one-host bench-comm sweep ({link.measured_world_size} ranks "
            f"over loopback): it measured no link between nodes, so it cannot stand for the link of a {nodes}-node "
            "prediction. Measure the link with bench-comm started on every node (`srun --nodes=2 "
            "--ntasks-per-node=1 lightning-mgpu bench-comm --json FILE`, or `torchrun --nnodes=2 "
            "--nproc-per-node=1 ... -m lightning_mgpu.cli bench-comm --json FILE` on each node), "
            "or give the link's rate (--link-gbps X) or a preset (--link NAME)"
        )


def service_times(run: ProfiledRun) -> list[float]:
    """Each recorded bucket's time on the link when buckets take turns (ms): from the later of its
    launch and the previous bucket's completion, to its completion."""
    out, previous_done = [], 0.0
    for bucket in sorted(run.buckets, key=lambda b: b.index):
        out.append(max(0.0, bucket.done_ms - max(bucket.launch_ms, previous_done)))
        previous_done = max(previous_done, bucket.done_ms)
    return out


def profiled_cost(run: ProfiledRun, *, overhead_ms: float = 0.0) -> Optional[tuple[float, float]]:
    """``(overhead_ms, busbw_gbps)``: each profiled bucket took ``overhead + bytes * 2(n-1)/n /
    busbw``, with the overhead of one all-reduce given (measured apart: a small all-reduce, see
    :func:`lightning_mgpu.whatif.measure.measure_gloo_latency`) and the busbw from the buckets'
    service times together. None when it cannot be known (one rank, or no time measured).

    Why not fit the overhead to the buckets: the first buckets run while backward computes, and on
    CPU their time is stretched by sharing the cores with it; a line through them gives small
    buckets an overhead of milliseconds that a small all-reduce on its own does not have.
    """
    if run.world_size < 2 or not run.buckets:
        return None
    ratio = run.wire_ratio if run.wire_ratio is not None else 1.0
    wire = sum(b.bytes for b in run.buckets) * ratio * bus_factor(run.world_size)
    busy_ms = sum(service_times(run)) - overhead_ms * len(run.buckets)
    if busy_ms <= 0 or wire <= 0:
        return None if overhead_ms == 0 else profiled_cost(run)
    return (overhead_ms, wire / (busy_ms / 1e3) / 1e9)


def profiled_busbw_gbps(run: ProfiledRun) -> Optional[float]:
    """The bus bandwidth of :func:`profiled_cost` (GB/s), None when it cannot be known."""
    cost = profiled_cost(run)
    return None if cost is None else cost[1]


def link_from_profile(run: ProfiledRun, *, overhead_ms: float = 0.0) -> Optional[Link]:
    """The link as profiled, host costs included (None: one rank): each all-reduce costs
    ``overhead_ms`` (spread over the profiled world size's ring steps) plus its bytes at the
    busbw the profiled buckets achieved (:func:`profiled_cost`)."""
    cost = profiled_cost(run, overhead_ms=overhead_ms)
    if cost is None:
        return None
    overhead, busbw = cost
    link = Link(
        name="as profiled",
        busbw_gbps=busbw,
        latency_us=overhead * 1e3 / (2 * (run.world_size - 1)),
        includes_host=True,
        nominal=f"{run.world_size} ranks, {run.backend}",
        source=f"the profile's bucket service times ({run.source})",
    )
    sent = WIRE_DTYPES.get(run.compression or "")
    # a profile taken with fp16/bf16 timed its buckets' 16-bit all-reduces, the host's sums of them included
    return replace(link, by_dtype=((sent, link),)) if sent is not None else link


def resolve_link(name: str) -> Link:
    """A preset by name (case-insensitive); ValueError listing the presets otherwise."""
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown link {name!r}; presets: {', '.join(PRESETS)} (or give --link-gbps X)")
    return PRESETS[key]


def link_names() -> Sequence[str]:
    return tuple(PRESETS)


__all__ = [
    "GBIT",
    "PRESETS",
    "TCP_EFFICIENCY",
    "Link",
    "bus_factor",
    "link_from_bench_comm",
    "link_from_gbps",
    "link_from_profile",
    "link_names",
    "profiled_busbw_gbps",
    "profiled_cost",
    "refuse_one_host_sweep",
    "resolve_link",
    "service_times",
]
