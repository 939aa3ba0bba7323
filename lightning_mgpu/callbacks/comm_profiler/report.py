"""CommProfiler's outputs: console summary, ``comm_profile.json``, CSV, Chrome trace, timeline plot, W&B.

Kept apart from the callback so that matplotlib and wandb are imported only when used.
``profile`` is the ``comm_profile.json`` document (:meth:`.stats.CommStats.profile`); timelines
are ``StepTimeline.as_dict()`` records from every rank.
"""

from __future__ import annotations

import csv
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning as L

from lightning_mgpu._tables import table, wide_console
from lightning_mgpu._sizes import MiB as _MIB

NOT_MEASURED = "not measured"
"""What the console shows for a figure the profiler could not see (null in comm_profile.json)."""


def print_summary(profile: dict[str, Any]) -> None:
    s = profile["summary"]
    title = f"CommProfiler: {profile['world_size']} rank(s), {profile['backend']} on {profile['device_type']}, {s['steps']} steps"
    step = s["step_ms"]["median"] or 1.0

    def shown(value: Optional[float], text: Callable[[float], str]) -> str:
        """``text(value)``, or "not measured": a figure the profiler could not see is never shown as 0."""
        return NOT_MEASURED if value is None else text(value)

    def ms(value: Optional[float], share: bool = False) -> str:
        """A time, or "not measured"."""
        return shown(value, lambda v: f"{v:.2f} ms" + (f" ({100 * v / step:.0f}%)" if share else ""))

    def with_p90(figure: dict[str, float]) -> str:
        return f"{figure['median']:.2f} ms (p90 {figure['p90']:.2f})"

    def wire() -> str:
        if s["wire_bytes_per_step"] is None:
            return NOT_MEASURED
        ratio = s.get("compression_ratio")
        return f"{s['wire_bytes_per_step'] / _MIB:.2f} MiB" + (f" (compression {ratio:.1f}x)" if ratio else "")

    def bandwidth() -> str:
        if s["busbw_gbps"] is None:
            return NOT_MEASURED
        fraction = s.get("busbw_fraction")
        return f"{s['busbw_gbps']:.3f} GB/s (algbw {s['algbw_gbps']:.3f})" + (
            f", {100 * fraction:.0f}% of this machine's peak" if fraction else ""
        )

    gradient = shown(s["bytes_per_step"], lambda b: f"{b / _MIB:.2f} MiB in {len(profile['buckets'])} bucket(s)")
    accumulate = int(s.get("accumulate_grad_batches") or 1)
    rows = [("step", with_p90(s["step_ms"]))]
    if accumulate > 1:  # the rows below are the synchronising micro-batch's; the optimizer step is all of them
        rows = [
            (f"optimizer step ({accumulate} micro-batches)", with_p90(s["optimizer_step_ms"])),
            ("  micro-batches without communication", ms(s.get("accumulation_ms"))),
            ("synchronising micro-batch", rows[0][1]),
        ]
    rows += [
        ("forward", ms(s["forward_ms"], share=True)),
        ("backward compute", ms(s["backward_compute_ms"], share=True)),
        ("communication span", ms(s["comm_ms"])),
        ("  hidden behind backward", shown(s["overlap_ratio"], lambda r: f"{100 * r:.0f}%")),
        (
            "  exposed (step waits)",
            shown(s["exposed_comm_ms"], lambda e: f"{e:.2f} ms ({100 * e / step:.0f}% of step)"),
        ),
        ("optimizer", ms(s["optimizer_ms"])),
        ("gradient bytes", gradient),
        ("bytes on the wire", wire()),
        ("bus bandwidth", bandwidth()),
        ("straggler skew", ms(s["straggler_ms"])),
    ]
    console = wide_console()
    console.print(table(title, ("per step (median, slowest rank)", "value"), rows))
    if profile["buckets"]:
        buckets = [
            [str(b["index"]), f"{b['bytes'] / _MIB:.2f}", str(b["num_params"])]
            + [f"{b[key]:.2f}" for key in ("launch_ms", "done_ms", "duration_ms")]
            + [f"{b['busbw_gbps']:.3f}"]
            for b in profile["buckets"]
        ]
        columns = ("#", "MiB", "params", "launch ms", "done ms", "duration ms", "busbw GB/s")
        console.print(table(bucket_table_title(profile), columns, buckets, left=0))


def bucket_table_title(profile: dict[str, Any]) -> str:
    """What the bucket table is: one step of one rank, with that step's own compute and span."""
    kept = profile.get("bucket_step")
    if not kept:
        return "buckets (launch order; times from backward start)"
    return (
        f"buckets of one step (rank {kept['rank']}, step {kept['step']}: its median communication span; "
        f"launch order; times from backward start, whose compute took {kept['backward_compute_ms']:.2f} ms)"
    )


EXPORTED_FILES = ("comm_profile.json", "comm_buckets.csv", "comm_timeline.png", "comm_trace.json")
"""What :func:`write_all` writes into ``export_dir``."""


def export_dir_problem(export_dir: Path) -> Optional[str]:
    """Why rank 0 could not write its files into ``export_dir`` (None: it can). Creates the directory."""
    if export_dir.exists() and not export_dir.is_dir():
        return "exists and is not a directory: pass a directory path (it is created if missing)"
    try:
        export_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=export_dir, prefix=".comm_profiler_probe_"):
            pass
    except OSError as error:
        return f"cannot be written ({error.strerror or error}): pass a writable directory"
    return None


def write_all(export_dir: Path, profile: dict[str, Any], timelines: list[dict[str, Any]]) -> None:
    """Every file of :data:`EXPORTED_FILES` into ``export_dir`` (created if missing)."""
    export_dir.mkdir(parents=True, exist_ok=True)
    (export_dir / "comm_profile.json").write_text(json.dumps(profile, indent=2))
    write_buckets_csv(export_dir / "comm_buckets.csv", profile["buckets"])
    write_chrome_trace(export_dir / "comm_trace.json", timelines)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # matplotlib's font and layout chatter
        write_timeline_png(export_dir / "comm_timeline.png", timelines)


BUCKET_COLUMNS = ["index", "bytes", "num_params", "launch_ms", "done_ms", "duration_ms", "algbw_gbps", "busbw_gbps"]
"""Per-bucket columns of comm_buckets.csv and the W&B table; times in ms from backward start."""


def write_buckets_csv(path: Path, buckets: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=BUCKET_COLUMNS)
        writer.writeheader()
        for bucket in buckets:
            writer.writerow({key: bucket[key] for key in BUCKET_COLUMNS})


PHASE_COLORS = {
    "forward": "#4C72B0",
    "backward compute": "#55A868",
    "waiting for communication": "#C44E52",
    "optimizer": "#8172B2",
}


def _phases(t: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The step's compute-lane phases; the wait is the exposed communication."""
    compute_end = t.get("compute_end_ms")
    if compute_end is None:
        backward = [("backward compute", t["forward_end_ms"], t["backward_end_ms"])]
    else:
        compute_end = max(t["forward_end_ms"], min(compute_end, t["backward_end_ms"]))
        backward = [
            ("backward compute", t["forward_end_ms"], compute_end),
            ("waiting for communication", compute_end, t["backward_end_ms"]),
        ]
    return [("forward", 0.0, t["forward_end_ms"]), *backward, ("optimizer", t["optimizer_start_ms"], t["step_ms"])]


def write_chrome_trace(path: Path, timelines: list[dict[str, Any]]) -> None:
    """Chrome trace (opens in Perfetto / chrome://tracing): one process per rank, a compute
    thread with the step phases and a communication thread with the buckets."""
    if not timelines:
        path.write_text(json.dumps({"traceEvents": []}))
        return
    origin = min([t["start_ns"] for t in timelines] + [m["start_ns"] for t in timelines for m in _micro(t)])
    events: list[dict[str, Any]] = []
    for rank in sorted({t["rank"] for t in timelines}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "communication"}})
    for t in timelines:
        base_us, rank = (t["start_ns"] - origin) / 1e3, t["rank"]
        events.append(_span(f"step {t['step']}", rank, 0, base_us, t["step_ms"] * 1e3, "step"))
        for name, start, end in _phases(t):
            events.append(_span(name, rank, 0, base_us + start * 1e3, max(0.0, end - start) * 1e3, "compute"))
        for m in _micro(t):  # the accumulation window's micro-batches before it: no communication
            start_us = (m["start_ns"] - origin) / 1e3
            events.append(_span("micro-batch (no communication)", rank, 0, start_us, m["end_ms"] * 1e3, "accumulation"))
        for b in t["buckets"]:
            args = {"bytes": b["bytes"], "wire_bytes": b["wire_bytes"], "num_params": b["num_params"]}
            duration_us = (b["done_ms"] - b["launch_ms"]) * 1e3
            events.append(
                _span(f"bucket {b['index']}", rank, 1, base_us + b["launch_ms"] * 1e3, duration_us, "comm", args=args)
            )
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _span(name: str, pid: int, tid: int, ts: float, dur: float, cat: str, **more: Any) -> dict[str, Any]:
    """A complete event ("X") of the Chrome trace, in microseconds; ``more``: any further fields."""
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "cat": cat, **more}


def _micro(t: dict[str, Any]) -> list[dict[str, Any]]:
    micro: list[dict[str, Any]] = t.get("micro_batches") or []
    return micro


MAX_RANKS_DRAWN = 8
"""The timeline draws at most this many ranks (evenly sampled, rank 0 and the last included)."""
MAX_BARS_PER_STEP = 120
"""Beyond this many buckets in a step, neighbouring buckets are drawn merged (first launch to last done)."""
MAX_LABELLED_BARS = 40


def _sample_ranks(ranks: list[int], limit: int) -> list[int]:
    if len(ranks) <= limit:
        return ranks
    picks = {ranks[round(i * (len(ranks) - 1) / (limit - 1))] for i in range(limit)}
    return sorted(picks)


def _bucket_bars(buckets: list[dict[str, Any]], limit: int) -> list[tuple[float, float, str]]:
    """(launch_ms, duration_ms, label) per bar: one per bucket, or ``limit`` groups of neighbours."""
    ordered = sorted(buckets, key=lambda b: b["index"])
    if len(ordered) <= limit:
        return [(b["launch_ms"], b["done_ms"] - b["launch_ms"], f"b{b['index']}") for b in ordered]
    bars = []
    size = -(-len(ordered) // limit)
    for start in range(0, len(ordered), size):
        group = ordered[start : start + size]
        launch, done = min(b["launch_ms"] for b in group), max(b["done_ms"] for b in group)
        bars.append((launch, done - launch, f"b{group[0]['index']}-{group[-1]['index']}"))
    return bars


def write_timeline_png(path: Path, timelines: list[dict[str, Any]], max_steps: int = 3) -> dict[str, Any]:
    """Per rank, a few steps: compute phases on one lane, buckets on the lanes below.

    Drawn in bounded time whatever the size: at most :data:`MAX_RANKS_DRAWN` ranks and
    :data:`MAX_BARS_PER_STEP` bars per step (neighbouring buckets merged beyond it), one
    drawing call per lane and step; the figure says what was sampled or merged. Returns
    what was drawn (ranks, bars per step, the note).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    all_ranks = sorted({t["rank"] for t in timelines})
    ranks = _sample_ranks(all_ranks, MAX_RANKS_DRAWN)
    fig, axes = plt.subplots(
        len(ranks) or 1, 1, figsize=(12, 1.9 + 1.5 * max(1, len(ranks))), squeeze=False, sharex=True
    )
    origin = min((t["start_ns"] for t in timelines), default=0)
    most_bars, most_buckets = 0, 0
    for axis, rank in zip(axes[:, 0], ranks or [0]):
        steps = [t for t in timelines if t["rank"] == rank][:max_steps]
        for t in steps:
            base = (t["start_ns"] - origin) / 1e6
            for name, start, end in _phases(t):
                axis.broken_barh([(base + start, max(0.0, end - start))], (10, 8), facecolors=PHASE_COLORS[name])
            bars = _bucket_bars(t["buckets"], MAX_BARS_PER_STEP)
            most_bars, most_buckets = max(most_bars, len(bars)), max(most_buckets, len(t["buckets"]))
            for lane, lane_bars in ((0, bars[0::2]), (-9, bars[1::2])):
                if lane_bars:
                    axis.broken_barh(
                        [(base + launch, duration) for launch, duration, _ in lane_bars],
                        (lane, 8),
                        facecolors="#DD8452",
                        edgecolors="black",
                        linewidth=0.4,
                    )
            if len(bars) <= MAX_LABELLED_BARS:
                for index, (launch, _, label) in enumerate(bars):
                    axis.text(base + launch, (0 if index % 2 == 0 else -9) + 4, label, va="center", fontsize=7)
        axis.set_yticks([14, 0, -5])
        axis.set_yticklabels(["compute", "comm", ""])
        axis.set_ylabel(f"rank {rank}")
        axis.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms since the first profiled step began")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in [*PHASE_COLORS.values(), "#DD8452"]]
    fig.legend(
        handles,
        [*PHASE_COLORS.keys(), "bucket all-reduce (launch -> done)"],
        loc="lower center",
        ncol=5,
        fontsize=8,
        frameon=False,
    )
    notes = []
    if len(ranks) < len(all_ranks):
        notes.append(f"{len(ranks)} of {len(all_ranks)} ranks shown")
    if most_buckets > most_bars:
        notes.append(f"up to {most_buckets} buckets per step drawn as {most_bars} bars of neighbouring buckets")
    note = "; ".join(notes)
    title = "Where each step's time goes, per rank: compute lane above, gradient buckets below"
    fig.suptitle(title + (f"\n({note})" if note else ""))
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"ranks": ranks, "bars_per_step": most_bars, "note": note}


def log_to_wandb(trainer: L.Trainer, profile: dict[str, Any], export_dir: Optional[Path]) -> None:
    """With a WandbLogger: the bucket table, the "what would help" table (when the profile has
    one) and, if written, the timeline image."""
    from lightning.pytorch.loggers import WandbLogger

    loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
    if not loggers:
        return
    import wandb  # only imported when a WandbLogger is in use

    columns: list[Union[str, int]] = list(BUCKET_COLUMNS)  # wandb's annotation allows int names too
    buckets = wandb.Table(columns=columns, data=[[b[c] for c in BUCKET_COLUMNS] for b in profile["buckets"]])
    payload: dict[str, Any] = {"comm/buckets": buckets}
    if profile.get("what_would_help"):
        from lightning_mgpu.callbacks.comm_profiler.advice import ADVICE_COLUMNS, advice_rows

        payload["comm/what_would_help"] = wandb.Table(
            columns=list(ADVICE_COLUMNS), data=advice_rows(profile["what_would_help"])
        )
    image = export_dir / "comm_timeline.png" if export_dir is not None else None
    if image is not None and image.exists():
        payload["comm/timeline"] = wandb.Image(str(image))
    for logger in loggers:
        logger.experiment.log(payload)
