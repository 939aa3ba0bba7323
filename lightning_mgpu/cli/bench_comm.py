"""``lightning-mgpu bench-comm``: an nccl-tests-style all_reduce sweep, its flags and its table.

The measurement (what is timed and how, the JSON schema) is :mod:`lightning_mgpu.comm.sweep`;
this module turns flags into its settings and prints its report.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning_mgpu.cli._args import bounded_int, output_file, size


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench-comm",
        help="all_reduce bandwidth sweep, nccl-tests style (size, time, algbw, busbw, #wrong)",
        description="Time all_reduce of float32 tensors from --min-bytes to --max-bytes in --nproc processes "
        "it starts itself (127.0.0.1 only), check the results, and print algbw / busbw as nccl-tests does.",
    )
    parser.add_argument("--nproc", type=bounded_int(), default=None, help="processes (default: 2 on CPU, every GPU on CUDA)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--min-bytes", type=size, default=None, metavar="SIZE", help="smallest message (default 1KiB)")
    parser.add_argument("--max-bytes", type=size, default=None, metavar="SIZE", help="largest message (default 256MiB)")
    parser.add_argument("--factor", type=int, default=None, help="size multiplier between steps (default 2)")
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed all_reduces per size (default 20); large sizes get fewer: min(iters, max(5, 1GiB // size))",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed all_reduces first (default 5): min(warmup, max(1, 256MiB // size))"
    )
    # A plain float: the settings check it, with the message programmatic callers get too.
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="stop everything after this long (default 300)"
    )
    parser.add_argument("--json", type=output_file, metavar="PATH", default=None, help="also write the results as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines while measuring")
    parser.set_defaults(func=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    from lightning_mgpu.comm import sweep

    parser: argparse.ArgumentParser = args.subparser
    # Flags left out fall back to SweepSettings' defaults, the one place they are defined.
    given: dict[str, Any] = {
        "device": args.device,
        "backend": args.backend,
        "nproc": args.nproc,
        "min_bytes": args.min_bytes,
        "max_bytes": args.max_bytes,
        "factor": args.factor,
        "iters": args.iters,
        "warmup": args.warmup,
        "timeout_s": args.timeout,
    }
    try:
        settings = sweep.SweepSettings(**{name: value for name, value in given.items() if value is not None})
    except ValueError as exc:
        parser.error(str(exc))
    try:
        report = sweep.run_sweep(settings, progress=not args.quiet)
    except sweep.BenchCommError as exc:
        if exc.details:
            print(exc.details, file=sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    sweep.print_report(report)
    if args.json:
        print(f"wrote {sweep.write_report(report, args.json)}")
    if report["wrong_total"]:
        print(f"{parser.prog}: error: all_reduce returned {report['wrong_total']} wrong element(s)", file=sys.stderr)
        return 1
    return 0
