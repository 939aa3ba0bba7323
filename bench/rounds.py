"""Step-time comparisons by launches: each configuration its own launch, in rounds that rotate the order.

Shared by ``bench.overhead`` and ``bench.profiler_overhead``: the options every launch-based
benchmark takes (:func:`parse_args`), one launch of a configuration's worker
(:func:`launch_config`), rounds of launches in an order rotated by one each round so that
drift in machine load favours no configuration (:func:`run_rounds`), the check that every
launch built the same DDP buckets (:func:`check_same_buckets`), the per-configuration summary
(:func:`summarize_rounds`) and the ratios against their limits (:func:`compare`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from bench import launcher
from bench.common import apply_quick, summarize

ROUNDS = 5
STEPS = 100  # timed steps per launch
WARMUP = 10  # untimed steps first; DDP rebuilds its buckets at the start of step 2
BATCH_SIZE = 64  # per process
QUICK = {"rounds": 1, "steps": 10, "warmup": 2}
LAUNCH_TIMEOUT_S = 900


def launch_config(
    module: str,
    config: str,
    args: argparse.Namespace,
    scratch: Path,
    label: str,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """One launch of ``module``'s worker for ``config`` (``extra_args`` passed on); returns rank 0's report
    with the launch's wall time as ``launch_wall_s``."""
    worker_args = [
        "--worker", config, "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--batch-size", str(args.batch_size), "--accelerator", args.accelerator, "--threads", str(args.threads),
        *extra_args,
    ]  # fmt: skip  # each option beside its value
    finished = launcher.launch(
        module,
        worker_args,
        nproc=args.nproc,
        threads=args.threads,
        report=scratch / f"{label}.json",
        label=label,
        timeout=args.launch_timeout,
    )
    report: dict[str, Any] = finished.report
    report["launch_wall_s"] = finished.wall_s
    return report


def run_rounds(module: str, configs: tuple[str, ...], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``args.rounds`` rounds, each launching ``module``'s worker for every configuration once, in a rotated order."""
    launches: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_") as scratch:
        for round_index in range(args.rounds):
            order = configs[round_index % len(configs) :] + configs[: round_index % len(configs)]
            for position, config in enumerate(order):
                label = f"round{round_index + 1}_{config}"
                report = launch_config(module, config, args, Path(scratch), label)
                report.update(label=label, round=round_index, position=position)
                launches.append(report)
                check_same_buckets(launches)
                print(
                    f"round {round_index + 1}/{args.rounds}  {config:<18} step median {report['step']['median']:8.2f} ms"
                    f"  p90 {report['step']['p90']:8.2f} ms  iteration {report['iteration']['median']:8.2f} ms"
                    f"  ({report['launch_wall_s']:.1f} s)"
                )
    return launches


def check_same_buckets(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """The bucket layout every launch reported; exits with both layouts if two differ."""
    reference = launches[0]
    for other in launches:
        if not other["buckets"]["rebuilt"]:
            raise SystemExit(f"{other['label']}: DDP has not rebuilt its buckets; use --warmup >= 2")
        if other["buckets"] != reference["buckets"]:
            raise SystemExit(
                "Bucket layouts differ, the comparison would not be like for like:\n"
                f"  {reference['label']}: {reference['buckets']}\n  {other['label']}: {other['buckets']}"
            )
    return reference["buckets"]


def summarize_rounds(launches: list[dict[str, Any]], configs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per configuration: the median over launches of the per-launch median (and p90) step time, and their spread."""
    summary: dict[str, dict[str, Any]] = {}
    for config in configs:
        mine = [launch for launch in launches if launch["config"] == config]
        medians = [launch["step"]["median"] for launch in mine]
        center = summarize(medians)["median"]
        summary[config] = {
            "launches": len(mine),
            "step_ms_median": center,
            "step_ms_p90": summarize([launch["step"]["p90"] for launch in mine])["median"],
            "step_ms_spread": [min(medians), max(medians)],
            "relative_spread": (max(medians) - min(medians)) / center,
            "iteration_ms_median": summarize([launch["iteration"]["median"] for launch in mine])["median"],
        }
    return summary


def compare(
    summary: dict[str, dict[str, Any]],
    launches: list[dict[str, Any]],
    limits: dict[tuple[str, str], float],
    measure: str = "step",
) -> dict[str, dict[str, Any]]:
    """Ratios of median ``measure`` times ("step" or "iteration") against the limits, plus
    the same ratio round by round."""
    targets = {}
    for (numerator, denominator), limit in limits.items():
        ratio = summary[numerator][f"{measure}_ms_median"] / summary[denominator][f"{measure}_ms_median"]
        per_round = []
        for round_index in sorted({launch["round"] for launch in launches}):
            medians = {l["config"]: l[measure]["median"] for l in launches if l["round"] == round_index}
            per_round.append(medians[numerator] / medians[denominator])
        targets[f"{numerator}/{denominator}"] = {
            "ratio": ratio,
            "measure": measure,
            "step_ratio": summary[numerator]["step_ms_median"] / summary[denominator]["step_ms_median"],
            # End to end: counts Lightning's per-batch broadcast, which the step span leaves out.
            "iteration_ratio": summary[numerator]["iteration_ms_median"] / summary[denominator]["iteration_ms_median"],
            "limit": limit,
            "met": ratio <= limit,
            "ratio_per_round": per_round,
            # The noise floor: when either spread is wider than the margin, "met" is luck.
            # One launch per configuration has no spread to judge by: None.
            "within_noise": None
            if len(per_round) < 2
            else max(summary[numerator]["relative_spread"], summary[denominator]["relative_spread"]) > limit - 1,
        }
    return targets


def parse_args(
    argv: Optional[Sequence[str]] = None,
    *,
    description: str,
    default_out: Path,
    workers: tuple[str, ...],
    extend: Optional[Callable[[argparse.ArgumentParser], None]] = None,
    quick: Optional[dict[str, Any]] = None,
) -> argparse.Namespace:
    """The options every launch-based benchmark shares; ``extend`` adds a script's own, ``workers`` are
    the configurations its worker accepts and ``quick`` the values ``--quick`` sets (:data:`QUICK`)."""
    quick = QUICK if quick is None else quick
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="rounds of one launch per configuration (%(default)s)"
    )
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per launch (%(default)s)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps before them, >= 2 (%(default)s)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"per rank ({BATCH_SIZE})")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick} unless given explicitly")
    parser.add_argument("--out", type=Path, default=default_out, help="JSON report (%(default)s)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: nccl")
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks) per launch (2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (cores // nproc)")
    parser.add_argument("--launch-timeout", type=float, default=LAUNCH_TIMEOUT_S, help="seconds per launch")
    # Internal: set by `launch_config` for the processes torch.distributed.run starts.
    parser.add_argument("--worker", choices=workers, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    if extend is not None:
        extend(parser)
    args = parser.parse_args(argv)

    apply_quick(args, argv, quick)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.nproc)
    for name in ("rounds", "steps", "batch_size", "nproc", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the iteration time needs two step starts), got {args.steps}")
    if args.warmup < 2:
        parser.error(f"--warmup must be >= 2: DDP rebuilds its buckets at the start of step 2, got {args.warmup}")
    if args.worker and not args.worker_out:
        parser.error("--worker needs --worker-out")
    return args
