"""CommProfiler's exporters, in-process: a profile made by CommStats from synthetic steps is written
as comm_profile.json, comm_buckets.csv, comm_trace.json and comm_timeline.png."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from lightning_mgpu.callbacks.comm_profiler import report
from lightning_mgpu.callbacks.comm_profiler.stats import CommStats
from lightning_mgpu.comm.timing import BucketInterval, StepTimeline


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
