"""What does ``CommProfiler`` cost per training step?

The 8M-parameter MLP of ``bench/models.py`` (the one ``bench/overhead.py`` uses), 2 ranks,
``strategy="ddp_tuned"`` without the profiler, with ``CommProfiler(every_n_steps=50)`` (its
default schedule: 20 profiled steps of every 200, DDP re-wrapped without the profiler's hook
in between), and with ``CommProfiler(profile_every=None)`` (every step profiled).

Target: the profiler, as configured by default, adds at most 3% to the iteration time (one
step's start to the next: the profiler's own work at the end of a batch, its gathers across
ranks and its re-wraps of DDP run after a step-end stamp, so the step span alone would miss
part of its cost). The default ``--steps 200`` is one profiling period: the timed span holds
the end of the first window, both re-wraps (and the slow first steps of each new DDP
wrapper) and the start of the next window.

    python -m bench.profiler_overhead               # 2 launches x 6 rounds x 3 configurations
    python -m bench.profiler_overhead --quick       # smoke run
    python -m bench.profiler_overhead --breakdown   # + ddp_tuned with only the profiler's hook
    python -m bench.profiler_overhead --method launches --rounds 7 --steps 150   # former design
    python -m bench.profiler_overhead --accelerator cuda --nproc 2

(from the repository root: see ``bench/__init__.py``).

How it is measured (``--method interleaved``, the default): the same run, interleaved.
Each of ``--launches`` launches of ``torch.distributed.run`` trains the model ``3 x
(--rounds + 1)`` times in the same processes, one ``Trainer.fit`` after another, the
configurations in ABC CBA order; the first round is not kept (a process's first fits pay
one-time costs). Every fit builds a fresh model, DDP wrapper and, when on, a fresh profiler,
skips ``--warmup`` steps and times ``--steps`` steps on rank 0 with ``bench.overhead``'s
loop and clock (:mod:`bench.training`). A round's fits run back to back in one process, so they share the machine's
state of the moment (load from elsewhere, heap, page cache). Per fit the measure is the
*mean* iteration time (its timed wall time per iteration, what a run pays: the profiler's
costly steps are few, 25 of 200, plus two re-wraps, and a median over a fit's steps would
not see them); each figure is the median over all rounds of the per-round ratio
configuration/without, with a distribution-free 95% confidence interval of that median. Rank 0's CPU time per iteration (every thread of the
process) is reported beside the wall time: it is far less disturbed by other load on a
shared machine.

``--breakdown`` adds ``ddp_tuned`` with only the communication hook the profiler times
through (DDP's all-reduce as a Python hook, nothing timed, no callback) to the rotation, to
tell what the hook costs from what the profiler adds.

``--method launches`` is the design used before: each configuration its own launch of the
worker ``bench.overhead`` uses (:mod:`bench.harness.interleave`), launches rotating; process-to-process
differences (heap layout, page faults, where the scheduler puts the threads) then add a few percent of
noise to every launch, more than the margin being tested.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench import RESULTS, training
from bench.harness import interleave, worker
from bench.harness.report import print_table, report_header, write_json
from bench.harness.stats import center, median, median_ci, paired_ratios, summarize
from bench.harness.worker import StepTimer, worker_device
from bench.models import make_data

MODULE = "bench.profiler_overhead"  # what its launches run: this script's workers

CONFIGS = ("ddp_tuned", "ddp_tuned+profiler")  # without; with (the target)
EVERY_STEP = "ddp_tuned+profiler_all"  # profile_every=None: every step profiled
HOOK_ONLY = "ddp_tuned+hook"  # --breakdown: the communication hook alone, nothing timed
LIMIT = 1.03
LIMITS = {("ddp_tuned+profiler", "ddp_tuned"): LIMIT}
DEFAULT_OUT = RESULTS / "profiler_overhead.json"
ROUNDS, STEPS, LAUNCHES = 6, 200, 2
STAT = "mean"  # per fit: its timed wall time per iteration, what a run pays (re-wraps included)
QUICK = {"rounds": 1, "steps": 10, "warmup": 2, "launches": 1}
INTERLEAVED_WORKER = "interleaved"


# ----------------------------------------------------------------------------- the interleaved worker (every rank)
def run_interleaved_worker(args: argparse.Namespace) -> None:
    """``len(configs) x (rounds + 1)`` fits in these processes, in ABC CBA order; rank 0 writes
    every fit's timings to ``--worker-out``."""
    worker.start(args.threads)
    device = worker_device(args.accelerator)
    world_size = int(os.environ["WORLD_SIZE"])
    total_steps = args.warmup + args.steps
    dataset = make_data(total_steps * args.batch_size * world_size)
    fits: list[dict[str, Any]] = []
    # Round -1 is not kept: a process's first fits pay one-time costs (lazy initialisation,
    # the allocator growing its heap) that would favour whichever configuration runs later.
    for round_index, position, config in interleave.schedule(configs_of(args), args.rounds + 1, first=-1):
        timer = StepTimer(device)
        result = training.train_lightning(config, args, dataset, timer, device, total_steps)
        if round_index >= 0:
            fits.append(
                {
                    **result,
                    "config": config,
                    "round": round_index,
                    "position": position,
                    "label": f"round{round_index + 1}_{config}",
                    "step": summarize(timer.step_ms(skip=args.warmup)),
                    "iteration": summarize(timer.iteration_ms(skip=args.warmup)),
                    "cpu_iteration": summarize(timer.cpu_iteration_ms(skip=args.warmup)),
                }
            )
        gc.collect()  # the finished Trainer's (cyclic) objects, before the next fit is timed
    worker.finish(args.worker_out, {"fits": fits, "world_size": world_size})


def configs_of(args: argparse.Namespace) -> tuple[str, ...]:
    """Without the profiler, (with only its hook,) every step profiled, default schedule:
    ABC CBA ... within a launch."""
    return (CONFIGS[0], *((HOOK_ONLY,) if args.breakdown else ()), EVERY_STEP, CONFIGS[1])


# ----------------------------------------------------------------------------- driver
def run_interleaved(args: argparse.Namespace) -> dict[str, Any]:
    """``--launches`` launches of the interleaved worker; the report, and its table printed."""
    print(
        f"8M MLP, batch {args.batch_size} per rank, {args.nproc} ranks on {args.accelerator}; {args.launches} "
        f"launch(es) x {args.rounds} round(s) x {len(configs_of(args))} fits, {args.warmup} warm-up + {args.steps} "
        "timed steps each\n"
    )
    started = time.perf_counter()
    fits: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_") as scratch:
        for launch_index in range(args.launches):
            label = f"launch{launch_index + 1}"
            report = interleave.launch_config(
                MODULE,
                INTERLEAVED_WORKER,
                args,
                Path(scratch),
                label,
                extra_args=("--rounds", str(args.rounds), *(("--breakdown",) if args.breakdown else ())),
            )
            for fit in report["fits"]:
                fit.update(launch=launch_index, label=f"{label}_{fit['label']}")
                fits.append(fit)
            interleave.check_same_buckets(fits)
            for round_index in range(args.rounds):
                group = {f["config"]: f for f in report["fits"] if f["round"] == round_index}
                off = group[CONFIGS[0]]
                figures = "  ".join(
                    f"{config} {group[config]['iteration'][STAT]:6.2f} ms "
                    f"(x{group[config]['iteration'][STAT] / off['iteration'][STAT]:.3f}, "
                    f"cpu {group[config]['cpu_iteration'][STAT]:6.2f})"
                    for config in configs_of(args)
                )
                print(f"launch {launch_index + 1}/{args.launches} round {round_index + 1}/{args.rounds}  {figures}")
            print(f"  ({report['launch_wall_s']:.0f} s)")
    summary, targets = summarize_interleaved(fits)
    parts = breakdown(fits)
    print_interleaved(summary, targets, parts)
    header = report_header(args, configs_of(args))
    final_losses = {fit["label"]: fit["final_loss"] for fit in fits}
    return {
        "benchmark": "profiler_overhead",
        "machine": header["machine"],
        "settings": {**header["settings"], **settings(args), "launches": args.launches},
        "bucket_layout": interleave.check_same_buckets(fits),
        "final_losses": final_losses,
        "same_final_loss": len(set(final_losses.values())) == 1,
        "fits": fits,
        "summary": summary,
        "targets": targets,
        "breakdown": parts,
        "wall_s": time.perf_counter() - started,
    }


def ratios(
    fits: list[dict[str, Any]],
    measure: str,
    numerator: str = CONFIGS[1],
    denominator: str = CONFIGS[0],
    stat: str = "mean",
) -> list[float]:
    """numerator/denominator of the per-fit ``stat`` of ``measure``, one ratio per round of each launch."""
    return paired_ratios(
        fits, numerator, denominator, lambda fit: fit[measure][stat], group=lambda fit: (fit["launch"], fit["round"])
    )


def breakdown(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """Every step profiled vs without; with --breakdown, the hook alone vs without and the
    every-step profiler on top of the hook."""
    pairs = [(EVERY_STEP, CONFIGS[0])]
    if any(f["config"] == HOOK_ONLY for f in fits):
        pairs += [(HOOK_ONLY, CONFIGS[0]), (EVERY_STEP, HOOK_ONLY)]
    out = {}
    for numerator, denominator in pairs:
        entry = {}
        for measure in ("iteration", "cpu_iteration"):
            per_round = ratios(fits, measure, numerator, denominator)
            entry[measure] = {"ratio": median(per_round), "ci95": list(median_ci(per_round))}
        out[f"{numerator}/{denominator}"] = entry
    return out


def summarize_interleaved(fits: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    summary: dict[str, Any] = {}
    for config in sorted({f["config"] for f in fits}, key=lambda c: (c != CONFIGS[0], c == CONFIGS[1], c != HOOK_ONLY)):
        mine = [f for f in fits if f["config"] == config]
        center_ms, spread, relative = center([f["iteration"][STAT] for f in mine])
        summary[config] = {
            "fits": len(mine),
            "iteration_ms_mean": center_ms,
            "iteration_ms_spread": spread,
            "relative_spread": relative,
            "iteration_ms_median": median([f["iteration"]["median"] for f in mine]),
            "step_ms_mean": median([f["step"][STAT] for f in mine]),
            "cpu_iteration_ms_mean": median([f["cpu_iteration"][STAT] for f in mine]),
        }
    per_round = ratios(fits, "iteration")
    low, high = median_ci(per_round)
    cpu_ratios = ratios(fits, "cpu_iteration")
    cpu_low, cpu_high = median_ci(cpu_ratios)
    ratio = median(per_round)
    median_ratios = ratios(fits, "iteration", stat="median")
    target = {
        "measure": "median over rounds of the paired ratio with/without of per-fit mean iteration times "
        "(a fit's timed wall time per iteration: re-wraps and the slow steps after them included)",
        "ratio": ratio,
        "ci95": [low, high],
        "ratio_per_round": per_round,
        "typical_step_ratio": median(median_ratios),
        "typical_step_ci95": list(median_ci(median_ratios)),
        "step_ratio": median(ratios(fits, "step")),
        "cpu_ratio": median(cpu_ratios),
        "cpu_ci95": [cpu_low, cpu_high],
        "limit": LIMIT,
        "met": ratio <= LIMIT,
        # "met" is only as good as the interval: both ends on the same side of the limit,
        # or the interval straddles it (the data cannot tell).
        "conclusive": high <= LIMIT or low > LIMIT,
    }
    return summary, {f"{CONFIGS[1]}/{CONFIGS[0]}": target}


def print_interleaved(summary: dict[str, Any], targets: dict[str, Any], parts: Optional[dict[str, Any]]) -> None:
    base = summary[CONFIGS[0]]
    rows = []
    for config in summary:
        entry = summary[config]
        rows.append(
            [
                config,
                str(entry["fits"]),
                f"{entry['iteration_ms_mean']:.2f}",
                f"{entry['iteration_ms_spread'][0]:.2f}–{entry['iteration_ms_spread'][1]:.2f} "
                f"({entry['relative_spread']:.1%})",
                f"{entry['iteration_ms_median']:.2f}",
                f"{entry['step_ms_mean']:.2f}",
                f"{entry['cpu_iteration_ms_mean']:.2f}",
                f"{entry['iteration_ms_mean'] / base['iteration_ms_mean']:.3f}",
            ]
        )
    print()
    print_table(
        "CommProfiler cost, the same run interleaved (per-fit means; median over fits)",
        [
            "configuration",
            "fits",
            "iter. ms",
            "spread",
            "median iter.",
            "step ms",
            "CPU/iter.",
            "× without",
        ],
        rows,
    )
    for name, target in targets.items():
        verdict = "met" if target["met"] else "NOT met"
        certainty = "" if target["conclusive"] else " (inconclusive: the interval straddles the limit)"
        print(
            f"{name}: iteration x{target['ratio']:.3f}, 95% CI {target['ci95'][0]:.3f}–{target['ci95'][1]:.3f} "
            f"(limit {target['limit']:.2f}) -> {verdict}{certainty}; step x{target['step_ratio']:.3f}; "
            f"CPU time x{target['cpu_ratio']:.3f} (95% CI {target['cpu_ci95'][0]:.3f}–{target['cpu_ci95'][1]:.3f}); "
            f"typical (median) iteration x{target['typical_step_ratio']:.3f}"
        )
    for name, entry in (parts or {}).items():
        wall, cpu = entry["iteration"], entry["cpu_iteration"]
        print(
            f"  {name}: iteration x{wall['ratio']:.3f} (95% CI {wall['ci95'][0]:.3f}–{wall['ci95'][1]:.3f}), "
            f"CPU time x{cpu['ratio']:.3f} (95% CI {cpu['ci95'][0]:.3f}–{cpu['ci95'][1]:.3f})"
        )


def _extend(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--method",
        choices=("interleaved", "launches"),
        default="interleaved",
        help="interleaved: fits with and without alternate inside each launch (default); "
        "launches: each configuration its own launch",
    )
    parser.add_argument("--launches", type=int, default=LAUNCHES, help="launches, interleaved method (%(default)s)")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="interleaved method: also run ddp_tuned with only the profiler's communication hook (nothing timed)",
    )
    parser.set_defaults(rounds=ROUNDS, steps=STEPS)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    args = interleave.parse_args(
        argv,
        doc=__doc__,
        default_out=DEFAULT_OUT,
        workers=(*training.CONFIGS, INTERLEAVED_WORKER),
        extend=_extend,
        quick=QUICK,
    )
    if args.launches < 1:
        raise SystemExit(f"profiler_overhead.py: error: --launches must be >= 1, got {args.launches}")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker == INTERLEAVED_WORKER:
        run_interleaved_worker(args)
        return
    if args.worker:  # --method launches: one configuration per launch
        training.run_worker(args)
        return
    if args.method == "launches":
        report = training.compare_launches("profiler_overhead", MODULE, CONFIGS, args, LIMITS, measure="iteration")
        report["settings"].update(settings(args), launches=args.rounds * len(CONFIGS))
        report["breakdown"] = None
        training.print_launches(
            report,
            relative_to={"× without profiler": CONFIGS[0]},
            measure="iteration",
            title="CommProfiler cost, separate launches (median over rounds of per-launch medians)",
        )
    else:
        report = run_interleaved(args)
    out = write_json(args.out, report)
    if not report["same_final_loss"]:
        print(
            f"WARNING: final losses differ, with and without the profiler do not compute the same: {report['final_losses']}"
        )
    print(f"\n{report['wall_s']:.0f} s in all; wrote {out}")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "method": args.method,
        "profiler": "CommProfiler(every_n_steps=50): 20 profiled steps of every 200 after 5 warm-up steps",
        "profiler_all": "CommProfiler(warmup_steps=--warmup, every_n_steps=50, profile_every=None)",
        "measure": "iteration: one step start to the next (rank 0); CPU: rank 0's process time per iteration",
    }


if __name__ == "__main__":
    main()
