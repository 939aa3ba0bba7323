"""What each option buys where communication costs: ``python -m bench.netlab --sweep`` (this module's driver).

Two nodes of :mod:`bench.labs.network`'s lab (one rank each, gloo over a tbf-shaped veth link),
three models of different shape (:func:`bench.models.build`'s 8M MLP, VGG-style CNN and char_lm
transformer), every option a user can pick:

    ddp         Lightning's stock ``Trainer(strategy="ddp")``
    ddp_tuned   ``TunedDDPStrategy()`` (DDP's default buckets)
    auto        ``TunedDDPStrategy(bucket_cap_mb="auto")``: tuning included in its run
    fp16, bf16  ``TunedDDPStrategy(compression=...)``
    powersgd1, powersgd4
                ``TunedDDPStrategy(compression="powersgd", powersgd_rank=1 / 4)``

at 0.1, 1 and 10 Gbit/s (``--rates``). **Interleaved rounds**: every round visits every rate
(order rotated each round); at each rate one torchrun launch trains every model and option,
in an order rotated each round, so a machine that drifts favours nobody. The link is
re-measured with a raw TCP transfer at every rate change: every figure carries the rate the
link actually gave. Reported per (model, rate, option): the median over rounds of each run's
median step time after ``--warmup`` steps; for ``auto`` also its mean step time over the whole
run after warm-up (**tuning included**: its slower candidates, re-wraps, rebuilds) and what it
chose. ``auto`` trains ``--auto-steps`` steps (its search needs a run several times longer
than itself), the others ``--steps``.

**Speed is never shown without its cost**: a separate launch (one, at the fastest rate: the
result does not depend on the link) trains every option ``--loss-steps`` steps from the same
seed and data, and reports the loss on a fixed evaluation set beside the step times.

Writes ``--out`` (bench/results/netlab_sweep.json) and the figure next to it (step time vs
link rate, one line per option, one panel per model). Needs root (network namespaces).

The tables (one per model) put each lossy option's loss after a fixed number of steps beside its
speed-up; the figure has one panel per model: median step time against the link rate (both axes
logarithmic, the measured rate on the x axis), one line per option.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Optional

from bench import RESULTS
from bench.harness import launch, worker
from bench.harness.report import print_table, save_figure, subplots
from bench.harness.stats import median
from bench.labs.network import Lab
from bench.models import BATCH, fit
from lightning_mgpu.tuning.statistics import round_order

OPTIONS = ("ddp", "ddp_tuned", "auto", "fp16", "bf16", "powersgd1", "powersgd4")
LOSSY = ("fp16", "bf16", "powersgd1", "powersgd4")
RATES_GBPS = (0.1, 1.0, 10.0)
ROUNDS = 3
STEPS = 40
AUTO_STEPS = 200
WARMUP = 8
LOSS_STEPS = 200
EVAL_BATCHES = 4
POWERSGD_START_ITER = 2  # DDP's first iteration and bucket rebuild; compression from the start after them
QUICK = {
    "rounds": 1,
    "rates": "1",
    "models": "mlp",
    "steps": 5,
    "auto_steps": 12,
    "warmup": 2,
    "loss_steps": 4,
    "probe_seconds": 0.2,
}
DEFAULT_OUT = RESULTS / "netlab_sweep.json"
LAUNCH_TIMEOUT_S = 3600


# ----------------------------------------------------------------------------- one fit (runs in every rank)
def make_strategy(option: str) -> Any:
    from lightning_mgpu import TunedDDPStrategy

    if option == "ddp":
        return "ddp"
    if option == "ddp_tuned":
        return TunedDDPStrategy()
    if option == "auto":
        return TunedDDPStrategy(bucket_cap_mb="auto")
    if option in ("fp16", "bf16"):
        return TunedDDPStrategy(compression=option)  # type: ignore[arg-type]  # fp16 or bf16
    if option.startswith("powersgd"):
        rank = int(option.removeprefix("powersgd"))
        return TunedDDPStrategy(compression="powersgd", powersgd_rank=rank, powersgd_start_iter=POWERSGD_START_ITER)
    raise ValueError(f"unknown option {option!r}; choose from {OPTIONS}")


def fit_option(model_name: str, option: str, steps: int, quick: bool) -> dict[str, Any]:
    """Train ``option`` on ``model_name`` for ``steps`` steps; rank 0's step times, loss and choices."""
    import torch

    strategy = make_strategy(option)
    if option == "auto" and quick:
        worker.quick_tuning(strategy)
    done = fit(model_name, strategy, steps)
    held_out = done.data[: EVAL_BATCHES * BATCH[model_name]]  # the same fixed samples for every option
    with torch.no_grad():
        eval_loss = float(done.loss_fn(done.model(held_out[0]), held_out[1]))
    result: dict[str, Any] = {
        "model": model_name,
        "option": option,
        "steps": done.trainer.global_step,
        "step_ms": done.step_ms,
        "eval_loss": eval_loss,
    }
    if getattr(strategy, "tuner", None) is not None:
        record = strategy.tuning or {}
        result["tuning"] = {k: record.get(k) for k in ("status", "outcome", "chosen_mb", "steps", "extra_rounds")}
    return result


def run_worker(args: argparse.Namespace) -> None:
    """Every (model, option, steps) of the plan in order; rank 0 writes the results."""
    worker.run_plan(
        args,
        lambda item: fit_option(*item, args.quick),
        lambda item, _, seconds: f"  {item[0]:<8} {item[1]:<10} {item[2]:>4} steps  {seconds:7.1f} s",
    )


# ----------------------------------------------------------------------------- driver
def timing_plan(args: argparse.Namespace, round_index: int) -> list[list[Any]]:
    """(model, option, steps) for one launch: every model, every option, in this round's order."""
    return [
        [model_name, option, args.auto_steps if option == "auto" else args.steps]
        for model_name in round_order(args.models, round_index, scheme="rotate")
        for option in round_order(args.options, round_index, scheme="rotate")
    ]


def run_plan(lab: Lab, plan: list[list[Any]], args: argparse.Namespace, scratch: Path, label: str) -> list[Any]:
    worker_args = ["--threads", str(args.threads), *(["--quick"] if args.quick else [])]
    finished = launch.launch_plan(
        "bench.netlab", plan, worker_args, scratch=scratch, label=label, nproc=2, threads=args.threads,
        timeout=args.launch_timeout, lab=lab,
    )  # fmt: skip
    print(finished.worker_lines())
    return list(finished.report)


def measure(lab: Lab, rate: float, seconds: float) -> dict[str, Any]:
    lab.set_rates(rate)
    link = lab.measure_both_ways(seconds)
    print(f"link {rate:g} Gbit/s: measured {link['measured_gbps'][0]:.3f} / {link['measured_gbps'][1]:.3f} Gbit/s")
    return link


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Build the lab, run the rounds and the loss launch, tear the lab down; every run's raw results."""
    runs: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    with Lab(2, max(args.rates)) as lab, tempfile.TemporaryDirectory(prefix="netlab_sweep_") as scratch:
        for round_index in range(args.rounds):
            for rate in round_order(sorted(args.rates), round_index, scheme="rotate"):
                print(f"round {round_index + 1}/{args.rounds}, {rate:g} Gbit/s")
                link = {**measure(lab, rate, args.probe_seconds), "round": round_index}
                links.append(link)
                label = f"round{round_index}_{rate:g}gbps"
                for result in run_plan(lab, timing_plan(args, round_index), args, Path(scratch), label):
                    runs.append({**result, "round": round_index, "rate_gbps": rate, "link": link})
        losses: list[dict[str, Any]] = []
        if args.add_to is None:  # adding rates to a sweep: its losses stand (they do not depend on the link)
            fastest = max(args.rates)
            print(f"loss after {args.loss_steps} steps ({fastest:g} Gbit/s; the result does not depend on the link)")
            measure(lab, fastest, args.probe_seconds)
            plan = [[m, o, args.loss_steps] for m in args.models for o in args.options]
            losses = run_plan(lab, plan, args, Path(scratch), "loss")
    return {"runs": runs, "links": links, "losses": losses}


MUST_MATCH = ("models", "options", "steps", "auto_steps", "warmup", "loss_steps", "quick")
"""Settings a sweep added to must share with it, or its rows would not compare."""


def check_addable(existing: dict[str, Any], args: argparse.Namespace) -> None:
    """Refuse to add ``args.rates`` to ``existing`` where the rows would not compare (raises ValueError)."""
    if existing.get("benchmark") != "netlab_sweep":
        raise ValueError(f"--add-to: not a netlab sweep report (benchmark {existing.get('benchmark')!r})")
    settings = existing["settings"]
    differ = [
        f"{key}: {settings.get(key)!r} there, {getattr(args, key)!r} here"
        for key in MUST_MATCH
        if settings.get(key) != getattr(args, key)
    ]
    if differ:
        raise ValueError("--add-to: the report was measured with other settings (" + "; ".join(differ) + ")")
    both = sorted(set(settings["rates"]) & set(args.rates))
    if both:
        raise ValueError(
            f"--add-to: the report already has {', '.join(f'{r:g}' for r in both)} Gbit/s; drop it from --rates"
        )


def merge(
    existing: dict[str, Any], raw: dict[str, Any], args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The existing report's raw results with this run's rates added, and the merged settings.

    Rounds are interleaved within each run, not across the two: ``rounds_by_rate`` says which
    run measured which rate, and the losses are the existing run's."""
    settings = dict(existing["settings"])
    before = settings.get("rounds_by_rate") or {f"{rate:g}": settings["rounds"] for rate in settings["rates"]}
    settings["rounds_by_rate"] = {**before, **{f"{rate:g}": args.rounds for rate in args.rates}}
    settings["rates"] = sorted({*settings["rates"], *args.rates})
    settings["added"] = [*settings.get("added", []), {"rates": sorted(args.rates), "rounds": args.rounds}]
    old = existing["raw"]
    merged = {"runs": old["runs"] + raw["runs"], "links": old["links"] + raw["links"], "losses": old["losses"]}
    return merged, settings


def median_or_none(values: list[float]) -> Optional[float]:
    return median(values) if values else None


def analyse(raw: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (model, rate, option): medians over rounds, measured link, loss, and auto's choices."""
    rows = []
    for model_name in args.models:
        for rate in sorted(args.rates):
            measured = [g for link in raw["links"] if link["configured_gbps"] == rate for g in link["measured_gbps"]]
            here = [r for r in raw["runs"] if (r["model"], r["rate_gbps"]) == (model_name, rate)]

            timed = {
                option: [
                    r["step_ms"][args.warmup :] for r in here if r["option"] == option and r["step_ms"][args.warmup :]
                ]
                for option in args.options
            }
            baseline = median_or_none([median(steps) for steps in timed.get("ddp", [])])
            for option in args.options:
                mine = [r for r in here if r["option"] == option]
                per_round = [median(steps) for steps in timed[option]]
                whole = [sum(steps) / len(steps) for steps in timed[option]]
                step_ms = median_or_none(per_round)
                loss = next(
                    (r["eval_loss"] for r in raw["losses"] if (r["model"], r["option"]) == (model_name, option)), None
                )
                row: dict[str, Any] = {
                    "model": model_name,
                    "rate_gbps": rate,
                    "measured_gbps": median_or_none(measured),
                    "option": option,
                    "step_ms": step_ms,
                    "step_ms_per_round": per_round,
                    "mean_step_ms": median_or_none(whole),
                    "speedup_vs_ddp": None if not (baseline and step_ms) else baseline / step_ms,
                    "eval_loss": loss,
                    "lossy": option in LOSSY,
                }
                if option == "auto":
                    row["tuning"] = [r.get("tuning") for r in mine]
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the tables and the figure
STYLE = {
    "ddp": ("tab:gray", "o", "-"),
    "ddp_tuned": ("tab:blue", "s", "-"),
    "auto": ("tab:red", "*", "-"),
    "fp16": ("tab:green", "^", "--"),
    "bf16": ("tab:olive", "v", "--"),
    "powersgd1": ("tab:purple", "D", ":"),
    "powersgd4": ("tab:pink", "d", ":"),
}


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.1f}"


def headline_ms(row: dict[str, Any]) -> Optional[float]:
    """The figure a user pays: auto's mean over its whole run (tuning included), others' median step."""
    value = row["mean_step_ms"] if row["option"] == "auto" else row["step_ms"]
    return None if value is None else float(value)


def headline_speedup(row: dict[str, Any]) -> Optional[float]:
    """``ddp``'s median step over :func:`headline_ms` (for ``auto``, its whole-run mean)."""
    speedup, step, headline = row["speedup_vs_ddp"], row["step_ms"], headline_ms(row)
    if speedup is None or not step or not headline:
        return None
    return float(speedup * step / headline)


def print_report(rows: list[dict[str, Any]], loss_steps: int) -> None:
    """One table per model: options down, link rates across (step ms, x vs ddp), loss at the end."""
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        rates = sorted({r["rate_gbps"] for r in mine})
        columns = ["option"]
        for rate in rates:
            measured = next(r["measured_gbps"] for r in mine if r["rate_gbps"] == rate)
            label = f"{rate:g} Gbit/s" + ("" if measured is None else f" (got {measured:.2f})")
            columns += [f"{label} ms", "x ddp"]
        columns.append(f"loss @ {loss_steps} steps")
        table = []
        for option in dict.fromkeys(r["option"] for r in mine):
            cells = [option]
            for rate in rates:
                row = next(r for r in mine if (r["option"], r["rate_gbps"]) == (option, rate))
                speedup = headline_speedup(row)
                cells += [_ms(headline_ms(row)), "-" if speedup is None else f"{speedup:.2f}x"]
            loss = next((r["eval_loss"] for r in mine if r["option"] == option and r["eval_loss"] is not None), None)
            cells.append("-" if loss is None else f"{loss:.4f}")
            table.append(cells)
        print_table(
            f"{model}: step time over a shaped link (2 nodes x 1 rank, gloo)",
            columns,
            table,
            caption="median over rounds of each run's median step; auto: mean over its whole run, tuning included; "
            "loss: on a fixed evaluation set after the same steps from the same seed",
        )


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = subplots(1, len(models), figsize=(4.6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for option in dict.fromkeys(r["option"] for r in mine):
            points = sorted(
                ((r["measured_gbps"] or r["rate_gbps"], headline_ms(r)) for r in mine if r["option"] == option),
                key=lambda point: point[0],
            )
            points = [(x, y) for x, y in points if y is not None]
            if not points:
                continue
            color, marker, line = STYLE.get(option, ("black", "x", "-"))
            ax.plot(*zip(*points), color=color, marker=marker, linestyle=line, label=option)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate, measured (Gbit/s)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{model}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Step time vs link rate, 2 nodes over a tbf-shaped veth link (bench.netlab --sweep)", fontsize=10)
    return save_figure(fig, path)
