"""``lightning-mgpu bench-comm``: an nccl-tests-style all_reduce sweep, its flags and its table.

The measurement (what is timed and how, the JSON schema) is
:mod:`lightning_mgpu.comm.allreduce_bench`, the processes :mod:`lightning_mgpu.comm.allreduce_run`;
this module turns flags into settings and prints the report.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lightning_mgpu._tables import table, wide_console
from lightning_mgpu._sizes import format_size
from lightning_mgpu.cli._args import bounded_int, output_file, size


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench-comm",
        help="all_reduce bandwidth sweep, nccl-tests style (size, time, algbw, busbw, #wrong)",
        description="Time all_reduce of float32 tensors (or --dtype's) from --min-bytes to --max-bytes in --nproc processes "
        "it starts itself (127.0.0.1 only), check the results, and print algbw / busbw as nccl-tests does. "
        "Started by torchrun or srun on every node instead, it joins that world and measures the link "
        "between the nodes: one sweep, one table and one --json, from rank 0.",
    )
    parser.add_argument(
        "--nproc",
        type=bounded_int(),
        default=None,
        help="processes (default: 2 on CPU, every GPU on CUDA; under torchrun/srun: the launcher's ranks)",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu"
    )
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--min-bytes", type=size, default=None, metavar="SIZE", help="smallest message (default 1KiB)")
    parser.add_argument("--max-bytes", type=size, default=None, metavar="SIZE", help="largest message (default 256MiB)")
    parser.add_argument("--factor", type=int, default=None, help="size multiplier between steps (default 2)")
    parser.add_argument(
        "--dtype",
        default=None,
        metavar="LIST",
        help="element types to sweep, comma-separated: float32 (default), float16, bfloat16; one sweep each. "
        "`whatif --link-bench` predicts fp16/bf16 compression from a 16-bit sweep when the file has one "
        "(on CPU gloo sums 16-bit types slower than float32)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed all_reduces per size (default 20); large sizes get fewer: min(iters, max(5, 1GiB // size))",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed all_reduces first (default 5): min(warmup, max(1, 256MiB // size))",
    )
    parser.add_argument(
        "--beside-compute",
        action="store_true",
        help="CPU: time each size again with a thread computing beside it on every rank (as backward does while DDP "
        "all-reduces): the JSON's beside_time_us and beside_compute_share, which `whatif --link-bench` uses for the "
        "all-reduces that overlap backward",
    )
    # A plain float: the settings check it, with the message programmatic callers get too.
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="stop everything after this long (default 300)"
    )
    parser.add_argument(
        "--json",
        type=output_file,
        metavar="PATH",
        default=None,
        help="also write the results as JSON here (rank 0's node, under a launcher)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines while measuring")
    parser.set_defaults(func=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    from lightning_mgpu.comm import allreduce_bench, allreduce_run
    from lightning_mgpu.comm.launched import launched_world

    parser: argparse.ArgumentParser = args.subparser
    try:
        world = launched_world(os.environ)
    except ValueError as exc:
        parser.error(f"started by a launcher with a malformed variable: {exc}")
    if world is not None and args.nproc is not None:
        parser.error(
            f"--nproc: started by {world.launcher} as one of {world.world_size} ranks, the launcher decides the "
            "processes (leave --nproc out, or run bench-comm on its own for a sweep on this machine)"
        )
    # Flags left out fall back to SweepSettings' defaults, the one place they are defined.
    given: dict[str, Any] = {
        "device": args.device,
        "backend": args.backend,
        "nproc": 1 if world is not None else args.nproc,  # the launcher's world decides, not this setting
        "min_bytes": args.min_bytes,
        "max_bytes": args.max_bytes,
        "factor": args.factor,
        "iters": args.iters,
        "warmup": args.warmup,
        "timeout_s": args.timeout,
        "dtypes": args.dtype,
        "beside_compute": args.beside_compute or None,
    }
    try:
        settings = allreduce_bench.SweepSettings(**{name: value for name, value in given.items() if value is not None})
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if world is None:
            report = allreduce_run.run_sweep(settings, progress=not args.quiet)
        else:
            report = allreduce_run.run_launched_sweep(settings, world, progress=not args.quiet)
    except allreduce_run.BenchCommError as exc:
        if exc.details:
            print(exc.details, file=sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    if world is None or world.rank == 0:  # one table and one file for the whole world
        print_report(report)
        if args.json:
            print(f"wrote {allreduce_bench.write_report(report, args.json)}")
    if report["wrong_total"]:
        print(f"{parser.prog}: error: all_reduce returned {report['wrong_total']} wrong element(s)", file=sys.stderr)
        return 1
    return 0


def where_line(report: dict[str, Any]) -> str:
    """Where the ranks ran: ``2 nodes (srun): node0 127.78.0.1 [rank 0], node1 127.78.0.2 [rank 1]``, one host's
    loopback, or unknown (a file written before bench-comm recorded it)."""
    hosts = report.get("hosts")
    if not hosts:
        return "where the ranks ran is not recorded (a bench-comm result from before it crossed nodes: one host)"
    if report.get("launcher") == "bench-comm":
        return f"one host ({hosts[0]['hostname']}), {report['world_size']} ranks started by bench-comm over loopback"
    placed = ", ".join(
        f"{h['hostname']} {h.get('address') or '?'} [rank{'s' if len(h['ranks']) > 1 else ''} "
        f"{','.join(str(r) for r in h['ranks'])}]"
        for h in hosts
    )
    nodes = f"{len(hosts)} node{'s' if len(hosts) > 1 else ''}"
    return f"{nodes} ({report.get('launcher')}): {placed}"


def sweeps(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(dtype, its sweep: ``rows`` and the summary fields) for every dtype of a report, the top-level one first."""
    return [(report.get("dtype", "float32"), report), *report.get("other_dtypes", {}).items()]


def summary_line(report: dict[str, Any]) -> str:
    """``peak busbw 1.83 GB/s at 64 MiB; small-message latency 312.4 us (1 KiB); 0 wrong; 19 sizes in 12.3 s``
    (with more than one dtype, each other one's peak and latency after the first's, named: ``...; float16: peak
    busbw ...``)."""
    measured = sweeps(report)
    each = "; ".join(
        (f"{dtype}: " if index else "")
        + f"peak busbw {sweep['peak_busbw_gbps']:.2f} GB/s at {format_size(sweep['peak_busbw_bytes'])}; "
        f"small-message latency {sweep['latency_us']:,.1f} µs ({format_size(sweep['latency_bytes'])})"
        for index, (dtype, sweep) in enumerate(measured)
    )
    sizes = sum(len(sweep["rows"]) for _, sweep in measured)
    line = f"{each}; {report['wrong_total']} wrong; {sizes} sizes in {report['duration_s']:.1f} s"
    if report["world_size"] == 1:
        line += " (one process: nothing crosses a link, so busbw is 0 by definition)"
    return line


def print_report(report: dict[str, Any], *, console: Any = None) -> None:
    """The nccl-tests-like table, then the one-line summary."""
    console = wide_console(console)
    machine = report["machine"]
    notes = (
        f"time: slowest rank's median per all_reduce · busbw = algbw × 2(n-1)/n = algbw × {report['bus_factor']:.2f}"
        f" · GB/s = 10^9 B/s · torch {machine.get('torch')}, {machine.get('device_name')}"
    )
    if report.get("settings", {}).get("beside_compute"):
        notes += (
            " · beside compute: the same all_reduce with a thread multiplying matrices on every rank; compute kept: "
            "its rate meanwhile over its rate alone (the worst-hit rank's)"
        )
    for dtype, sweep in sweeps(report):
        title = (
            f"all_reduce ({dtype}, sum, in place): {report['world_size']} ranks, {report['backend']}, "
            f"{report['device_type']}"
        )
        beside = all("beside_time_us" in row for row in sweep["rows"]) and bool(sweep["rows"])
        columns: tuple[str, ...] = ("size", "count", "iters", "time (µs)", "algbw (GB/s)", "busbw (GB/s)", "#wrong")
        columns += ("beside compute (µs)", "compute kept") if beside else ()
        rows = []
        for row in sweep["rows"]:
            cells = [
                format_size(row["bytes"]),
                f"{row['count']:,}",
                str(row["iters"]),
                f"{row['time_us']:,.1f}",
                f"{row['algbw_gbps']:.2f}",
                f"{row['busbw_gbps']:.2f}",
                str(row["wrong"]) if row["wrong"] == 0 else f"[bold red]{row['wrong']}[/]",
            ]
            if beside:
                cells += [f"{row['beside_time_us']:,.1f}", f"{row['beside_compute_share']:.0%}"]
            rows.append(cells)
        console.print(table(title, columns, rows))
    console.print(where_line(report), highlight=False, markup=False, soft_wrap=True)
    console.print(notes, style="dim", highlight=False, soft_wrap=True)
    style = "bold" if report["wrong_total"] == 0 else "bold red"
    console.print(summary_line(report), style=style, highlight=False, soft_wrap=True)
