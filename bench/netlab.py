"""The network lab: run training as N nodes over rate-limited links, on one machine (needs root).

Every earlier figure came from one machine's loopback, where exchanging gradients costs almost
nothing. This script builds the regime users live in (nodes joined by 0.1-25 Gbit/s Ethernet)
with the kernel's own network stack: network namespaces, veth links shaped by ``tbf``,
loopback-range addresses (:mod:`bench.labs.network`), torchrun per namespace
(:func:`bench.harness.launch.run`). The lab is always torn down: on success, error, Ctrl-C, SIGTERM;
a run killed with SIGKILL is cleaned up by a run 10 minutes later, or at once by ``--cleanup``.

    # any training script as 2 nodes over a 1 Gbit/s link (asymmetric: --gbps 10,1; 2 ranks per node: --nproc-per-node 2)
    python -m bench.netlab --gbps 1 -- recipes/char_lm/train_lightning.py --max-steps 50
    python -m bench.netlab --gbps 1 -- -m bench.some_worker --flag
    # the link's achieved rate at each configured one (raw TCP transfer, both directions)
    python -m bench.netlab --measure --rates 0.1,1,2.5,10
    # ... and beside it what `lightning-mgpu bench-comm` measures across the 2 nodes (torchrun, one rank each)
    python -m bench.netlab --measure --rates 0.5,1,2.5 --bench-comm
    # what each option buys: ddp, ddp_tuned, auto, fp16, bf16, PowerSGD r1/r4 x 3 models x 0.1/1/10 Gbit/s
    python -m bench.netlab --sweep              # bench/results/netlab_sweep.json + .png
    python -m bench.netlab --sweep --quick      # smoke run (the test suite's)
    # a rate added to an existing sweep (its rounds interleave among themselves; its losses stand)
    python -m bench.netlab --sweep --rates 0.1 --rounds 2 --add-to bench/results/netlab_sweep.json
    # the bucket tuner's targets: bench.buckets as 2 nodes at 10 and 2.5 Gbit/s
    python -m bench.netlab --buckets            # bench/results/netlab_buckets_<rate>gbps.json + .png
    python -m bench.netlab --cleanup            # remove namespaces left by killed runs

Run from the repository root (``bench`` is a package). The targets' training scripts see
``WORLD_SIZE``, ``RANK``, ``LOCAL_WORLD_SIZE`` as under torchrun: Lightning scripts pass
``num_nodes=WORLD_SIZE // LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from bench.harness import cli, launch
from bench.harness.report import machine_facts, write_json
from bench.labs.network import Lab, LabError, handle_signals, lab_unavailable, parse_gbps, remove_stale
from bench.models import MODELS
from bench.netlab_sweep import (
    AUTO_STEPS,
    DEFAULT_OUT,
    LAUNCH_TIMEOUT_S,
    LOSS_STEPS,
    OPTIONS,
    QUICK,
    RATES_GBPS,
    ROUNDS,
    STEPS,
    WARMUP,
    analyse,
    check_addable,
    merge,
    run_sweep,
    run_worker,
)

BUCKET_RATES = (10.0, 2.5)


def _rates(text: str) -> list[float]:
    return [parse_gbps(part) for part in text.split(",") if part.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    target: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, target = argv[:split], argv[split + 1 :]
    parser = cli.parser(__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="every option x model x rate (see bench/netlab_sweep.py)")
    mode.add_argument("--buckets", action="store_true", help="bench.buckets as 2 nodes at --rates (10,2.5)")
    mode.add_argument("--measure", action="store_true", help="measure the link at each of --rates")
    mode.add_argument("--cleanup", action="store_true", help="remove namespaces left by killed runs")
    parser.add_argument("--gbps", default="1", help="running a target: one rate for every node, or one per node (1)")
    parser.add_argument("--nodes", type=int, default=2, help="running a target: namespaces (2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="running a target: ranks behind each link (1)")
    parser.add_argument(
        "--rates", default=None, help=f"Gbit/s, comma-separated ({','.join(f'{r:g}' for r in RATES_GBPS)})"
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"sweep: from {MODELS}")
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"sweep: from {OPTIONS}")
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help=f"sweep: rounds, rates and orders rotated ({ROUNDS})"
    )
    parser.add_argument("--steps", type=int, default=STEPS, help=f"sweep: steps per run ({STEPS})")
    parser.add_argument("--auto-steps", type=int, default=AUTO_STEPS, help=f"sweep: steps of auto's run ({AUTO_STEPS})")
    parser.add_argument("--warmup", type=int, default=WARMUP, help=f"sweep: untimed first steps ({WARMUP})")
    parser.add_argument(
        "--loss-steps", type=int, default=LOSS_STEPS, help=f"sweep: steps before the loss ({LOSS_STEPS})"
    )
    parser.add_argument("--probe-seconds", type=float, default=1.0, help="link measurement: seconds of traffic (1)")
    parser.add_argument(
        "--bench-comm",
        action="store_true",
        help="--measure: also run lightning-mgpu bench-comm across the 2 nodes at each rate (up to 16 MiB)",
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given explicitly")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="sweep: JSON report (%(default)s); PNG beside it")
    parser.add_argument(
        "--add-to",
        type=Path,
        default=None,
        help="sweep: measure --rates and add them to this sweep report (same models, options and steps; its\n"
        "losses stand); the merged report goes to --out",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    parser.add_argument("--timeout", type=float, default=LAUNCH_TIMEOUT_S, help="seconds per launch")
    parser.add_argument("--worker-plan", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    positive = ("rounds", "steps", "auto_steps", "loss_steps", "nodes", "nproc_per_node", "threads")
    args = cli.finish(parser, argv, QUICK, positive=positive)
    args.target = target
    args.launch_timeout = args.timeout
    if args.worker_plan:
        return args
    default_rates = BUCKET_RATES if args.buckets else RATES_GBPS
    try:
        args.rates = _rates(args.rates) if args.rates else list(default_rates)
        args.gbps = _rates(args.gbps)
    except ValueError as error:
        parser.error(str(error))
    args.models = cli.names(args.models, MODELS, "--models", parser)
    args.options = cli.names(args.options, OPTIONS, "--options", parser)
    if args.warmup < 2 or args.warmup >= min(args.steps, args.auto_steps):
        parser.error(f"argument --warmup: must be >= 2 and below --steps/--auto-steps, got {args.warmup}")
    if args.add_to is not None:
        if not args.sweep:
            parser.error("argument --add-to: only with --sweep")
        try:
            check_addable(json.loads(args.add_to.read_text()), args)
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"argument --add-to: {args.add_to}: {error}")
    if not (args.sweep or args.buckets or args.measure or args.cleanup) and not target:
        parser.error("give a target after '--' (a script and its arguments, or -m MODULE ...), or --sweep/--measure")
    return args


def run_target(args: argparse.Namespace) -> int:
    rates = args.gbps if len(args.gbps) > 1 else args.gbps * args.nodes
    with Lab(args.nodes, rates) as lab:
        for node in range(1, args.nodes):
            there = lab.measure_link(0, node, seconds=args.probe_seconds)
            print(
                f"netlab: node 0 -> node {node}: configured {min(rates[0], rates[node]):g}, measured {there.gbps:.3f} Gbit/s"
            )
        runs = launch.run(
            args.target,
            nproc_per_node=args.nproc_per_node,
            timeout=args.timeout,
            threads=args.threads,
            lab=lab,
            cwd=Path.cwd(),
        )
    print(runs[0].output, end="")
    for run in runs[1:]:
        if run.returncode != 0:
            print(f"--- node {run.node} (exit code {run.returncode})\n{run.output[-4000:]}", file=sys.stderr)
    return next((run.returncode or 1 for run in runs if run.returncode != 0), 0)


BENCH_COMM = ["-m", "lightning_mgpu.cli", "bench-comm", "--min-bytes", "64KiB", "--max-bytes", "16MiB", "--quiet"]
"""bench-comm across the lab's 2 nodes: sizes where the link, not the per-message latency, decides."""


def bench_comm_across(lab: Lab, args: argparse.Namespace) -> dict[str, Any]:
    """``lightning-mgpu bench-comm`` under torchrun on both nodes (one rank each): its report."""
    with tempfile.TemporaryDirectory(prefix="netlab_bench_comm_") as scratch:
        out = Path(scratch) / "link.json"
        target = [*BENCH_COMM, "--json", str(out)]
        runs = launch.run(
            target, nproc_per_node=1, timeout=args.timeout, threads=args.threads, lab=lab, cwd=Path(scratch)
        )
        launch.check(runs, "bench-comm across the lab")
        report: dict[str, Any] = json.loads(out.read_text())
    return report


def run_measure(args: argparse.Namespace) -> None:
    with Lab(2, max(args.rates)) as lab:
        for rate in args.rates:
            lab.set_rates(rate)
            there, back = lab.measure_both_ways(args.probe_seconds)["measured_gbps"]
            print(f"{rate:>7g} Gbit/s configured: {there:8.3f} / {back:8.3f} Gbit/s measured (0->1 / 1->0)")
            if args.bench_comm:  # 2 ranks: busbw = algbw, the bytes each rank sends (and receives) per second
                report = bench_comm_across(lab, args)
                # the largest size: smaller ones ride on tbf's 256 KiB burst and can beat the rate
                largest = max(report["rows"], key=lambda row: row["bytes"])
                gbps = largest["busbw_gbps"] * 8
                print(
                    f"{'':>7} bench-comm across the 2 nodes: busbw {gbps:8.3f} Gbit/s at "
                    f"{largest['bytes'] >> 20} MiB, {100 * gbps / min(there, back):.0f}% of the raw socket's "
                    f"slower direction (peak {report['peak_busbw_gbps'] * 8:.3f} at {report['peak_busbw_bytes'] >> 10} KiB)"
                )


def run_buckets(args: argparse.Namespace) -> None:
    from bench import buckets

    for rate in args.rates:
        out = args.out.parent / f"netlab_buckets_{rate:g}gbps.json"
        argv = ["--link-gbps", str(rate), "--out", str(out), "--models", ",".join(args.models)]
        buckets.main([*argv, *(["--quick"] if args.quick else [])])


def sweep_and_report(args: argparse.Namespace) -> None:
    from bench.netlab_sweep import plot, print_report

    started = time.perf_counter()
    existing = None if args.add_to is None else json.loads(args.add_to.read_text())
    raw = run_sweep(args)
    wall_s = time.perf_counter() - started
    if existing is None:
        keys = ("models", "options", "rates", "rounds", "steps", "auto_steps", "warmup", "loss_steps", "quick")
        settings = {key: getattr(args, key) for key in keys}
        settings.update(nodes=2, ranks_per_node=1, link="veth pair, tbf rate R burst 256kb latency 50ms on both ends")
    else:
        raw, settings = merge(existing, raw, args)
        wall_s += existing["wall_s"]
    rows = analyse(raw, argparse.Namespace(**{**vars(args), "rates": settings["rates"]}))
    payload = {
        "benchmark": "netlab_sweep",
        "machine": machine_facts(backend="gloo", world_size=2, device_type="cpu", threads_per_rank=args.threads),
        "settings": settings,
        "rows": rows,
        "raw": raw,
        "wall_s": wall_s,
    }
    out = write_json(args.out, payload)
    png = plot(rows, out.with_suffix(".png"))
    print_report(rows, args.loss_steps)
    print(f"wrote {out} and {png} ({(time.perf_counter() - started) / 60:.1f} min)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker_plan:
        run_worker(args)
        return 0
    reason = lab_unavailable()
    if reason is not None:
        print(f"netlab: cannot build the network lab: {reason}", file=sys.stderr)
        return 2
    handle_signals()  # SIGTERM/SIGHUP unwind through the labs' teardown like Ctrl-C does
    try:
        if args.cleanup:
            print(f"removed {len(remove_stale())} namespace(s) of killed runs")
        elif args.measure:
            run_measure(args)
        elif args.buckets:
            run_buckets(args)
        elif args.sweep:
            sweep_and_report(args)
        else:
            return run_target(args)
    except LabError as error:
        print(f"netlab: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
