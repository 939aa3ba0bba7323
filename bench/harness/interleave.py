"""Configurations interleaved over rounds, so that a machine's drifting load favours none of them.

The rule is the package's (:func:`lightning_mgpu.tuning.statistics.round_order`, the bucket
tuner's too); the benchmarks use it two ways:

* **separate launches** (:func:`run_rounds`): every configuration its own ``torch.distributed.run``
  launch, the order *rotated* each round so that every configuration takes every position
  (``overhead``, ``fp16_safety``, ``profiler_overhead --method launches``; ``buckets``, ``netlab
  --sweep`` and ``whatif`` rotate the fits inside each round's launch the same way);
* **inside one process** (:func:`schedule`): fits back to back, the order *alternating* (ABC CBA,
  ABBA for two), so that neighbours share the machine's state of the moment
  (``doctor_overhead``, ``profiler_overhead``, ``pipeline``).

For separate launches this module also has the options those benchmarks share
(:func:`parse_args`), the check that every launch built the same DDP buckets
(:func:`check_same_buckets`), the per-configuration summary (:func:`summarize_rounds`) and the
ratios against their limits, round by round too (:func:`compare`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, TypeVar

from bench.harness import cli, launch
from bench.harness.stats import against, center, median, paired_ratios
from lightning_mgpu.tuning.statistics import round_order

T = TypeVar("T")

ROUNDS = 5
STEPS = 100  # timed steps per launch
WARMUP = 10  # untimed steps first; DDP rebuilds its buckets at the start of step 2
BATCH_SIZE = 64  # per process
QUICK = {"rounds": 1, "steps": 10, "warmup": 2}
LAUNCH_TIMEOUT_S = 900


def schedule(
    configs: Sequence[T], rounds: int, *, scheme: Literal["alternate", "rotate"] = "alternate", first: int = 0
) -> list[tuple[int, int, T]]:
    """``(round, position, configuration)`` of every visit, rounds ``first .. first + rounds - 1``."""
    return [
        (round_index, position, config)
        for round_index in range(first, first + rounds)
        for position, config in enumerate(round_order(configs, round_index, scheme=scheme))
    ]


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
    finished = launch.launch(module, worker_args, scratch=scratch, label=label, **launch.options(args))
    report: dict[str, Any] = finished.report
    report["launch_wall_s"] = finished.wall_s
    return report


def run_rounds(module: str, configs: tuple[str, ...], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``args.rounds`` rounds, each launching ``module``'s worker for every configuration once, in a rotated order."""
    launches: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_") as scratch:
        for round_index, position, config in schedule(configs, args.rounds, scheme="rotate"):
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
        middle, spread, relative = center([launch["step"]["median"] for launch in mine])
        summary[config] = {
            "launches": len(mine),
            "step_ms_median": middle,
            "step_ms_p90": median([launch["step"]["p90"] for launch in mine]),
            "step_ms_spread": spread,
            "relative_spread": relative,
            "iteration_ms_median": median([launch["iteration"]["median"] for launch in mine]),
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
        per_round = paired_ratios(launches, numerator, denominator, lambda launch: launch[measure]["median"])
        targets[f"{numerator}/{denominator}"] = {
            **against(ratio, limit),
            "measure": measure,
            "step_ratio": summary[numerator]["step_ms_median"] / summary[denominator]["step_ms_median"],
            # End to end: counts Lightning's per-batch broadcast, which the step span leaves out.
            "iteration_ratio": summary[numerator]["iteration_ms_median"] / summary[denominator]["iteration_ms_median"],
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
    doc: Optional[str],
    default_out: Path,
    workers: tuple[str, ...],
    extend: Optional[Callable[[argparse.ArgumentParser], None]] = None,
    quick: Optional[dict[str, Any]] = None,
) -> argparse.Namespace:
    """The options every benchmark of separate launches shares; ``extend`` adds a script's own, ``workers``
    are the configurations its worker accepts and ``quick`` the values ``--quick`` sets (:data:`QUICK`)."""
    quick = QUICK if quick is None else quick
    parser = cli.parser(doc)
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="rounds of one launch per configuration (%(default)s)"
    )
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per launch (%(default)s)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps before them, >= 2 (%(default)s)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"per rank ({BATCH_SIZE})")
    cli.add_launch_options(parser, out=default_out, quick=quick, timeout=LAUNCH_TIMEOUT_S)
    # Internal: set by `launch_config` for the processes torch.distributed.run starts.
    parser.add_argument("--worker", choices=workers, default=None, help=argparse.SUPPRESS)
    if extend is not None:
        extend(parser)
    args = cli.finish(parser, argv, quick, positive=("rounds", "steps", "batch_size", "nproc", "threads"))
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the iteration time needs two step starts), got {args.steps}")
    if args.warmup < 2:
        parser.error(f"--warmup must be >= 2: DDP rebuilds its buckets at the start of step 2, got {args.warmup}")
    if args.worker and not args.worker_out:
        parser.error("--worker needs --worker-out")
    return args
