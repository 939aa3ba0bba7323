"""What does ``DistributedDoctor`` cost per training step? And the hang watch (``--subject watch``)?

The 8M-parameter MLP of ``bench/models.py`` (the one ``bench/overhead.py`` uses), 2 ranks,
``strategy="ddp_tuned"`` with and without ``DistributedDoctor()`` at its default settings
(checks after the first batch and every 100 batches, at each epoch start and end, after
each epoch's first batch, and at the end of training).

How it is measured: one ``torch.distributed.run`` launch whose ranks run a *schedule* of
fits back to back, alternating the two configurations in ABBA order (a fresh Trainer and
model each time, the same data, ``warmup`` untimed + ``steps`` timed steps each), after one
discarded fit (a process's first runs cold). Each
pair of neighbouring fits (one with, one without) gives a ratio of median iteration times;
the verdict is the median of those ratios. Alternating blocks of a few seconds inside one
launch keeps a burst of outside load from landing on one configuration only (this project's
machines are shared), which separate launches could not. "Iteration" is one step's start to
the next: the doctor's work at the end of a batch, and its checks (which gather from every
rank), run after the step-end stamp, so the step span alone would miss them.

The worker also times, inside the doctor, every check by kind (``check_ms``) and its three
per-batch hooks (``hook_us_per_batch``, checks excluded): the two parts of the cost.

``--subject watch`` measures the hang watch the same way: ``ddp_tuned`` as it comes (the watch on,
``hang_timeout=300``) against ``TunedDDPStrategy(hang_timeout=None)``, target at most 1% more per
iteration (``bench/results/watch_overhead.json``). The watch's work is a tick a second on its own
thread (the main thread's stack sampled, one store write) plus a few attribute writes per hook and
per collective on the main thread: a tick lands on a few iterations of a fit, so the per-fit figure
compared is the *mean* iteration (what a run pays), not the median the doctor's checks are judged by.

    python -m bench.doctor_overhead                 # 5 pairs (10 fits) of 10 warm-up + 200 timed steps
    python -m bench.doctor_overhead --quick         # smoke run
    python -m bench.doctor_overhead --subject watch # the hang watch, on against off
    python -m bench.doctor_overhead --model tiny    # a 2-layer MLP: the per-batch hooks' cost in relative terms
    python -m bench.doctor_overhead --accelerator cuda --nproc 2

(from the repository root: see ``bench/__init__.py``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from bench import RESULTS, training
from bench.harness import cli, interleave, launch, worker
from bench.harness.report import load_average, print_table, report_header, write_json
from bench.harness.stats import against, median, median_ci, paired_ratios, summarize
from bench.harness.worker import StepTimer, worker_device
from bench.models import MLP_WIDTHS, make_data

MODULE = "bench.doctor_overhead"  # what its launch runs: this script's worker

BASE, DOCTOR = "ddp_tuned", "ddp_tuned+doctor"
CONFIGS = (BASE, DOCTOR)
LIMIT = 1.02  # the doctor may add at most 2% to the iteration time
UNWATCHED = "ddp_tuned+unwatched"


@dataclass(frozen=True)
class Subject:
    """What one run compares: ``without`` and ``with`` the subject, the limit of their ratio, the per-fit statistic."""

    without: str
    with_: str
    limit: float
    stat: str
    out: Path
    what: str


SUBJECTS = {
    "doctor": Subject(BASE, DOCTOR, LIMIT, "median", RESULTS / "doctor_overhead.json", "DistributedDoctor"),
    "watch": Subject(UNWATCHED, BASE, 1.01, "mean", RESULTS / "watch_overhead.json", "the hang watch"),
}
MODELS = {"mlp8m": MLP_WIDTHS, "tiny": (32, 64, 1)}
PAIRS, STEPS, WARMUP, BATCH_SIZE = 5, 200, 10, 64
QUICK = {"pairs": 1, "steps": 10, "warmup": 2}
HOOKS = ("on_train_batch_start", "on_after_backward", "on_train_batch_end")
DEFAULT_OUT = RESULTS / "doctor_overhead.json"


def schedule(pairs: int, subject: str = "doctor") -> list[str]:
    """ABBA ABBA ...: each configuration goes first in half of the pairs."""
    chosen = SUBJECTS[subject]
    return [config for _, _, config in interleave.schedule((chosen.without, chosen.with_), pairs)]


# ----------------------------------------------------------------------------- the launch (every rank)
def run_worker(args: argparse.Namespace) -> None:
    worker.start(args.threads)
    device = worker_device(args.accelerator)
    fit_once(
        SUBJECTS[args.subject].without, args, device
    )  # the process's first fit runs cold (allocator, caches, gloo buffers): discarded
    results = []
    for index, config in enumerate(args.worker_schedule.split(",")):
        result = fit_once(config, args, device)
        result["index"] = index
        results.append(result)
    worker.finish(args.worker_out, results)


def fit_once(config: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One fit of ``ddp_tuned`` (bench.training's), with the doctor attached last when ``config`` says so, or
    without the hang watch (``ddp_tuned+unwatched``)."""
    from lightning_mgpu.callbacks.doctor import DistributedDoctor
    from lightning_mgpu.watch.watcher import the_watch

    world_size = int(os.environ["WORLD_SIZE"])
    total_steps = args.warmup + args.steps
    widths = MODELS[args.model]
    dataset = make_data(total_steps * args.batch_size * world_size, widths)  # one epoch, no boundary inside
    timer = StepTimer(device)
    check_ms: list[tuple[str, float]] = []  # (kind, ms) of every check on this rank
    hook_us: dict[str, list[float]] = {name: [] for name in HOOKS}
    doctor: Optional[DistributedDoctor] = None
    if config == DOCTOR:
        doctor = DistributedDoctor()
        _time_doctor(doctor, check_ms, hook_us)
    # The timer's callback comes first: its batch-end stamp comes before the doctor's batch-end work.
    lightning_config = BASE if config == DOCTOR else config
    if config == UNWATCHED:
        # A watched fit's watch thread goes on ticking after its run while the process group lives (a rank past its
        # run still tells the others where it is): without this, the next "unwatched" fit would pay the ticks too.
        the_watch().stop()
    beats, ticking = the_watch().beats, the_watch().ticking
    training.train_lightning(
        lightning_config, args, dataset, timer, device, total_steps, widths=widths, callbacks=[doctor] if doctor else []
    )
    return {
        "config": config,
        "world_size": world_size,
        "watch_beats": the_watch().beats - beats,  # states the hang watch published during the fit (0: it was off)
        "watch_ticking_before": ticking,  # the watch thread of an earlier fit still running when this one started
        "step": summarize(timer.step_ms(skip=args.warmup)),
        "iteration": summarize(timer.iteration_ms(skip=args.warmup)),
        "check_ms": check_ms,
        "hook_us": {name: summarize(values[args.warmup :]) for name, values in hook_us.items() if values},
        "doctor_findings": None if doctor is None else [f.rule for f in doctor.findings],
        "doctor_checks": None if doctor is None else doctor.state_dict()["checks"],
    }


def _time_doctor(doctor: Any, check_ms: list[tuple[str, float]], hook_us: dict[str, list[float]]) -> None:
    """Wrap the doctor's checks and per-batch hooks with timers (instance attributes shadow the methods)."""
    check = doctor._check

    def timed_check(trainer: Any, kind: str) -> None:  # DistributedDoctor._check(trainer, kind)
        started = time.perf_counter()
        check(trainer, kind)
        check_ms.append((kind, 1e3 * (time.perf_counter() - started)))

    doctor._check = timed_check
    for name in HOOKS:
        hook = getattr(doctor, name)

        def wrapper(*hook_args: Any, hook: Any = hook, name: str = name) -> None:
            started, checks_before = time.perf_counter(), sum(ms for _, ms in check_ms)
            hook(*hook_args)
            in_checks_ms = sum(ms for _, ms in check_ms) - checks_before
            hook_us[name].append(1e6 * (time.perf_counter() - started) - 1e3 * in_checks_ms)

        setattr(doctor, name, wrapper)


# ----------------------------------------------------------------------------- driver
def launch_fits(args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    """The one launch: every fit of the ABBA schedule in the same processes; rank 0's report of each fit."""
    worker_args = [
        "--worker-schedule", ",".join(schedule(args.pairs, args.subject)), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--accelerator", args.accelerator,
        "--threads", str(args.threads), "--model", args.model, "--subject", args.subject,
    ]  # fmt: skip  # each option beside its value
    label = f"{args.subject}_overhead"
    finished = launch.launch(MODULE, worker_args, scratch=scratch, label=label, **launch.options(args))
    return list(finished.report)


def analyse(fits: list[dict[str, Any]], subject: str = "doctor") -> dict[str, Any]:
    chosen = SUBJECTS[subject]

    def per_pair(measure: str) -> list[float]:
        return paired_ratios(
            fits,
            chosen.with_,
            chosen.without,
            lambda fit: fit[measure][chosen.stat],
            group=lambda fit: fit["index"] // 2,
        )

    ratios = {measure: per_pair(measure) for measure in ("iteration", "step")}
    per_config = {}
    for config in (chosen.without, chosen.with_):
        mine = [f for f in fits if f["config"] == config]
        per_config[config] = {
            "fits": len(mine),
            "iteration_ms_median": median([f["iteration"]["median"] for f in mine]),
            "iteration_ms_mean": median([f["iteration"]["mean"] for f in mine]),
            "step_ms_median": median([f["step"]["median"] for f in mine]),
            "iteration_ms_per_fit": [f["iteration"][chosen.stat] for f in mine],
        }
    ratio = median(ratios["iteration"])
    verdict = against(ratio, chosen.limit)
    low, high = median_ci(ratios["iteration"])
    result: dict[str, Any] = {
        "subject": subject,
        "stat": chosen.stat,
        "ratio_iteration_per_pair": ratios["iteration"],
        "ratio_step_per_pair": ratios["step"],
        "ratio_iteration": ratio,
        "ratio_iteration_ci95": [low, high],
        "ratio_step": median(ratios["step"]),
        "limit": chosen.limit,
        "met": verdict["met"],
        "summary": per_config,
    }
    if subject != "doctor":
        return result
    checks: dict[str, list[float]] = {}
    hooks: dict[str, list[float]] = {}
    for fit in fits:
        for kind, ms in fit["check_ms"]:
            checks.setdefault(kind, []).append(ms)
        for name, stats in fit["hook_us"].items():
            hooks.setdefault(name, []).append(stats["median"])
    doctor_fits = [f for f in fits if f["config"] == DOCTOR]
    return {
        **result,
        # Each check's time on rank 0 by kind; it includes waiting in the gather for the other rank.
        "check_ms": {kind: summarize(values) for kind, values in checks.items()},
        "checks_per_fit": doctor_fits[0]["doctor_checks"] if doctor_fits else None,
        # Median per batch of each hook's own time (checks excluded), median over fits, microseconds.
        "hook_us_per_batch": {name: median(values) for name, values in hooks.items()},
        "doctor_findings": sorted({rule for f in doctor_fits for rule in f["doctor_findings"]}),
    }


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--pairs", type=int, default=PAIRS, help=f"pairs of fits, with and without ({PAIRS})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"timed steps per fit ({STEPS})")
    parser.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed steps first, >= 2 ({WARMUP})")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"per rank ({BATCH_SIZE})")
    parser.add_argument("--model", choices=tuple(MODELS), default="mlp8m")
    parser.add_argument(
        "--subject",
        choices=tuple(SUBJECTS),
        default="doctor",
        help="doctor: ddp_tuned with/without DistributedDoctor; watch: with/without the hang watch (%(default)s)",
    )
    cli.add_launch_options(parser, out=DEFAULT_OUT, quick=QUICK, timeout=1800.0, launches="the one launch")
    parser.add_argument("--worker-schedule", default=None, help=argparse.SUPPRESS)
    args = cli.finish(parser, argv, QUICK, positive=("pairs", "steps", "batch_size", "nproc", "threads"))
    if args.warmup < 2 or args.steps < 2:
        parser.error("--warmup and --steps must be >= 2")
    if args.out == DEFAULT_OUT:  # each subject its own file, unless --out says otherwise
        args.out = SUBJECTS[args.subject].out
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker_schedule:
        run_worker(args)
        return
    print(
        f"{args.model} MLP, batch {args.batch_size} per rank, {args.nproc} ranks on {args.accelerator}; one launch, "
        f"{args.pairs} pair(s) of fits (ABBA), {args.warmup} warm-up + {args.steps} timed steps each\n"
    )
    started = time.perf_counter()
    load_start = load_average()
    chosen = SUBJECTS[args.subject]
    configs = (chosen.without, chosen.with_)
    with tempfile.TemporaryDirectory(prefix="bench_doctor_") as scratch:
        fits = launch_fits(args, Path(scratch))
    result = analyse(fits, args.subject)
    header = report_header(args, configs, rounds=args.pairs)
    subject_settings = (
        {"doctor": "DistributedDoctor() (check_every_n_batches=100)"}
        if args.subject == "doctor"
        else {"watch": "TunedDDPStrategy() (hang_timeout=300) against TunedDDPStrategy(hang_timeout=None)"}
    )
    payload: dict[str, Any] = {
        "benchmark": f"{args.subject}_overhead",
        "machine": {
            **header["machine"],
            "load_average_start": load_start,
            "load_average_end": load_average(),
        },
        "settings": {
            **header["settings"],
            "pairs": args.pairs,
            "model": args.model,
            "schedule": "ABBA in one launch",
            "quick": args.quick,
            **subject_settings,
            "measure": f"iteration: one step start to the next (rank 0); per fit its {chosen.stat}; ratio: median "
            "over pairs",
        },
        **result,
        "fits": fits,
        "wall_s": time.perf_counter() - started,
    }
    out = write_json(args.out, payload)

    for fit in fits:
        print(
            f"fit {fit['index'] + 1:2d}  {fit['config']:<19} step {fit['step']['median']:7.2f} ms  "
            f"iteration {fit['iteration']['median']:7.2f} ms (mean {fit['iteration']['mean']:7.2f})"
        )
    summary = result["summary"]
    rows = [
        [
            config,
            f"{summary[config]['iteration_ms_median']:.2f}",
            f"{summary[config]['iteration_ms_mean']:.2f}",
            f"{summary[config]['step_ms_median']:.2f}",
            f"{min(summary[config]['iteration_ms_per_fit']):.2f}–{max(summary[config]['iteration_ms_per_fit']):.2f}",
        ]
        for config in configs
    ]
    print()
    print_table(
        f"{chosen.what} cost (medians over fits of per-fit figures)",
        ["configuration", "iteration ms", "mean iteration ms", "step ms", f"iteration {chosen.stat} over fits"],
        rows,
    )
    verdict = "met" if result["met"] else "NOT met"
    low, high = result["ratio_iteration_ci95"]
    print(
        f"with / without, median over pairs of per-fit {chosen.stat}s: iteration {result['ratio_iteration']:.4f} "
        f"(95% CI {low:.3f}–{high:.3f}; limit {chosen.limit}) -> {verdict}; step {result['ratio_step']:.4f}; per pair "
        f"{', '.join(f'{r:.3f}' for r in result['ratio_iteration_per_pair'])}"
    )
    if args.subject != "doctor":
        print(f"\n{time.perf_counter() - started:.0f} s in all; wrote {out}")
        return
    for kind, stats in result["check_ms"].items():
        print(
            f"check '{kind}' (gather + rules, rank 0): median {stats['median']:.2f} ms, max {stats['max']:.2f} ms, "
            f"{stats['n'] // max(1, args.pairs)} per fit of {args.warmup + args.steps} steps"
        )
    hooks = result["hook_us_per_batch"]
    if hooks:
        total = sum(hooks.values())
        share = total / 1e3 / summary[BASE]["iteration_ms_median"]
        print(
            f"the doctor's hooks per batch (checks excluded): {total:.1f} us "
            f"({', '.join(f'{k} {v:.1f}' for k, v in hooks.items())}) = {share:.3%} of an iteration"
        )
    print(f"doctor findings on this (correct) run: {result['doctor_findings'] or 'none'}")
    print(f"\n{time.perf_counter() - started:.0f} s in all; wrote {out}")


if __name__ == "__main__":
    main()
