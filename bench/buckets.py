"""Does ``bucket_cap_mb="auto"`` find the best gradient-bucket size, and does it pay for itself?

Three models of different shape, 2 ranks (gloo on CPU, NCCL with ``--accelerator cuda``):

    mlp      the 8M MLP of bench/models.py: four Linear layers, the largest one 16 MiB
    cnn      a VGG-style CNN on 16x16 images: conv kernels from 3 KiB to 9 MiB, an 8 MiB FC
    char_lm  recipes/char_lm's transformer (its own CharTransformer class), width 256, 4 blocks:
             many small tensors (LayerNorms, biases) between 0.25-1 MiB matrices

For each model, in one run of this script:

* **fixed sizes**: DDP's default 25 MiB and every size of ``"auto"``'s grid (1, 2, 4, ...,
  256 MiB) -- one training run per distinct bucket layout, since sizes that give the same
  layout are the same experiment (the layouts are predicted exactly as ``"auto"`` does, from
  the gradient-ready order, and checked against what DDP built);
* **"auto"**: ``TunedDDPStrategy(bucket_cap_mb="auto")`` with its default settings.

DDP's default and ``"auto"`` train ``--run-steps`` (500) steps: their *total* fit time is
compared (tuning included: its slower candidates, re-wraps and DDP's bucket rebuilds). The
other sizes train ``--warmup`` + ``--sweep-steps`` steps: their step time is what counts.

Measured as bench/overhead.py does: every configuration trains in a ``torch.distributed.run``
launch (:mod:`bench.harness.launch`) (one launch per round runs every model and configuration, in an order rotated
each round), step time from the first ``on_train_batch_start`` to the first ``on_train_batch_end``
callback on rank 0, median per run, then median over rounds. The "tuned" step time is the
median of the auto run's steps after its search ended (and DDP's rebuild after the final
re-wrap).

Targets, per model:
* tuned step time within 5% of the best fixed size's;
* total time of the ``--run-steps`` run with "auto" no worse than with DDP's default, and
  better wherever the sweep shows DDP's default >= 10% slower than the best size.

    python -m bench.buckets                 # 2 rounds (~12 min on 2 CPU cores)
    python -m bench.buckets --quick         # smoke run (the test suite runs it)
    python -m bench.buckets --rounds 3 --accelerator cuda --nproc 2
    python -m bench.buckets --link-gbps 10  # as 2 nodes over a shaped link (bench/labs/network.py; root)

(from the repository root: see ``bench/__init__.py``). ``--link-gbps``: the ranks are two nodes of
the network lab (``python -m bench.netlab --buckets`` runs it at 10 and 2.5 Gbit/s).

Writes ``--out`` (bench/results/buckets.json) and the figure next to it (buckets.png).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench import RESULTS
from bench.harness import cli, launch, worker
from bench.harness.report import machine_of, print_table, save_figure, subplots, write_json
from bench.harness.stats import against, median
from bench.models import BATCH, MODELS, build, count_parameters, fit
from lightning_mgpu.tuning.statistics import round_order

MODULE = "bench.buckets"  # what its launches run: this script's worker

# ----------------------------------------------------------------------------- settings
ROUNDS = 2
RUN_STEPS = 500  # DDP's default and "auto": the run whose total time is compared
SWEEP_STEPS = 60  # timed steps of every other fixed size
WARMUP = 10  # untimed steps first (DDP rebuilds its buckets at the start of step 2)
AFTER_TUNING = (
    4  # steps left out from the deciding one: it, DDP's first iteration and rebuild after the re-wrap, one more
)
STEP_TIME_LIMIT = 1.05  # tuned / best fixed
GAP = 0.10  # the sweep gap from which "auto" must beat DDP's default on total time
QUICK = {"rounds": 1, "run_steps": 24, "sweep_steps": 3, "warmup": 2}
LAUNCH_TIMEOUT_S = 1800
DEFAULT_OUT = RESULTS / "buckets.json"


def distinct_sizes(model_name: str) -> list[dict[str, Any]]:
    """The grid's candidates for this model, one per distinct layout (as ``"auto"`` predicts them)."""
    from lightning_mgpu.tuning.buckets import DEFAULT_GRID_MB
    from lightning_mgpu.tuning.layout import candidates_from_ready_order, observe_ready_order

    model, data, loss_fn = build(model_name)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs, targets = data[: BATCH[model_name]]
    order = observe_ready_order(params, lambda: loss_fn(model(inputs), targets).backward())
    candidates = candidates_from_ready_order(params, order, DEFAULT_GRID_MB, 25.0, lambda cap: min(1.0, cap))
    return [c.as_dict() for c in candidates]


# ----------------------------------------------------------------------------- one fit (runs in every rank)
def fit_once(model_name: str, bucket_cap_mb: Any, steps: int, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L

    from lightning_mgpu import TunedDDPStrategy

    strategy = TunedDDPStrategy(bucket_cap_mb=bucket_cap_mb)
    if bucket_cap_mb == "auto" and args.quick:
        worker.quick_tuning(strategy)  # smoke run: tune in a few steps, whatever the run length
    timing: dict[str, Any] = {"status": []}

    class Totals(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            timing["fit_start"] = time.perf_counter_ns()

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            timing["status"].append(strategy.tuning_status)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            timing["fit_ns"] = time.perf_counter_ns() - timing["fit_start"]
            layout = strategy.bucket_layout
            timing["built_bytes"] = None if layout is None else [b.bytes for b in layout]

    done = fit(model_name, strategy, steps, callbacks=[Totals()], accelerator=args.accelerator)
    step_ms = done.step_ms
    result: dict[str, Any] = {
        "model": model_name,
        "bucket_cap_mb": bucket_cap_mb,
        "size_in_force": strategy.bucket_cap_mb,
        "steps": done.trainer.global_step,
        "step_ms": step_ms,
        "fit_s": timing["fit_ns"] / 1e9,
        "built_bytes": timing["built_bytes"],
        "final_loss": done.module.losses()[-1],
    }
    if bucket_cap_mb == "auto":
        statuses = timing["status"]
        active = [i for i, s in enumerate(statuses) if s in ("waiting", "observing", "measuring")]
        ended = (active[-1] + 1) if active else 0
        result.update(
            tuning=strategy.tuning or {},
            tuning_steps=ended,
            tuned_step_ms=step_ms[ended + AFTER_TUNING :],
            rewraps=strategy.rewraps,
        )
    else:
        result["timed_step_ms"] = step_ms[args.warmup :]
    return result


def run_worker(args: argparse.Namespace) -> None:
    """Every configuration of every model, in this round's order; rank 0 writes the results."""
    worker.run_plan(
        args,
        lambda item: fit_once(*item, args),
        lambda item, result, _: f"  {item[0]:<8} {str(item[1]):>5}  {result['fit_s']:6.1f} s",
    )


# ----------------------------------------------------------------------------- driver
def round_plan(sizes: dict[str, list[dict[str, Any]]], round_index: int, args: argparse.Namespace) -> list[Any]:
    """(model, bucket_cap_mb, steps) in this round's order: each model's configurations rotated."""
    plan = []
    for model_name in args.models:
        configs: list[Any] = [c["cap_mb"] for c in sizes[model_name]] + ["auto"]
        for config in round_order(configs, round_index, scheme="rotate"):
            # DDP's default (25 MiB: same layout as bucket_cap_mb=None) and "auto" run the whole run.
            long_run = config == "auto" or config == 25.0
            steps = args.run_steps if long_run else args.warmup + args.sweep_steps
            plan.append([model_name, None if config == 25.0 else config, steps])
    return plan


def launch_round(
    plan: list[Any], args: argparse.Namespace, scratch: Path, label: str, lab: Any = None
) -> list[dict[str, Any]]:
    """One launch running ``plan``'s fits in order (as ``lab``'s nodes if given); rank 0's results."""
    worker_args = [
        "--warmup", str(args.warmup), "--accelerator", args.accelerator, "--threads", str(args.threads),
        *(["--quick"] if args.quick else []),
    ]  # fmt: skip  # each option beside its value
    finished = launch.launch_plan(
        MODULE,
        plan,
        worker_args,
        scratch=scratch,
        label=label,
        lab=lab,
        **launch.options(args),
        # A CPU run sees no GPU at all: nothing in the ranks initialises CUDA.
        env={"CUDA_VISIBLE_DEVICES": ""} if args.accelerator == "cpu" else None,
    )
    print(finished.worker_lines())
    return list(finished.report)


def analyse(model_name: str, candidates: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep, the tuned step time and the total times of one model, with the targets."""
    sweep = []
    for candidate in candidates:
        cap = None if candidate["is_default"] else candidate["cap_mb"]
        mine = [r for r in runs if r["bucket_cap_mb"] == cap]
        medians = [median(r["timed_step_ms"]) for r in mine]
        built = {tuple(r["built_bytes"] or ()) for r in mine}
        sweep.append(
            {
                **candidate,
                "step_ms": median(medians),
                "step_ms_per_round": medians,
                "built_matches_prediction": built == {tuple(candidate["bucket_bytes"])},
                "fit_s": [r["fit_s"] for r in mine],
            }
        )
    default = next(s for s in sweep if s["is_default"])
    best = min(sweep, key=lambda s: s["step_ms"])
    autos = [r for r in runs if r["bucket_cap_mb"] == "auto"]
    tuned = [median(r["tuned_step_ms"]) for r in autos if r["tuned_step_ms"]]
    tuned_ms = median(tuned) if tuned else float("nan")
    auto_total = median([r["fit_s"] for r in autos])
    default_total = median(default["fit_s"])
    gap = default["step_ms"] / best["step_ms"] - 1
    total_ratio = auto_total / default_total
    sizes_ms = {point["cap_mb"]: point["step_ms"] for point in sweep}
    chosen_ms = [sizes_ms[r["size_in_force"]] for r in autos if r["size_in_force"] in sizes_ms]
    auto_step = auto_total / default_total * default["step_ms"]  # auto's cost per step, tuning included
    uncaptured = (auto_step - best["step_ms"]) / (default["step_ms"] - best["step_ms"]) if gap >= GAP else None
    repeat = max(chosen_ms) / min(chosen_ms) if chosen_ms else 1.0
    return {
        "model": model_name,
        "sweep": sweep,
        "best": {"cap_mb": best["cap_mb"], "step_ms": best["step_ms"]},
        "default": {"step_ms": default["step_ms"], "total_s": default_total, "total_s_per_round": default["fit_s"]},
        "auto": {
            "chosen_mb": [r["size_in_force"] for r in autos],
            "status": [r["tuning"].get("status") for r in autos],
            "tuning_steps": [r["tuning_steps"] for r in autos],
            "rewraps": [len(r["rewraps"]) for r in autos],
            "tuned_step_ms": tuned_ms,
            "tuned_step_ms_per_round": tuned,
            "total_s": auto_total,
            "total_s_per_round": [r["fit_s"] for r in autos],
            "tables": [r["tuning"].get("candidates") for r in autos],
        },
        "sweep_gap": gap,
        "targets": {
            "tuned_vs_best": against(tuned_ms / best["step_ms"], STEP_TIME_LIMIT),
            "total_vs_default": {**against(total_ratio, 1.0), "must_be_better": gap >= GAP},
            # issue 14 (judged on the network lab, --link-gbps): "auto" within 1% of the default's total, the
            # rounds' choices within 3% of each other, and (where the gap is >= 10%) at most 20% of it left
            "total_vs_default_1pct": against(total_ratio, 1.01),
            "repeat_consistency": against(repeat, 1.03),
            **({} if uncaptured is None else {"gap_left": against(uncaptured, 0.2)}),
        },
    }


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"launches, configurations rotated ({ROUNDS})")
    parser.add_argument(
        "--run-steps", type=int, default=RUN_STEPS, help=f'steps of DDP default and "auto" ({RUN_STEPS})'
    )
    parser.add_argument(
        "--sweep-steps", type=int, default=SWEEP_STEPS, help=f"timed steps of other sizes ({SWEEP_STEPS})"
    )
    parser.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed steps first, >= 2 ({WARMUP})")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {MODELS}")
    cli.add_launch_options(parser, out=DEFAULT_OUT, quick=QUICK, timeout=LAUNCH_TIMEOUT_S)
    parser.add_argument(
        "--link-gbps", type=float, default=None, help="run as 2 nodes over a link shaped to this rate (netlab; root)"
    )
    parser.add_argument("--worker-plan", default=None, help=argparse.SUPPRESS)
    args = cli.finish(parser, argv, QUICK, positive=("rounds", "run_steps", "sweep_steps", "nproc", "threads"))
    args.models = cli.names(args.models, MODELS, "--models", parser)
    if args.warmup < 2:
        parser.error(
            f"argument --warmup: must be >= 2 (DDP rebuilds its buckets at the start of step 2), got {args.warmup}"
        )
    if args.link_gbps is not None and args.nproc % 2:
        parser.error(f"argument --nproc: with --link-gbps the ranks are 2 nodes of nproc/2 each, got {args.nproc}")
    if args.run_steps <= args.warmup:
        parser.error(f"argument --run-steps: must exceed --warmup ({args.warmup}), got {args.run_steps}")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker_plan:
        run_worker(args)
        return
    started = time.perf_counter()
    sizes = {name: distinct_sizes(name) for name in args.models}
    for name in args.models:
        model, _, _ = build(name)
        layouts = ", ".join(f"{c['cap_mb']:g}" for c in sizes[name])
        print(
            f"{name}: {count_parameters(model):,} parameters; {len(sizes[name])} distinct layouts on the grid ({layouts} MiB)"
        )
    print(
        f'{args.rounds} round(s); DDP default and "auto": {args.run_steps} steps; other sizes: {args.warmup} + '
        f"{args.sweep_steps} steps; {args.nproc} ranks on {args.accelerator}, {args.threads} thread(s) each\n"
    )
    runs: list[dict[str, Any]] = []
    link: Optional[dict[str, Any]] = None
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_buckets_"))
        lab = None
        if args.link_gbps is not None:
            from bench.labs.network import Lab

            lab = stack.enter_context(Lab(2, args.link_gbps))
            link = lab.measure_both_ways()
            there, back = link["measured_gbps"]
            print(f"2 nodes over a {args.link_gbps:g} Gbit/s link: measured {there:.3f} / {back:.3f} Gbit/s")
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}")
            plan = round_plan(sizes, round_index, args)
            for result in launch_round(plan, args, Path(scratch), f"round{round_index}", lab):
                result["round"] = round_index
                runs.append(result)
    models = [analyse(name, sizes[name], [r for r in runs if r["model"] == name]) for name in args.models]
    elapsed = time.perf_counter() - started
    payload = {
        "benchmark": "buckets",
        "machine": machine_of(args),
        "settings": {
            "models": args.models,
            "rounds": args.rounds,
            "run_steps": args.run_steps,
            "sweep_steps": args.sweep_steps,
            "warmup": args.warmup,
            "batch_size_per_rank": {m: BATCH[m] for m in args.models},
            "parameters": {m: count_parameters(build(m)[0]) for m in args.models},
            "quick": args.quick,
            "launcher": launch.describe(args.nproc, lab),
            "link": link,
            "timed_span": "first on_train_batch_start to first on_train_batch_end callback, rank 0",
            "total": "fit wall time, on_train_start to on_train_end callback, rank 0",
            "targets": {"tuned_vs_best_limit": STEP_TIME_LIMIT, "gap_for_must_be_better": GAP},
        },
        "models": models,
        "runs": runs,
        "wall_s": elapsed,
    }
    out = write_json(args.out, payload)
    png = plot(models, out.with_suffix(".png"), args.run_steps)
    print_report(models, out, png, elapsed)


# ----------------------------------------------------------------------------- the figure and the tables
def plot(models: list[dict[str, Any]], path: Path, run_steps: int) -> Path:
    fig, axes = subplots(2, len(models), figsize=(4.2 * len(models), 7), squeeze=False)
    for column, entry in enumerate(models):
        ax = axes[0][column]
        for point in entry["sweep"]:
            sizes = point["equivalent_mb"]
            color = "tab:gray" if point["is_default"] else "tab:blue"
            ax.plot([min(sizes), max(sizes)], [point["step_ms"]] * 2, color=color, linewidth=3, solid_capstyle="round")
            ax.scatter([point["cap_mb"]], [point["step_ms"]], color=color, marker="D", s=30, zorder=3)
        tuned = entry["auto"]["tuned_step_ms"]
        ax.axhline(tuned, color="tab:red", linestyle="--", linewidth=1.2, label=f"auto, after tuning: {tuned:.1f} ms")
        for chosen in entry["auto"]["chosen_mb"]:
            ax.scatter([chosen], [tuned], color="tab:red", marker="*", s=120, zorder=4)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{entry['model']}: step time by bucket size", fontsize=10)
        ax.set_xlabel("bucket_cap_mb (MiB); grey = DDP default's layout")
        ax.set_ylabel("median step time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        ax = axes[1][column]
        totals = [entry["default"]["total_s"], entry["auto"]["total_s"]]
        bars = ax.bar(["DDP default", '"auto" (tuning included)'], totals, color=["tab:gray", "tab:red"])
        for bar, value in zip(bars, totals):
            ax.annotate(
                f"{value:.1f} s", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=9
            )
        ratio = entry["targets"]["total_vs_default"]["ratio"]
        ax.set_title(f"{entry['model']}: {run_steps}-step fit, total time (auto/default {ratio:.3f})", fontsize=10)
        ax.set_ylabel("seconds")
    return save_figure(fig, path, dpi=110)


def print_report(models: list[dict[str, Any]], out: Path, png: Path, elapsed: float) -> None:
    for entry in models:
        rows = []
        for point in entry["sweep"]:
            others = [f"{s:g}" for s in point["equivalent_mb"] if s != point["cap_mb"]]
            rows.append(
                [
                    f"{point['cap_mb']:g}" + (" (DDP default)" if point["is_default"] else ""),
                    ", ".join(others) or "-",
                    ", ".join(f"{b / 2**20:.1f}" for b in point["bucket_bytes"]),
                    f"{point['step_ms']:.2f}",
                    " / ".join(f"{ms:.1f}" for ms in point["step_ms_per_round"]),
                    f"{point['step_ms'] / entry['default']['step_ms'] - 1:+.1%}",
                ]
            )
        auto = entry["auto"]
        rows.append(
            [
                '"auto" (after tuning)',
                "chose " + ", ".join(f"{c:g}" for c in auto["chosen_mb"]),
                "tuning steps: " + ", ".join(str(n) for n in auto["tuning_steps"]),
                f"{auto['tuned_step_ms']:.2f}",
                " / ".join(f"{ms:.1f}" for ms in auto["tuned_step_ms_per_round"]),
                f"{auto['tuned_step_ms'] / entry['default']['step_ms'] - 1:+.1%}",
            ]
        )
        print()
        print_table(
            f"{entry['model']}: step time by bucket size (median over rounds of per-run medians)",
            ["bucket_cap_mb", "same layout", "buckets (MiB)", "step ms", "per round", "vs default"],
            rows,
        )
        step, total = entry["targets"]["tuned_vs_best"], entry["targets"]["total_vs_default"]
        print(
            f"{entry['model']}: tuned/best fixed {step['ratio']:.3f} (limit {step['limit']}) -> "
            f"{'met' if step['met'] else 'NOT met'}; sweep gap (default/best - 1) {entry['sweep_gap']:+.1%}; "
            f"total {entry['auto']['total_s']:.1f} s auto vs {entry['default']['total_s']:.1f} s default = "
            f"{total['ratio']:.3f} -> {'met' if total['met'] else 'NOT met'}"
            + (" (must be better: gap >= 10%)" if total["must_be_better"] else "")
        )
    print(f"\n{elapsed:.0f} s in all; wrote {out} and {png}")


if __name__ == "__main__":
    main()
