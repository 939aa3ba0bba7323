"""How ``python -m bench.netlab --sweep`` shows its results: a table per model and one figure.

Reads only the rows :func:`bench.netlab_sweep.analyse` returns. The figure has one panel per
model: median step time against the link rate (both axes logarithmic, the measured rate on
the x axis), one line per option; the table puts each lossy option's loss after a fixed
number of steps beside its speed-up, so speed is never shown without its cost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from bench.harness.report import print_table

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 4.2), squeeze=False)
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
