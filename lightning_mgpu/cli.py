"""The ``lightning-mgpu`` console script.

``strategies`` and ``bench-comm`` (an nccl-tests-style all_reduce sweep, see
:mod:`lightning_mgpu.comm.sweep`) live here; ``doctor``, ``tune`` and ``plan`` live next to
the features behind them, each module exposing ``register(subparsers)`` (listed in
``_FEATURE_COMMANDS``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Callable, Optional, Sequence


def _cmd_strategies(args: argparse.Namespace) -> int:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_mgpu

    rows = [
        {"name": name, "description": StrategyRegistry[name]["description"], "options": StrategyRegistry[name]["init_params"]}
        for name in lightning_mgpu.STRATEGY_NAMES
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lightning_mgpu {lightning_mgpu.__version__}: Trainer(strategy=...) names")
    table.add_column("name", style="bold")
    table.add_column("what it is")
    table.add_column("preset options")
    for row in rows:
        options = ", ".join(f"{k}={v!r}" for k, v in row["options"].items()) or "-"
        table.add_row(row["name"], row["description"], options)
    Console().print(table)
    return 0


def bounded_int(maximum: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= 1 (and <= ``maximum``), shared by every subcommand."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1 and at most {maximum}, got {text!r}")
        return value

    return parse


_positive_int = bounded_int()


def _cmd_bench_comm(args: argparse.Namespace) -> int:
    from lightning_mgpu.comm import sweep

    parser: argparse.ArgumentParser = args.subparser
    # Flags left out fall back to SweepSettings' defaults, the one place they are defined.
    given: dict[str, Any] = {
        "device": args.device,
        "backend": args.backend,
        "nproc": args.nproc,
        "factor": args.factor,
        "iters": args.iters,
        "warmup": args.warmup,
        "timeout_s": args.timeout,
    }
    for name, flag, text in (("min_bytes", "--min-bytes", args.min_bytes), ("max_bytes", "--max-bytes", args.max_bytes)):
        try:
            given[name] = None if text is None else sweep.parse_size(text)
        except ValueError as exc:
            parser.error(f"argument {flag}: {exc}")
    if args.json is not None and (not args.json.strip() or os.path.isdir(args.json)):
        parser.error(f"argument --json: expected the path of a file to write, got {args.json!r}")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-mgpu",
        description="Multi-GPU training for PyTorch Lightning: strategies, profiling and checks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    strategies = sub.add_parser("strategies", help="list the strategy names this package registers")
    strategies.add_argument("--json", action="store_true", help="print JSON instead of a table")
    strategies.set_defaults(func=_cmd_strategies)

    bench = sub.add_parser(
        "bench-comm",
        help="all_reduce bandwidth sweep, nccl-tests style (size, time, algbw, busbw, #wrong)",
        description="Time all_reduce of float32 tensors from --min-bytes to --max-bytes in --nproc processes "
        "it starts itself (127.0.0.1 only), check the results, and print algbw / busbw as nccl-tests does.",
    )
    bench.add_argument("--nproc", type=_positive_int, default=None, help="processes (default: 2 on CPU, every GPU on CUDA)")
    bench.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    bench.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on cuda, gloo on cpu")
    bench.add_argument("--min-bytes", default=None, metavar="SIZE", help="smallest message (default 1KiB)")
    bench.add_argument("--max-bytes", default=None, metavar="SIZE", help="largest message (default 256MiB)")
    bench.add_argument("--factor", type=int, default=None, help="size multiplier between steps (default 2)")
    bench.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed all_reduces per size (default 20); large sizes get fewer: min(iters, max(5, 1GiB // size))",
    )
    bench.add_argument(
        "--warmup", type=int, default=None, help="untimed all_reduces first (default 5): min(warmup, max(1, 256MiB // size))"
    )
    bench.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="stop everything after this long (default 300)"
    )
    bench.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON here")
    bench.add_argument("--quiet", action="store_true", help="no progress lines while measuring")
    bench.set_defaults(func=_cmd_bench_comm, subparser=bench)
    for module_name in _FEATURE_COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not module_name.startswith(str(exc.name)):  # a real import error inside the module: show it
                raise
            continue  # feature not built yet
        module.register(sub)
    return parser


# Modules that add a subcommand with ``register(subparsers)``; their heavy imports stay
# inside the command so that ``lightning-mgpu --help`` is fast.
_FEATURE_COMMANDS = (
    "lightning_mgpu.doctor_env",  # doctor
    "lightning_mgpu.tuning.cli",  # tune
    "lightning_mgpu.placement.cli",  # plan
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
