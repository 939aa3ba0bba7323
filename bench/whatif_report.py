"""The tables and the figure of ``bench/whatif.py``: predicted against measured step times.

Pure reporting over the JSON ``bench.whatif`` writes (re-run on a saved result with
``python -m bench.whatif_report bench/results/whatif.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from bench.harness.report import print_table, save_figure, subplots
from bench.harness.stats import median

MEDIAN_TARGET_PCT = 10.0
WORST_TARGET_PCT = 20.0
TITLES = {
    "loopback_profile": "from one loopback profile (default buckets) -> every rate, bucket size and compression",
    "profile_at_1gbps": "from one profile at 1 Gbit/s (default buckets) -> bucket sizes and compression there",
    "one_rank_plus_bench_comm": "from a 1-rank profile + bench-comm over the link -> 2 ranks, default buckets and fp16",
    "one_rank_plus_achieved_rate": "the same, the link as the rate a raw TCP transfer achieved (--link-gbps)",
    "one_rank_plus_nominal_rate": "the same, the link as its configured (nominal) rate (--link-gbps)",
    "one_rank_beside_plus_bench_comm": "from a 1-rank profile taken beside a copy (a lab node's compute) + bench-comm",
}


def summarize_errors(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst absolute error (%) of the predictions, and whether they meet the targets."""
    errors = [abs(r["error_pct"]) for r in rows]
    if not errors:
        return {"n": 0}
    middle, worst = median(errors), max(errors)
    return {
        "n": len(errors),
        "median_abs_error_pct": middle,
        "worst_abs_error_pct": worst,
        "worst": max(rows, key=lambda r: abs(r["error_pct"]))["config"],
        "meets_targets": middle <= MEDIAN_TARGET_PCT and worst <= WORST_TARGET_PCT,
        "targets": {"median_pct": MEDIAN_TARGET_PCT, "worst_pct": WORST_TARGET_PCT},
    }


def print_report(report: dict[str, Any]) -> None:
    for name, rows in report["validations"].items():
        if not rows:
            continue
        table_rows = [
            (
                r["model"],
                f"{r['rate_gbps']:g} ({r['achieved_gbps']:.2f})",
                r["config"],
                f"{r['predicted_ms']:,.1f}",
                f"{r['measured_ms']:,.1f}",
                f"{r['error_pct']:+.1f}%",
                f"{r['predicted_exposed_ms']:,.1f}",
                "yes" if r["layout_matches"] else "no",
                f"{r['final_loss']:.4f}",
            )
            for r in rows
        ]
        summary = report["summary"][name]
        caption = (
            f"median |error| {summary['median_abs_error_pct']:.1f}% (target <= {MEDIAN_TARGET_PCT:g}%), "
            f"worst {summary['worst_abs_error_pct']:.1f}% (target <= {WORST_TARGET_PCT:g}%): "
            + ("targets met" if summary["meets_targets"] else "targets NOT met")
        )
        print_table(
            TITLES.get(name, name),
            (
                "model",
                "Gbit/s (achieved)",
                "config",
                "predicted ms",
                "measured ms",
                "error",
                "pred. exposed",
                "layout",
                "loss",
            ),
            table_rows,
            caption=caption,
        )


def plot(report: dict[str, Any], path: Path) -> Path:
    """Predicted against measured step time, log-log, the y = x line and the 10% / 20% bands."""
    fig, ax = subplots(figsize=(6.5, 6))
    markers = {
        "loopback_profile": "o",
        "profile_at_1gbps": "s",
        "one_rank_plus_bench_comm": "^",
        "one_rank_plus_achieved_rate": "v",
        "one_rank_plus_nominal_rate": "x",
        "one_rank_beside_plus_bench_comm": "D",
    }
    short = {
        "loopback_profile": "2-rank loopback profile",
        "profile_at_1gbps": "profile at 1 Gbit/s",
        "one_rank_plus_bench_comm": "1-rank profile + bench-comm",
        "one_rank_plus_achieved_rate": "1-rank profile + achieved rate",
        "one_rank_plus_nominal_rate": "1-rank profile + nominal rate",
        "one_rank_beside_plus_bench_comm": "1-rank profile beside a copy + bench-comm",
    }
    values: list[float] = []
    for name, rows in report["validations"].items():
        if not rows:
            continue
        measured = [r["measured_ms"] for r in rows]
        predicted = [r["predicted_ms"] for r in rows]
        values += measured + predicted
        label = short.get(name, name)
        errors = summarize_errors(rows)
        if errors.get("n"):
            label += f": median {errors['median_abs_error_pct']:.1f}%, worst {errors['worst_abs_error_pct']:.0f}%"
        ax.scatter(measured, predicted, marker=markers.get(name, "x"), label=label, alpha=0.8)
    if values:
        low, high = min(values) / 1.3, max(values) * 1.3
        ax.plot([low, high], [low, high], color="black", linewidth=1, label="y = x")
        for band, style in ((0.10, "--"), (0.20, ":")):
            ax.plot([low, high], [low * (1 + band), high * (1 + band)], style, color="grey", linewidth=0.8)
            ax.plot([low, high], [low * (1 - band), high * (1 - band)], style, color="grey", linewidth=0.8)
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title(
        "lightning-mgpu whatif: predicted vs measured (2 ranks, gloo, netlab)\ndashed ±10%, dotted ±20%", fontsize=9
    )
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    return save_figure(fig, path)


def main(argv: Sequence[str] = tuple(sys.argv[1:])) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m bench.whatif_report RESULT.json")
    path = Path(argv[0])
    report = json.loads(path.read_text())
    print_report(report)
    print(f"wrote {plot(report, path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
