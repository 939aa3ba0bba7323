"""Runs the all_reduce benchmark: starts the worker processes, meets them on a loopback store, never hangs.

:func:`run_sweep` starts ``settings.nproc`` workers with ``torch.multiprocessing`` (spawn), one
per GPU on CUDA. They meet through a ``TCPStore`` that the launching process serves on
127.0.0.1 with a port the OS picks, and gloo / NCCL are pinned to the loopback interface.
Each worker measures every size (:func:`lightning_mgpu.comm.allreduce_bench.measure_size`);
rank 0 writes the rows, and the launching process assembles the report (the JSON schema in
:mod:`lightning_mgpu.comm.allreduce_bench`). :func:`launch_workers` stops every worker as
soon as one dies or the deadline passes, and names the rank.

Started by a launcher instead (``torchrun``, or ``srun`` inside a SLURM job: one process per rank,
on every node; :mod:`lightning_mgpu.comm.launched` reads its variables), :func:`run_launched_sweep`
joins that world and runs one sweep over it, across whatever links join its nodes: every rank
measures, rank 0 assembles the report, which records where the ranks ran (the launcher, the nodes,
the ranks on each, each node's host name and address).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from lightning_mgpu.comm.allreduce_bench import (
    COLLECTIVE,
    ITERATION_RULE,
    ComputeBeside,
    check_period,
    SCHEMA_VERSION,
    SweepSettings,
    format_size,
    measure_size,
    size_row,
    summarize_rows,
    timed_iterations,
    warm_up_group,
    warmup_iterations,
    write_report,
)
from lightning_mgpu.comm.bandwidth import bus_factor
from lightning_mgpu.comm.distributed import LOOPBACK, loopback_store, pin_backend_to_loopback
from lightning_mgpu.comm.launched import LaunchedWorld, join

STOP_GRACE_S = 5.0


class BenchCommError(RuntimeError):
    """The sweep could not finish: a worker died, timed out, or left no result. ``details``: a worker's traceback."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


# ---------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------
def threads_per_rank(ranks_here: int, environ: Optional[dict[str, str]] = None) -> int:
    """torch's intra-op threads for one of ``ranks_here`` ranks on this host: ``OMP_NUM_THREADS`` when set (as the
    training job beside it sets it), else the cores shared out, at least 1 (more threads than cores only fight over
    them: OpenMP's threads spin, and a multiplication beside another rank's can run a hundred times slower)."""
    given = (environ if environ is not None else os.environ).get("OMP_NUM_THREADS", "")
    if given.strip().isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // max(1, ranks_here))


def _machine_facts(settings: SweepSettings, device: torch.device) -> dict[str, Any]:
    from lightning_mgpu._version import __version__

    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "lightning_mgpu": __version__,
        "device_name": platform.processor() or platform.machine(),
        "cuda": None,
        "nccl": None,
        "gpu_count": 0,
        # Other work on the machine shows up in CPU numbers; this says how much there was.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        facts["device_name"] = torch.cuda.get_device_name(device)
        facts["cuda"] = torch.version.cuda
        facts["gpu_count"] = torch.cuda.device_count()
        if settings.backend == "nccl":
            version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # (major, minor, patch); an int in old torch
            facts["nccl"] = ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)
    return facts


def _sweep_rows(
    settings: SweepSettings, *, rank: int, world_size: int, device: torch.device, progress: bool
) -> dict[str, list[dict[str, Any]]]:
    """Every size of the sweep, per dtype, on the joined group (every rank calls it): the rows by dtype, the same on
    every rank."""
    for dtype in settings.dtypes:  # a type that cannot hold the check's sums for this world: refused before timing
        check_period(getattr(torch, dtype), world_size)
    if settings.warmup > 0:  # the group's start-up costs, before the first (smallest) size is timed
        warm_up_group(min(settings.sizes), device=device)
    beside = ComputeBeside() if settings.beside_compute else None
    if beside is not None:  # every rank's compute alone, at once (as the ranks will compute beside the all-reduces)
        dist.barrier()
        beside.rate()
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for dtype in settings.dtypes:
        rows = sweeps.setdefault(dtype, [])
        for nbytes in settings.sizes:
            iters = timed_iterations(nbytes, settings.iters)
            warmup = warmup_iterations(nbytes, settings.warmup)
            measured = measure_size(
                nbytes,
                iters=iters,
                warmup=warmup,
                rank=rank,
                world_size=world_size,
                device=device,
                dtype=dtype,
                beside=beside,
            )
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, measured)  # outside the timed batch
            seconds, wrong, cpu, beside_seconds, kept = zip(*gathered)
            row = size_row(
                nbytes,
                seconds,
                wrong,
                iters=iters,
                warmup=warmup,
                rank_cpu_seconds=cpu,
                dtype=dtype,
                rank_beside_seconds=beside_seconds,
                rank_compute_share=kept,
            )
            rows.append(row)
            if progress and rank == 0:
                print(
                    f"bench-comm: {dtype:>8} {format_size(nbytes):>8}  {row['time_us']:>12,.1f} us  "
                    f"busbw {row['busbw_gbps']:8.2f} GB/s  ({iters} iters)",
                    file=sys.stderr,
                    flush=True,
                )
    return sweeps


def _sweep_worker(rank: int, settings: SweepSettings, store_port: int, result_path: str, progress: bool) -> None:
    world_size = int(settings.nproc or 1)
    pin_backend_to_loopback(str(settings.backend))  # gloo and NCCL open sockets of their own besides the store's
    if settings.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads_per_rank(world_size))
    timeout = timedelta(seconds=settings.timeout_s)
    store = loopback_store(LOOPBACK, store_port, None, is_master=False, timeout=timeout)
    # NCCL binds the group to this rank's GPU at once
    bound: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        str(settings.backend), store=store, rank=rank, world_size=world_size, timeout=timeout, **bound
    )
    try:
        sweeps = _sweep_rows(settings, rank=rank, world_size=world_size, device=device, progress=progress)
        if rank == 0:
            write_report({"machine": _machine_facts(settings, device), "sweeps": sweeps}, result_path)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------
def _stop(processes: Sequence[Any], grace_s: float) -> None:
    """SIGTERM whatever still runs, SIGKILL what ignores it (a rank stuck inside a collective may)."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def launch_workers(
    worker: Callable[..., None], args: tuple[Any, ...], *, nproc: int, timeout_s: float, grace_s: float = STOP_GRACE_S
) -> None:
    """Run ``worker(rank, *args)`` in ``nproc`` spawned processes; return when all succeeded.

    Raises :class:`BenchCommError` naming the rank as soon as one fails (the others are
    stopped), or when they are not all done within ``timeout_s`` (all are stopped).
    ``worker`` must be importable by the children (defined at a module's top level).
    """
    context = torch_mp.start_processes(  # type: ignore[no-untyped-call]  # untyped in torch
        worker, args=args, nprocs=nproc, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
                raise BenchCommError(
                    f"did not finish within --timeout {timeout_s:g} s; stopped rank(s) {running}, which were still "
                    "running (a rank stuck in a collective, or a machine too busy: raise --timeout or lower --max-bytes)"
                )
            try:
                if context.join(timeout=min(remaining, 1.0), grace_period=grace_s):
                    return
            except torch_mp.ProcessRaisedException as exc:
                raise BenchCommError(
                    f"rank {exc.error_index} (pid {exc.error_pid}) failed: {_last_line(exc.msg)}",
                    details=exc.msg.strip(),
                ) from None
            except torch_mp.ProcessExitedException as exc:
                how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
                raise BenchCommError(
                    f"rank {exc.error_index} (pid {exc.error_pid}) {how} without a Python error "
                    "(out of memory? a crash inside the backend?); the other ranks were stopped"
                ) from None
    finally:
        _stop(context.processes, grace_s)


def run_sweep(settings: SweepSettings, *, progress: bool = False) -> dict[str, Any]:
    """Run the sweep in ``settings.nproc`` fresh processes and return the report.

    The report follows the JSON schema in :mod:`lightning_mgpu.comm.allreduce_bench`.
    """
    started = time.monotonic()
    # The rendezvous store lives here, in the launching process, on a port the OS picks:
    # no window in which another program could take a port we chose in advance, and its
    # socket listens on 127.0.0.1 only (TCPStore binds every interface when it makes its own).
    store = loopback_store(
        LOOPBACK, 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=settings.timeout_s)
    )
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as workdir:
        result_path = os.path.join(workdir, "rank0.json")
        launch_workers(
            _sweep_worker,
            (settings, store.port, result_path, progress),
            nproc=int(settings.nproc or 1),
            timeout_s=settings.timeout_s,
        )
        if not os.path.exists(result_path):
            raise BenchCommError("the workers finished but rank 0 wrote no result")
        measured = json.loads(Path(result_path).read_text())
    del store
    world_size = int(settings.nproc or 1)
    hosts = [{"node": 0, "hostname": socket.gethostname(), "address": LOOPBACK, "ranks": list(range(world_size))}]
    return _report(settings, world_size, measured["machine"], measured["sweeps"], started, "bench-comm", hosts)


def _report(
    settings: SweepSettings,
    world_size: int,
    machine: dict[str, Any],
    sweeps: dict[str, list[dict[str, Any]]],
    started: float,
    launcher: str,
    hosts: list[dict[str, Any]],
) -> dict[str, Any]:
    """The report (the JSON schema in :mod:`lightning_mgpu.comm.allreduce_bench`)."""
    settings_record = {
        key: value for key, value in asdict(settings).items() if key not in ("device", "backend", "nproc")
    }
    settings_record["timing"] = "cuda_events" if settings.device == "cuda" else "host_clock"
    settings_record["iteration_rule"] = ITERATION_RULE
    settings_record["dtypes"] = list(settings.dtypes)
    first, *others = settings.dtypes  # float32 first whenever it was swept
    rows = sweeps[first]
    other_dtypes = {dtype: {"rows": sweeps[dtype], **summarize_rows(sweeps[dtype])} for dtype in others}
    more = {"other_dtypes": other_dtypes} if other_dtypes else {}
    return {
        "schema_version": SCHEMA_VERSION,
        "collective": COLLECTIVE,
        "dtype": first,
        "op": "sum",
        "in_place": True,
        "world_size": world_size,
        "backend": settings.backend,
        "device_type": settings.device,
        "launcher": launcher,
        "nodes": len(hosts),
        "ranks_per_node": [len(host["ranks"]) for host in hosts],
        "hosts": hosts,
        "machine": machine,
        "settings": settings_record,
        "rows": rows,
        "bus_factor": bus_factor(COLLECTIVE, world_size),
        **summarize_rows(rows),
        "wrong_total": sum(summarize_rows(sweep)["wrong_total"] for sweep in sweeps.values()),
        "duration_s": time.monotonic() - started,
        **more,
    }


# ---------------------------------------------------------------------------------------
# Started by a launcher: one sweep across its world
# ---------------------------------------------------------------------------------------
def link_address(host: str, port: int) -> Optional[str]:
    """The address this machine reaches ``host`` from (a UDP socket's route: nothing is sent), None if unknown.

    On one machine's loopback that is 127.0.0.1; across nodes, the address of the interface the
    traffic leaves by: two nodes with the same host name (containers, network namespaces) still differ.
    """
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except (OSError, IndexError):
        return None


def hosts_of(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's ``{"rank", "node", "hostname", "address"}`` -> one entry per node, node order, ranks sorted."""
    nodes: dict[int, dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: r["rank"]):
        entry = nodes.setdefault(
            int(record["node"]),
            {"node": int(record["node"]), "hostname": record["hostname"], "address": record["address"], "ranks": []},
        )
        entry["ranks"].append(int(record["rank"]))
    return [nodes[node] for node in sorted(nodes)]


def run_launched_sweep(settings: SweepSettings, world: LaunchedWorld, *, progress: bool = False) -> dict[str, Any]:
    """Join the world a launcher started this process in and run one sweep across it (every rank calls this).

    Every rank returns the report (rank 0 is the one to print and write it). ``settings.nproc`` is
    ignored: the launcher decided the ranks. gloo (or NCCL) picks its interface as it does for a
    training job in the same world (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` when set). The
    rendezvous and every collective are bounded by ``settings.timeout_s`` (the process group's
    timeout): a rank that did not come is a :class:`BenchCommError`, a collective that a lost rank
    never finishes raises (gloo) or aborts the process (NCCL's watchdog); the launcher ends the rest.
    """
    started = time.monotonic()
    where = f"rank {world.rank} of {world.world_size} ({world.launcher}) on {socket.gethostname()}"
    if settings.device == "cuda":
        device = torch.device("cuda", world.local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    try:
        join(world, backend=str(settings.backend), timeout=timedelta(seconds=settings.timeout_s))
    except Exception as error:  # noqa: BLE001 - any failure to meet is reported the same way
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise BenchCommError(
            f"{where} could not join the world at {world.master_addr}:{world.master_port} within "
            f"{settings.timeout_s:g} s: {first} (did every node start? does {world.master_addr} resolve and "
            "reach every node?)"
        ) from None
    try:
        me = {
            "rank": world.rank,
            "node": world.node_rank,
            "hostname": socket.gethostname(),
            "address": link_address(world.master_addr, world.master_port),
        }
        everyone: list[Any] = [None] * world.world_size
        dist.all_gather_object(everyone, me)
        hosts = hosts_of(everyone)
        if device.type == "cpu":  # the node's ranks share its cores
            on_my_node = next(len(h["ranks"]) for h in hosts if world.rank in h["ranks"])
            torch.set_num_threads(threads_per_rank(on_my_node))
        sweeps = _sweep_rows(settings, rank=world.rank, world_size=world.world_size, device=device, progress=progress)
        machine = _machine_facts(settings, device)
    finally:
        dist.destroy_process_group()
    return _report(settings, world.world_size, machine, sweeps, started, world.launcher, hosts)


__all__ = [
    "BenchCommError",
    "hosts_of",
    "threads_per_rank",
    "launch_workers",
    "link_address",
    "run_launched_sweep",
    "run_sweep",
]
