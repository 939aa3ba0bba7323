"""The all_reduce benchmark behind ``lightning-mgpu bench-comm``: what is measured, and how.

How fast can this machine all-reduce, message size by message size? The answer is the
ceiling DDP's gradient buckets are measured against::

    lightning-mgpu bench-comm                                  # CPU: 2 processes, gloo, 1 KiB .. 256 MiB
    lightning-mgpu bench-comm --json bench/results/bench_comm_cpu.json
    lightning-mgpu bench-comm --device cuda                    # every visible GPU, NCCL, CUDA-event timing
    lightning-mgpu bench-comm --nproc 4 --min-bytes 8 --max-bytes 1GiB --factor 4 --iters 50

For each message size (``--min-bytes`` to ``--max-bytes``, multiplied by ``--factor`` each
step) every rank all-reduces (sum, in place) a float32 tensor of that size (``--dtype``: of each
dtype named, one sweep after the other; a 16-bit sweep is what fp16 / bf16 compression sends, and
on CPU gloo sums 16-bit types slower than float32, which only a sweep of that type shows):

0. once, before the first size: :data:`SWEEP_WARMUP` untimed all-reduces of the smallest size
   (the group's first collectives pay one-time costs that would otherwise land in the first
   size's times: a 1 KiB "latency" five times the 4 KiB one; skipped with ``--warmup 0``);
1. ``warmup`` untimed all-reduces (connections, allocator, NCCL channels settle);
2. a barrier, then a batch of ``iters`` back-to-back all-reduces with a timestamp
   between each: host clock (``time.perf_counter_ns``) on CPU, where gloo's
   ``all_reduce`` returns once the result is in place; on CUDA a ``torch.cuda.Event``
   recorded on the current stream after each launch, read once after the batch (no host
   synchronisation inside it), so the times are device times (when the host cannot launch
   small all-reduces as fast as the GPU runs them, the gaps show, as in nccl-tests);
3. each rank takes the median of its per-iteration times; the **slowest rank's median**
   is the row's time (a collective is not done before its last rank is). nccl-tests
   averages over its batch and, by default (``-a 1``), over ranks; our choice matches its
   ``-a 3`` (max) and uses the median so that one preempted iteration on a shared
   machine does not move the number;
4. algbw and busbw from :mod:`lightning_mgpu.comm.bandwidth` (nccl-tests' definitions,
   GB/s = 10^9 bytes/s; busbw = algbw x 2(n-1)/n for all_reduce);
5. a correctness check, nccl-tests' ``#wrong`` column: one more all-reduce of a known
   pattern (rank ``r`` holds ``1 + (i + r) mod 251`` at index ``i``, so every rank
   contributes differently and a misplaced chunk shows), compared exactly with the
   expected sum (small integers: float32 sums them exactly in any order; a 16-bit type's period is
   shortened so that the sum over all ranks stays an integer it holds exactly). ``#wrong`` is
   the number of wrong elements, summed over ranks. Any wrong element makes the command
   exit with status 1.

The timed tensor holds zeros: its contents do not change what a sum costs, and
zeros stay finite however many times they are summed.

Iterations per size (the rule that keeps a default CPU sweep at about 10-40 s on 2 cores):

* timed:  ``min(iters, max(5, 1 GiB // size))`` - at most 1 GiB all-reduced per size,
  but never fewer than 5 iterations (or ``--iters`` if smaller). Defaults: 20 up to
  32 MiB, 16 at 64 MiB, 8 at 128 MiB, 5 at 256 MiB.
* warm-up: ``min(warmup, max(1, 256 MiB // size))`` - defaults: 5 up to 32 MiB, then
  4, 2, 1.

Processes (:mod:`lightning_mgpu.comm.allreduce_run`): the command starts ``--nproc``
workers itself with ``torch.multiprocessing`` (spawn), one per GPU on CUDA. They meet through a
``TCPStore`` that the launching process serves on 127.0.0.1 with a port the OS picks
(so two concurrent runs never collide), and gloo / NCCL are pinned to the loopback
interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless you set them). A
run never hangs: the process group's timeout and an overall deadline are both
``--timeout``; past it, or as soon as one worker dies, every worker is stopped and the
error names the rank and what happened to it.

JSON (``--json PATH``; ``schema_version`` 1). The communication profiler reads
``peak_busbw_gbps`` from it to express DDP's achieved busbw as a fraction of the
machine's ceiling::

    {"schema_version": 1,
     "collective": "all_reduce", "dtype": "float32", "op": "sum", "in_place": true,
     "world_size": int, "backend": "gloo" | "nccl", "device_type": "cpu" | "cuda",
     "launcher": "bench-comm" | "torchrun" | "srun",   # bench-comm: its own processes, one host
     "nodes": int, "ranks_per_node": [int, ...],
     "hosts": [{"node": int, "hostname": str, "address": str | null, "ranks": [int, ...]}, ...],
     "machine": {"torch": str, "python": str, "platform": str, "cpu_count": int,
                 "lightning_mgpu": str, "device_name": str,
                 "cuda": str | null, "nccl": str | null, "gpu_count": int,
                 "load_average": [f, f, f] | null},
     "settings": {"min_bytes": int, "max_bytes": int, "factor": int, "iters": int,
                  "warmup": int, "timeout_s": float, "timing": "host_clock" | "cuda_events",
                  "iteration_rule": str},
     "rows": [{"bytes": int, "count": int, "iters": int, "warmup": int,
               "time_us": f,          # slowest rank's median time per all_reduce
               "algbw_gbps": f, "busbw_gbps": f,
               "wrong": int,          # wrong elements, all ranks together
               "rank_time_us": [f, ...],          # each rank's median, by rank
               "cpu_us": f,           # the busiest rank's process CPU time per all_reduce (mean)
               "beside_time_us": f,   # --beside-compute: the slowest rank's median with compute beside it
               "beside_compute_share": f}, ...],  # ... and the share of its rate the worst-hit rank's compute kept
     "bus_factor": f,                 # 2(n-1)/n
     "peak_busbw_gbps": f, "peak_busbw_bytes": int,
     "latency_us": f, "latency_bytes": int,       # time at the smallest size
     "wrong_total": int, "duration_s": f,
     "other_dtypes": {"float16": {"rows": [...], "peak_busbw_gbps": f, ...}}}   # only with --dtype LIST

``--beside-compute`` (CPU): after each size's batch, every rank times it again while a thread of its own
multiplies 128 x 128 matrices (its intra-op threads, as backward computes; ``OMP_NUM_THREADS`` when set),
at least :data:`BESIDE_MIN_S` of it, and counts the products against its rate alone (timed once, before
the sweep, the same way beside a sleep).

``dtype`` is the sweep at the top level: float32 whenever it was measured (the profiler reads its
``peak_busbw_gbps``), else the first named; every other dtype's rows and summary are under
``other_dtypes`` (``wrong_total`` at the top level counts every sweep's). Rows are in increasing size.
Times are microseconds, bandwidths GB/s (10^9 bytes/s).
``launcher``, ``nodes``, ``ranks_per_node`` and ``hosts`` say where the ranks ran (``machine``
describes rank 0's): a file without them was written before bench-comm could cross nodes, by its
own processes on one host. ``address`` is the one a node reaches the first node from (two nodes
with one host name, e.g. network namespaces, still differ); 127.0.0.1 for bench-comm's own ranks.

Across nodes: started by ``torchrun`` or ``srun`` (one process per rank on every node), the
command joins that world instead of starting processes (:func:`lightning_mgpu.comm.allreduce_run.run_launched_sweep`),
runs one sweep over the real link, and rank 0 alone prints the table and writes ``--json``::

    srun --nodes=2 --ntasks-per-node=1 lightning-mgpu bench-comm --json link.json
    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        -m lightning_mgpu.cli bench-comm --json link.json          # on every node
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_mgpu._checks import check_int
from lightning_mgpu._sizes import GiB, KiB, MiB, format_size
from lightning_mgpu.comm.bandwidth import algbw_gbps, busbw_gbps

# ---------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------
DEFAULT_MIN_BYTES = 1 * KiB
DEFAULT_MAX_BYTES = 256 * MiB
DEFAULT_FACTOR = 2
DEFAULT_ITERS = 20  # nccl-tests' defaults: 20 timed, 5 warm-up
DEFAULT_WARMUP = 5
DEFAULT_CPU_NPROC = 2
DEFAULT_TIMEOUT_S = 300.0
# Beyond these a value is a mistake, not a measurement: refused before anything starts.
MAX_PROCESSES = 1024
MAX_MESSAGE_BYTES = 64 * GiB
MAX_COUNT = 1_000_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0

TIMED_BYTES_PER_SIZE = 1 * GiB
MIN_TIMED_ITERS = 5
WARMUP_BYTES_PER_SIZE = 256 * MiB
ITERATION_RULE = (
    f"timed iterations = min(iters, max({MIN_TIMED_ITERS}, {TIMED_BYTES_PER_SIZE // MiB} MiB // size)); "
    f"warm-up = min(warmup, max(1, {WARMUP_BYTES_PER_SIZE // MiB} MiB // size))"
)

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")
SCHEMA_VERSION = 1
COLLECTIVE = "all_reduce"
ELEMENT_BYTES = 4  # float32
BESIDE_CALIBRATION_S = 0.5
"""How long each rank times its compute alone before a ``--beside-compute`` sweep."""
BESIDE_WARMUP = 50
"""Untimed multiplications before the compute's rate alone is timed."""
BESIDE_MIN_S = 0.2
"""A size's batch beside compute lasts at least about this long (more iterations than ``iters`` when they are short),
so that the compute's share is counted over many multiplications."""
CHECK_PERIOD = 251  # prime, so a chunk landing at a wrong offset never lines up with the pattern
DTYPES = {"float32": 1 << 24, "float16": 1 << 11, "bfloat16": 1 << 8}
"""The dtypes a sweep can all-reduce, each with the integer up to which it holds every integer exactly
(the correctness check's sums stay at or below it)."""
DEFAULT_DTYPES = ("float32",)


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """``min_bytes``, ``min_bytes * factor``, ... up to and including ``max_bytes`` when reached."""
    if min_bytes < 1 or factor < 2 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def timed_iterations(nbytes: int, iters: int) -> int:
    """Timed all-reduces at this size: big messages get fewer (see the module docstring)."""
    return min(iters, max(MIN_TIMED_ITERS, TIMED_BYTES_PER_SIZE // nbytes))


def warmup_iterations(nbytes: int, warmup: int) -> int:
    return min(warmup, max(1, WARMUP_BYTES_PER_SIZE // nbytes))


@dataclass(kw_only=True)
class SweepSettings:
    """What ``lightning-mgpu bench-comm`` measures; each field is the flag of the same name.

    ``None`` for ``device``, ``backend`` or ``nproc`` picks the default for the machine:
    CUDA with NCCL on every visible GPU when CUDA is available, else CPU with gloo and 2
    processes. Invalid values raise ``ValueError`` naming the flag.
    """

    device: Optional[str] = None
    """"cpu" or "cuda"."""
    backend: Optional[str] = None
    """"gloo" (any device) or "nccl" (CUDA only)."""
    nproc: Optional[int] = None
    """Number of processes (the world size); one GPU each on CUDA."""
    min_bytes: int = DEFAULT_MIN_BYTES
    """Smallest message, in bytes; a multiple of 4 (float32 elements)."""
    max_bytes: int = DEFAULT_MAX_BYTES
    """Largest message, in bytes (included when the sizes land on it)."""
    factor: int = DEFAULT_FACTOR
    """Each size is the previous one times this."""
    iters: int = DEFAULT_ITERS
    """Timed all-reduces per size, before the large-size rule lowers it."""
    warmup: int = DEFAULT_WARMUP
    """Untimed all-reduces per size, before the large-size rule lowers it."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Deadline for the whole run, and the process group's collective timeout."""
    dtypes: Sequence[str] = DEFAULT_DTYPES
    """The element types swept, one sweep each (float32 first when named; see :data:`DTYPES`)."""
    beside_compute: bool = False
    """CPU: time each size a second time with a thread computing beside it on every rank (what backward does to the
    cores while DDP all-reduces), recording how much slower the all-reduce gets and how much of its rate the compute
    keeps (``beside_time_us``, ``beside_compute_share``)."""

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"--device cuda: no CUDA device is available (torch {torch.__version__}); use --device cpu"
            )
        if self.backend is None:
            self.backend = "nccl" if self.device == "cuda" else "gloo"
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError(
                "--backend nccl needs --device cuda (NCCL moves CUDA tensors only); use --backend gloo on CPU"
            )
        if self.nproc is None:
            self.nproc = torch.cuda.device_count() if self.device == "cuda" else DEFAULT_CPU_NPROC
        self.nproc = check_int("--nproc", self.nproc, maximum=MAX_PROCESSES)
        if self.device == "cuda" and self.nproc > torch.cuda.device_count():
            raise ValueError(
                f"--nproc {self.nproc} is more than the {torch.cuda.device_count()} visible CUDA device(s); "
                "bench-comm runs one process per GPU"
            )
        if self.min_bytes < ELEMENT_BYTES or self.min_bytes % ELEMENT_BYTES:
            raise ValueError(
                f"--min-bytes must be a positive multiple of {ELEMENT_BYTES} bytes (float32 elements), got {self.min_bytes}"
            )
        if self.max_bytes < self.min_bytes:
            raise ValueError(
                f"--max-bytes ({format_size(self.max_bytes)}) is smaller than --min-bytes ({format_size(self.min_bytes)})"
            )
        if self.max_bytes > MAX_MESSAGE_BYTES:
            raise ValueError(
                f"--max-bytes must be at most {format_size(MAX_MESSAGE_BYTES)} (every process holds the message), "
                f"got {format_size(self.max_bytes)}"
            )
        check_int("--factor", self.factor, minimum=2)
        check_int("--iters", self.iters, maximum=MAX_COUNT)
        check_int("--warmup", self.warmup, minimum=0, maximum=MAX_COUNT)
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # NaN fails too
            raise ValueError(
                f"--timeout must be > 0 seconds and at most {MAX_TIMEOUT_S:g} (7 days), got {self.timeout_s}"
            )

        self.dtypes = check_dtypes(self.dtypes)
        for dtype in self.dtypes:  # its own processes: the world size is known (a launcher's is checked on joining)
            try:
                check_period(getattr(torch, dtype), self.nproc)
            except ValueError as error:
                raise ValueError(f"--dtype {dtype} with --nproc {self.nproc}: {error}") from None
        if self.beside_compute and self.device != "cpu":
            raise ValueError(
                "--beside-compute measures an all-reduce sharing the CPU's cores with compute: CPU (gloo) only"
            )

    @property
    def sizes(self) -> list[int]:
        return message_sizes(self.min_bytes, self.max_bytes, self.factor)


def check_dtypes(dtypes: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """``"float16,float32"`` or a sequence -> ``("float32", "float16")``: known, each once, float32 first when
    named (the report's top level is its sweep); ValueError naming ``--dtype`` otherwise."""
    names = [d.strip() for d in dtypes.split(",")] if isinstance(dtypes, str) else [str(d).strip() for d in dtypes]
    unknown = [name for name in names if name not in DTYPES]
    if unknown or not names:
        raise ValueError(f"--dtype must name one or more of {', '.join(DTYPES)} (comma-separated), got {dtypes!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"--dtype names a type twice: {dtypes!r}")
    return tuple(sorted(names, key=lambda name: name != "float32"))


def element_bytes(dtype: str) -> int:
    """Bytes per element of one of :data:`DTYPES`."""
    return int(getattr(torch, dtype).itemsize)


# ---------------------------------------------------------------------------------------
# Measuring one size (runs in every worker)
# ---------------------------------------------------------------------------------------
def check_period(dtype: torch.dtype, world_size: int) -> int:
    """The check pattern's period for ``world_size`` ranks summing ``dtype``: :data:`CHECK_PERIOD`, or the largest
    prime below it whose sum over the ranks the type still holds exactly (ValueError when even 1 per rank is too
    much: bfloat16 over more than 256 ranks)."""
    exact = DTYPES[str(dtype).removeprefix("torch.")]
    limit = min(CHECK_PERIOD, exact // max(1, world_size))
    if limit < 1:
        raise ValueError(
            f"{str(dtype).removeprefix('torch.')} holds integers exactly only up to {exact}: the correctness check "
            f"cannot sum {world_size} ranks in it (sweep float32 or float16)"
        )
    while limit > 2 and any(limit % d == 0 for d in range(2, math.isqrt(limit) + 1)):
        limit -= 1
    return limit


def _check_block(rank: int, period: int, like: torch.Tensor) -> torch.Tensor:
    """One period of rank ``rank``'s check pattern: ``1 + (j + rank) mod period``."""
    return ((torch.arange(period, device=like.device) + rank) % period + 1).to(like.dtype)


def _by_period(buffer: torch.Tensor, period: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffer as whole periods (rows x period) and the tail, without copying."""
    whole = buffer.numel() // period * period
    return buffer[:whole].view(-1, period), buffer[whole:]


def fill_check_pattern(buffer: torch.Tensor, rank: int, world_size: int) -> None:
    """Write rank ``rank``'s contribution of the correctness check over ``world_size`` ranks into ``buffer``."""
    period = check_period(buffer.dtype, world_size)
    block = _check_block(rank, period, buffer)
    periods, tail = _by_period(buffer, period)
    periods.copy_(block.expand_as(periods))
    tail.copy_(block[: tail.numel()])


def count_wrong(buffer: torch.Tensor, world_size: int) -> int:
    """Elements of an all-reduced check buffer that differ from the exact sum over ``world_size`` ranks."""
    period = check_period(buffer.dtype, world_size)
    as_float = torch.zeros(period, device=buffer.device)
    expected = sum((_check_block(rank, period, as_float) for rank in range(world_size)), as_float)
    periods, tail = _by_period(buffer, period)
    wrong = (periods.float() != expected).sum() + (tail.float() != expected[: tail.numel()]).sum()
    return int(wrong.item())


def time_iterations(
    run_once: Callable[[], Any],
    iters: int,
    *,
    device: torch.device,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> list[float]:
    """Seconds taken by each of ``iters`` back-to-back calls of ``run_once``.

    CUDA: an event recorded after every launch, all read after the batch, so the host
    never waits inside it. CPU: ``clock()`` (nanoseconds) between calls.
    """
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]  # type: ignore[no-untyped-call]
        events[0].record()
        for index in range(iters):
            run_once()
            events[index + 1].record()
        events[-1].synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in zip(events[:-1], events[1:])]
    stamps = [clock()]
    for _ in range(iters):
        run_once()
        stamps.append(clock())
    return [(end - begin) / 1e9 for begin, end in zip(stamps[:-1], stamps[1:])]


def _line_up(device: torch.device) -> None:
    """Start every rank's timed batch together: a barrier, with the device idle on both sides of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier()
        torch.cuda.synchronize(device)
    else:
        dist.barrier()


SWEEP_WARMUP = 50
"""Untimed all-reduces of the smallest size before the sweep starts (see step 0 above)."""


def warm_up_group(nbytes: int, *, device: torch.device, count: int = SWEEP_WARMUP) -> None:
    """``count`` untimed all-reduces of ``nbytes`` on every rank, then the ranks lined up: the
    group's one-time start-up costs (gloo's pairs and buffers, the allocator, worker threads,
    NCCL's communicator) paid before anything is timed."""
    buffer = torch.zeros(max(1, nbytes // ELEMENT_BYTES), dtype=torch.float32, device=device)
    for _ in range(count):
        dist.all_reduce(buffer)
    _line_up(device)


class ComputeBeside:
    """Compute on this rank's cores while something else runs: a thread multiplying two 128 x 128 float32 matrices
    back to back (torch's intra-op threads, as backward uses them). :meth:`rate` is multiplications per second,
    alone; :meth:`share_during` runs it beside ``work`` and says what share of that rate it kept."""

    SIZE = 128  # small: the share is counted in whole multiplications, many of them within one batch

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.a = torch.rand(self.SIZE, self.SIZE, generator=generator)
        self.b = torch.rand(self.SIZE, self.SIZE, generator=generator)
        self.alone = 0.0

    def rate(self, seconds: float = BESIDE_CALIBRATION_S) -> float:
        """Multiplications per second with nothing else of this process running (kept as :attr:`alone`): the same
        thread :meth:`share_during` runs, beside a sleep."""
        self.alone = 0.0
        _, rate = self._spin_during(lambda: time.sleep(seconds), warmup=BESIDE_WARMUP)
        self.alone = rate
        return rate

    def share_during(self, work: Callable[[], Any]) -> tuple[Any, float]:
        """``work()``'s result, and the share of :attr:`alone`'s rate the compute kept while it ran."""
        result, rate = self._spin_during(work)
        return result, (rate / self.alone if self.alone > 0 else math.nan)

    def _spin_during(self, work: Callable[[], Any], warmup: int = 0) -> tuple[Any, float]:
        """``work()``'s result and the multiplications per second a thread did while it ran (after ``warmup``
        untimed ones, done before ``work`` starts)."""
        stop, started, count = threading.Event(), threading.Event(), [0]
        threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the same as the caller's

        def spin() -> None:
            torch.set_num_threads(threads)
            for _ in range(warmup):  # the first multiplications pay one-time costs (kernels, thread pool)
                torch.mm(self.a, self.b)
            started.set()
            while not stop.is_set():
                torch.mm(self.a, self.b)
                count[0] += 1

        thread = threading.Thread(target=spin, name="bench-comm-compute", daemon=True)
        thread.start()
        started.wait()
        begin = time.perf_counter()
        try:
            result = work()
        finally:
            stop.set()
            thread.join()
        return result, count[0] / max(1e-9, time.perf_counter() - begin)


def measure_size(
    nbytes: int,
    *,
    iters: int,
    warmup: int,
    rank: int,
    world_size: int,
    device: torch.device,
    dtype: str = "float32",
    beside: Optional[ComputeBeside] = None,
) -> tuple[float, int, float, Optional[float], Optional[float]]:
    """This rank's median seconds per all_reduce of ``nbytes`` of ``dtype``, its wrong elements in the check, the
    CPU seconds its process spent per all_reduce (every thread: gloo's copies and sums and the kernel's socket work
    charged to it), the mean over the timed batch, and (``beside``) the median seconds of a second batch timed with
    ``beside`` computing on this rank, and the share of its rate the compute kept meanwhile (else None, None)."""
    buffer = torch.zeros(nbytes // element_bytes(dtype), dtype=getattr(torch, dtype), device=device)
    for _ in range(warmup):
        dist.all_reduce(buffer)
    _line_up(device)
    cpu_before = time.process_time()
    seconds = time_iterations(lambda: dist.all_reduce(buffer), iters, device=device)
    cpu = (time.process_time() - cpu_before) / max(1, iters)

    beside_seconds: Optional[float] = None
    kept: Optional[float] = None
    if beside is not None:
        # at least BESIDE_MIN_S of all-reduces (as many on every rank: the count comes from an all-reduced figure)
        longest = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        count = max(iters, math.ceil(BESIDE_MIN_S / max(float(longest), 1e-6)))
        _line_up(device)
        timed, kept = beside.share_during(
            lambda: time_iterations(lambda: dist.all_reduce(buffer), count, device=device)
        )
        beside_seconds = statistics.median(timed)

    fill_check_pattern(buffer, rank, world_size)
    dist.all_reduce(buffer)
    wrong = count_wrong(buffer, world_size)
    return statistics.median(seconds), wrong, cpu, beside_seconds, kept


def size_row(
    nbytes: int,
    rank_seconds: Sequence[float],
    rank_wrong: Sequence[int],
    *,
    iters: int,
    warmup: int,
    rank_cpu_seconds: Optional[Sequence[float]] = None,
    dtype: str = "float32",
    rank_beside_seconds: Optional[Sequence[Optional[float]]] = None,
    rank_compute_share: Optional[Sequence[Optional[float]]] = None,
) -> dict[str, Any]:
    """One table row from every rank's median time and wrong count: the slowest rank decides (``cpu_us``, the CPU
    time per all_reduce, is the busiest rank's, when given; ``beside_time_us`` the slowest rank's time beside compute,
    ``beside_compute_share`` the share of its rate the worst-hit rank's compute kept)."""
    world_size = len(rank_seconds)
    seconds = max(rank_seconds)
    cpu = {} if rank_cpu_seconds is None else {"cpu_us": max(rank_cpu_seconds) * 1e6}
    if rank_beside_seconds is not None and rank_compute_share is not None and None not in rank_beside_seconds:
        cpu["beside_time_us"] = max(t for t in rank_beside_seconds if t is not None) * 1e6
        cpu["beside_compute_share"] = min(s for s in rank_compute_share if s is not None)
    return {
        **cpu,
        "bytes": nbytes,
        "count": nbytes // element_bytes(dtype),
        "iters": iters,
        "warmup": warmup,
        "time_us": seconds * 1e6,
        "algbw_gbps": algbw_gbps(nbytes, seconds),
        "busbw_gbps": busbw_gbps(COLLECTIVE, nbytes, seconds, world_size),
        "wrong": int(sum(rank_wrong)),
        "rank_time_us": [s * 1e6 for s in rank_seconds],
    }


def summarize_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Peak busbw (and where), the small-message latency and the wrong elements of a whole sweep."""
    if not rows:
        raise ValueError("no rows to summarize")
    peak = max(rows, key=lambda row: row["busbw_gbps"])
    smallest = min(rows, key=lambda row: row["bytes"])
    return {
        "peak_busbw_gbps": peak["busbw_gbps"],
        "peak_busbw_bytes": peak["bytes"],
        "latency_us": smallest["time_us"],
        "latency_bytes": smallest["bytes"],
        "wrong_total": sum(row["wrong"] for row in rows),
    }


def write_report(report: dict[str, Any], path: os.PathLike[str] | str) -> Path:
    """Write the report as JSON (parents created; via a temporary file, so never half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(target)
    return target


def load_report(path: os.PathLike[str] | str) -> dict[str, Any]:
    """Read a bench-comm JSON file, refusing one written with another schema version."""
    report: dict[str, Any] = json.loads(Path(path).read_text())
    if report.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version {report.get('schema_version')!r}, expected {SCHEMA_VERSION}; "
            "re-run `lightning-mgpu bench-comm --json PATH`"
        )
    if not math.isfinite(float(report.get("peak_busbw_gbps", float("nan")))):
        raise ValueError(f"{path}: no finite peak_busbw_gbps")
    return report


__all__ = [
    "GiB",
    "KiB",
    "MiB",
    "DTYPES",
    "ComputeBeside",
    "SCHEMA_VERSION",
    "SweepSettings",
    "check_dtypes",
    "check_period",
    "count_wrong",
    "element_bytes",
    "fill_check_pattern",
    "format_size",
    "load_report",
    "measure_size",
    "message_sizes",
    "size_row",
    "summarize_rows",
    "time_iterations",
    "timed_iterations",
    "warm_up_group",
    "warmup_iterations",
    "write_report",
]
