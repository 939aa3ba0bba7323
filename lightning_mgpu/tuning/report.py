"""Show a tuning record: a console table and a plot (``lightning-mgpu tune``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning_mgpu import _tables
from lightning_mgpu.tuning import decision
from lightning_mgpu.tuning.decision import _cells


def rows(record: dict[str, Any]) -> list[list[str]]:
    """Table rows: size, same-layout sizes, buckets, median, spread, rounds, vs default [interval], chosen mark."""
    results = [decision.CandidateResult.from_dict(c) for c in record.get("candidates", []) if "step_ms" in c]
    default = next((r for r in results if r.candidate.is_default), None)
    return [
        [
            *_cells(result, default, result.built_bytes or result.candidate.bucket_bytes),
            "*" if result.candidate.cap_mb == record.get("chosen_mb") else "",
        ]
        for result in results
    ]


def verdict(record: dict[str, Any]) -> str:
    """How the choice was made: faster with confidence, not faster, or too noisy to decide (and why)."""
    outcome = record.get("outcome")
    extra = record.get("extra_rounds") or 0
    more = f" after {extra} extra round(s) of the closest layouts" if extra else ""
    confidence = f"{record.get('confidence', 0.95):.0%} confidence"
    if outcome == decision.NOISY:
        results = [decision.CandidateResult.from_dict(c) for c in record.get("candidates", []) if "step_ms" in c]
        return decision.noise_note(results, decision.NOISY, float(record.get("min_gain") or 0.02)) + more
    if outcome == "faster":
        return f"faster than DDP's default with {confidence}{more}"
    if outcome == "not faster":
        return f"no layout at least {float(record.get('min_gain') or 0.02):.0%} faster than DDP's default ({confidence}){more}"
    return ""


def print_table(result: dict[str, Any]) -> None:
    record = result["tuning"]
    caption = "step ms: median over every timed step, slowest rank; spread: half the interquartile range; per round: the median of each round"
    decided = verdict(record)
    _tables.print_table(
        f"{result['target']}: bucket size -> step time ({result['world_size']} ranks, {result['backend']})",
        (*decision.COLUMNS, "chosen"),
        rows(record),
        left=3,
        caption=f"{caption}\n{decided}" if decided else caption,
    )


def plot(result: dict[str, Any], path: Path, *, title: Optional[str] = None) -> Path:
    """Median step time per candidate size (log2 axis); every same-layout size drawn as a span."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = result["tuning"]
    candidates = [c for c in record.get("candidates", []) if "step_ms" in c]
    fig, ax = plt.subplots(figsize=(7, 4))
    for candidate in candidates:
        sizes, ms = candidate["equivalent_mb"], candidate["step_ms"]
        color = "tab:red" if candidate["cap_mb"] == record.get("chosen_mb") else "tab:blue"
        ax.plot([min(sizes), max(sizes)], [ms, ms], color=color, linewidth=3, solid_capstyle="round")
        ax.scatter([candidate["cap_mb"]], [ms], color=color, marker="D", s=36, zorder=3)
        ax.scatter(
            [candidate["cap_mb"]] * len(candidate["round_ms"]), candidate["round_ms"], color=color, s=12, alpha=0.5
        )
        label = f"{candidate['cap_mb']:g}" + (" (default)" if candidate["is_default"] else "")
        ax.annotate(
            label, (candidate["cap_mb"], ms), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket_cap_mb (MiB); a bar spans the sizes giving one layout")
    ax.set_ylabel("step time (ms): median (diamond), per round (dots)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"{result['target']} - {result['world_size']} ranks, {result['backend']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
