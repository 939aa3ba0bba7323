"""CommProfiler's exporters, in-process: a profile made by CommStats from synthetic steps is written
as comm_profile.json, comm_buckets.csv, comm_trace.json and comm_timeline.png."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_mgpu.callbacks.comm_profiler import report
from lightning_mgpu.callbacks.comm_profiler.stats import CommStats
from lightning_mgpu.comm.timing import BucketInterval, MicroBatch, StepTimeline


def _timeline(step: int, rank: int) -> StepTimeline:
    buckets = (
        BucketInterval(index=0, bytes=1000, wire_bytes=1000, num_params=1, launch_ms=4.0, done_ms=8.0),
        BucketInterval(index=1, bytes=3000, wire_bytes=3000, num_params=2, launch_ms=9.0, done_ms=12.0),
    )
    return StepTimeline(
        step=step,
        rank=rank,
        start_ns=step * 20_000_000,
        forward_end_ms=2.0,
        compute_end_ms=10.0,
        backward_end_ms=12.0,
        optimizer_start_ms=12.5,
        step_ms=14.0,
        buckets=buckets,
    )


def test_write_all_exports_every_file(tmp_path: Path) -> None:
    ranks = [CommStats(timeline_steps=2), CommStats(timeline_steps=2)]
    for rank, stats in enumerate(ranks):
        for step in range(1, 4):
            stats.add(_timeline(step, rank))
    gathered = [stats.local_report() for stats in ranks]
    profile = ranks[0].profile(gathered, world_size=2, backend="gloo", device_type="cpu", schedule={})
    assert profile is not None
    export = tmp_path / "export" / "nested"  # created on demand
    report.write_all(export, profile, CommStats.gathered_timelines(gathered))

    assert sorted(p.name for p in export.iterdir()) == sorted(report.EXPORTED_FILES)
    assert json.loads((export / "comm_profile.json").read_text()) == json.loads(json.dumps(profile))
    with open(export / "comm_buckets.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == report.BUCKET_COLUMNS
    assert [int(r["bytes"]) for r in rows] == [1000, 3000]
    trace = json.loads((export / "comm_trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert sum(e["name"] == "step 1" for e in spans) == 2  # one per rank; 2 timelines kept per rank
    waits = [e for e in spans if e["name"] == "waiting for communication"]
    assert waits and all(e["dur"] == 2000.0 for e in waits)  # 10 -> 12 ms, in us
    assert all(e["dur"] >= 0 for e in spans)
    assert (export / "comm_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_empty_trace_is_still_a_valid_trace(tmp_path: Path) -> None:
    report.write_chrome_trace(tmp_path / "trace.json", [])
    assert json.loads((tmp_path / "trace.json").read_text()) == {"traceEvents": []}


def _many_buckets(rank: int, step: int, count: int) -> dict[str, Any]:
    buckets = [
        {
            "index": i,
            "bytes": 4096,
            "wire_bytes": 4096,
            "num_params": 1,
            "launch_ms": 2.0 + i * 0.01,
            "done_ms": 2.5 + i * 0.01,
        }
        for i in range(count)
    ]  # fmt: skip  (one synthetic bucket per line)
    return {
        "step": step,
        "rank": rank,
        "start_ns": step * 50_000_000,
        "forward_end_ms": 1.0,
        "compute_end_ms": 2.0 + count * 0.01,
        "backward_end_ms": 3.0 + count * 0.01,
        "optimizer_start_ms": 3.5 + count * 0.01,
        "step_ms": 4.0 + count * 0.01,
        "buckets": buckets,
    }  # fmt: skip  (one timeline record)


def test_the_timeline_png_is_drawn_in_bounded_work_for_any_size(tmp_path: Path) -> None:
    """2 ranks x 2,000 buckets and 8+ ranks x 500 took minutes when every bucket was its own artist; the
    drawing is now bounded (ranks sampled, neighbouring buckets merged) and the figure says so."""
    big = [_many_buckets(rank, step, 2000) for rank in range(2) for step in range(3)]
    drawn = report.write_timeline_png(tmp_path / "big.png", big)
    assert drawn["bars_per_step"] <= report.MAX_BARS_PER_STEP and drawn["ranks"] == [0, 1]
    assert "2000 buckets per step drawn as" in drawn["note"]
    wide = [_many_buckets(rank, step, 500) for rank in range(12) for step in range(3)]
    drawn = report.write_timeline_png(tmp_path / "wide.png", wide)
    assert len(drawn["ranks"]) == report.MAX_RANKS_DRAWN and drawn["ranks"][0] == 0 and drawn["ranks"][-1] == 11
    assert drawn["note"].startswith(f"{report.MAX_RANKS_DRAWN} of 12 ranks shown")
    assert (tmp_path / "big.png").stat().st_size > 0 and (tmp_path / "wide.png").stat().st_size > 0
    small = report.write_timeline_png(tmp_path / "small.png", [_many_buckets(0, 1, 3)])
    assert small == {"ranks": [0], "bars_per_step": 3, "note": ""}  # nothing merged, nothing said


def test_an_unusable_export_dir_is_named_before_training(tmp_path: Path) -> None:
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    assert "is not a directory" in (report.export_dir_problem(a_file) or "")
    assert "cannot be written" in (report.export_dir_problem(a_file / "sub") or "")
    fresh = tmp_path / "new" / "profiles"
    assert report.export_dir_problem(fresh) is None and fresh.is_dir() and list(fresh.iterdir()) == []


def test_with_accumulation_the_summary_and_the_trace_show_the_whole_optimizer_step(tmp_path: Path, capsys: Any) -> None:
    """Issue 28: the synchronising micro-batch is not the optimizer step; both are shown, and the trace
    places the micro-batches that did not communicate before it."""
    window = tuple(
        MicroBatch(start_ns=-(3 - i) * 3_000_000, forward_end_ms=1.0, backward_end_ms=2.0, end_ms=2.5) for i in range(3)
    )
    stats = CommStats()
    for step in range(1, 4):
        stats.add(replace(_timeline(step, 0), micro_batches=window))
    gathered = [stats.local_report()]
    profile = stats.profile(
        gathered, world_size=1, backend="gloo", device_type="cpu", schedule={}, accumulate_grad_batches=4
    )
    assert profile is not None
    report.print_summary(profile)
    out = capsys.readouterr().out
    assert "optimizer step (4 micro-batches)" in out and "21.50 ms" in out  # 14 + 3 x 2.5
    assert "micro-batches without communication" in out and "synchronising micro-batch" in out
    assert "buckets of one step" in out  # and which (all alike here: the middle one)
    assert report.bucket_table_title(profile).startswith("buckets of one step (rank 0, step 2: its median")
    report.write_chrome_trace(tmp_path / "trace.json", CommStats.gathered_timelines(gathered))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    micro = [e for e in events if e["name"] == "micro-batch (no communication)"]
    assert len(micro) == 3 * 3 and all(e["dur"] == 2500.0 and e["ts"] >= 0 for e in micro)
