"""How ``bench.buckets`` shows its results: the figure (step time by bucket size, total fit times) and the tables.

Both read only the per-model entries that ``bench.buckets.analyse`` returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.harness.report import print_table


def plot(models: list[dict[str, Any]], path: Path, run_steps: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7), squeeze=False)
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
