"""CommProfiler on real processes over gloo: agreement with DDP's own timers, outputs, edge cases."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.helpers.comm_profiler import WARMUP, profile_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

DESIGN_SUMMARY_KEYS = {
    "steps",
    "step_ms",
    "forward_ms",
    "backward_compute_ms",
    "comm_ms",
    "exposed_comm_ms",
    "overlap_ratio",
    "bytes_per_step",
    "algbw_gbps",
    "busbw_gbps",
    "straggler_ms",
}
LOGGED = {
    "comm/step_ms",
    "comm/forward_ms",
    "comm/backward_compute_ms",
    "comm/comm_ms",
    "comm/exposed_ms",
    "comm/overlap_ratio",
    "comm/optimizer_ms",
    "comm/bytes_per_step",
    "comm/wire_bytes_per_step",
    "comm/algbw_gbps",
    "comm/busbw_gbps",
    "comm/straggler_ms",
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("profiled")
    result = profile_run(tmp, "--steps", "30", "--export-dir", str(tmp / "export"))
    result["export"] = tmp / "export"
    return result


def test_agrees_with_ddps_own_timers_within_15_percent(two_ranks: dict[str, Any]) -> None:
    """Same step, same rank: our stamps vs DDP's logging data (sample rate 1)."""
    pairs = two_ranks["pairs"]
    assert len(pairs) >= 20
    for key in ("backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time"):
        rel = [abs(p["ours"][key] / p["ddp"][key] - 1) for p in pairs if p["ddp"][key] > 0]
        assert len(rel) >= 20, key
        assert statistics.median(rel) < 0.15, (key, statistics.median(rel))


def test_bytes_per_step_are_the_gradient_bytes_exactly(two_ranks: dict[str, Any]) -> None:
    summary = two_ranks["summary"]
    assert summary["bytes_per_step"] == two_ranks["gradient_bytes"]
    assert summary["wire_bytes_per_step"] == two_ranks["gradient_bytes"]
    assert summary["compression_ratio"] == 1.0
    assert summary["steps"] == 30 - WARMUP
    assert summary["comm_ms"] > 0 and summary["busbw_gbps"] > 0
    assert 0.0 <= summary["overlap_ratio"] <= 1.0
    assert summary["exposed_comm_ms"] <= summary["comm_ms"]
    assert summary["busbw_gbps"] == pytest.approx(summary["algbw_gbps"])  # 2(n-1)/n = 1 for n = 2


def test_logs_documented_metrics_and_prints_a_summary(two_ranks: dict[str, Any]) -> None:
    assert LOGGED <= set(two_ranks["logged"])
    assert "CommProfiler: 2 rank(s), gloo on cpu" in two_ranks["stdout"]
    assert "exposed (step waits)" in two_ranks["stdout"]


def test_exports(two_ranks: dict[str, Any]) -> None:
    export: Path = two_ranks["export"]
    profile = json.loads((export / "comm_profile.json").read_text())
    assert profile["world_size"] == 2 and profile["backend"] == "gloo" and profile["device_type"] == "cpu"
    assert profile["nodes"] == 1  # two CPU ranks on one machine: whatif says their timings share cores
    assert any("shared its cores" in note for note in profile["what_would_help"]["notes"])
    assert DESIGN_SUMMARY_KEYS <= set(profile["summary"])
    assert set(profile["summary"]["step_ms"]) == {"median", "p90"}
    assert len(profile["steps"]) == 30 - WARMUP
    assert set(profile["steps"][0]) == {"step", "step_ms", "comm_ms", "exposed_comm_ms", "optimizer_step_ms"}
    assert profile["summary"]["accumulate_grad_batches"] == 1  # no accumulation: the step is the optimizer step
    assert profile["summary"]["optimizer_step_ms"]["median"] == pytest.approx(profile["summary"]["step_ms"]["median"])
    buckets = profile["buckets"]
    assert [b["index"] for b in buckets] == list(range(len(buckets))) and len(buckets) >= 2
    assert sum(b["bytes"] for b in buckets) == two_ranks["gradient_bytes"]
    assert all({"index", "bytes", "num_params", "duration_ms", "busbw_gbps"} <= set(b) for b in buckets)
    for b in buckets:  # launch and completion are measured from the start of backward
        assert 0 <= b["launch_ms"] <= b["done_ms"]
        assert b["duration_ms"] > 0 and b["algbw_gbps"] == pytest.approx(b["busbw_gbps"])  # n = 2
    # issue 28: the rows are one step of one rank (named in bucket_step), so they are in launch order and none
    # launches after that step's backward compute ended (rows from different steps gave 5.96 ms before 2.26 ms)
    launches = [b["launch_ms"] for b in buckets]
    assert launches == sorted(launches)
    kept = profile["bucket_step"]
    assert kept["rank"] in (0, 1) and kept["step"] in {s["step"] for s in profile["steps"]}
    assert launches[-1] <= kept["backward_compute_ms"] + 1e-6 and kept["first_launch_ms"] == pytest.approx(launches[0])
    with open(export / "comm_buckets.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["bytes"]) for r in rows] == [b["bytes"] for b in buckets]
    trace = json.loads((export / "comm_trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert any(e["name"].startswith("bucket ") for e in spans)
    assert any(e["name"] == "waiting for communication" for e in spans)
    assert all(e["dur"] >= 0 for e in spans)
    png = (export / "comm_timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_fp16_halves_the_wire_bytes_and_busbw_is_put_against_the_sweep(tmp_path: Path) -> None:
    sweep = REPO / "bench" / "results" / "bench_comm_cpu.json"
    result = profile_run(tmp_path, "--steps", "10", "--strategy", "ddp_tuned_fp16", "--sweep", str(sweep))
    summary = result["summary"]
    assert summary["bytes_per_step"] == result["gradient_bytes"]
    assert summary["wire_bytes_per_step"] == result["gradient_bytes"] // 2
    assert summary["compression_ratio"] == 2.0
    peak = json.loads(sweep.read_text())["peak_busbw_gbps"]
    assert summary["busbw_fraction"] == pytest.approx(summary["busbw_gbps"] / peak)


def test_windows_follow_the_schedule_and_agree_with_ddps_own_timers(tmp_path: Path) -> None:
    """5 profiled steps every 12: between windows DDP runs its built-in all-reduce (re-wrapped
    without the hook); each window skips the 2 settling steps of its new DDP wrapper."""
    result = profile_run(tmp_path, "--steps", "40", "--profile-steps", "5", "--profile-every", "12", "--every", "50")
    assert result["profiled_steps"] == [4, 5, 6, 7, 8, 15, 16, 17, 18, 19, 27, 28, 29, 30, 31, 39, 40]
    assert result["switches"] == [[8, False], [12, True], [19, False], [24, True], [31, False], [36, True]]
    # every new wrapper: builtin all-reduce out of a window, the timed hook in one
    assert result["wrappers"] == [
        [step, None if not on else "timed_averaging_allreduce"] for step, on in result["switches"]
    ]
    summary = result["summary"]
    assert summary["steps"] == 17 and summary["bytes_per_step"] == result["gradient_bytes"]
    assert summary["schedule"] == {"warmup_steps": WARMUP, "profile_steps": 5, "profile_every": 12}
    assert LOGGED <= set(result["logged"])  # logged at the end of each window (every_n_steps=50 never reached)
    pairs = result["pairs"]
    assert len(pairs) >= 8
    for key in ("backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time"):
        rel = [abs(p["ours"][key] / p["ddp"][key] - 1) for p in pairs if p["ddp"][key] > 0]
        assert statistics.median(rel) < 0.15, (key, statistics.median(rel))


def test_windows_with_a_compression_hook_pause_stamping_without_rewrapping(tmp_path: Path) -> None:
    """fp16's hook is Python anyway: it stays registered and only the profiler's stamping pauses."""
    flags = ("--steps", "20", "--strategy", "ddp_tuned_fp16", "--profile-steps", "3", "--profile-every", "8")
    result = profile_run(tmp_path, *flags)
    assert result["wrappers"] == []  # never re-wrapped
    assert result["switches"] == [[6, False], [8, True], [13, False], [16, True]]
    assert result["profiled_steps"] == [4, 5, 6, 11, 12, 13, 19, 20]
    assert result["summary"]["compression_ratio"] == 2.0


ACCUMULATE, ACCUMULATED_STEPS = 4, 14
PREDICTION_TOLERANCE = 0.25
"""How far an optimizer step figure may be from the one it is compared with (relative). Two gloo ranks
on this project's 2-core machine, shared with other work: one run's optimizer steps ranged from 48
to 329 ms around a median of 134, so the median of 11 steps moves by tens of percent between runs
(predicted 130 ms against 134 measured in that run). Without the micro-batches that do not
communicate the prediction misses by about (k - 1) / k of the compute: 64% in that run."""


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("accumulated")
    flags = ("--steps", str(ACCUMULATED_STEPS), "--accumulate", str(ACCUMULATE), "--export-dir", str(tmp / "export"))
    result = profile_run(tmp, *flags)
    result["export"] = tmp / "export"
    return result


def test_gradient_accumulation_profiles_only_synchronising_steps(accumulated: dict[str, Any]) -> None:
    result = accumulated
    assert result["global_step"] == ACCUMULATED_STEPS
    assert result["summary"]["steps"] == ACCUMULATED_STEPS - WARMUP  # one per optimizer step, not per batch
    assert result["summary"]["bytes_per_step"] == result["gradient_bytes"]


def test_with_accumulation_the_profile_and_whatif_are_about_the_whole_optimizer_step(
    accumulated: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 28: accumulate_grad_batches=4: the profile records the factor and the optimizer step's
    full time (rank 0's agrees with the optimizer step measured apart from the profiler, every
    micro-batch, on rank 0), and whatif's prediction for the system as profiled is that whole step,
    the slowest rank's as the profile's summary has it, not its synchronising micro-batch.

    Rank 0's clock is compared with the profile's rank 0 (comparing it with the slowest rank's figures
    failed on CI's loaded machine: 57.7 ms against 44.1, the ranks apart). whatif's replay is checked by
    what it is made of, not by its time against the run's: the whole step is the synchronising
    micro-batch's replay plus the window's other micro-batches as profiled, and it is nearer the
    optimizer step than the micro-batch. A timed comparison of the replay with the measured step (within
    25%) failed on CI's loaded machine (74.6 ms against 57.1): the replay adds up each phase's median,
    and under load the medians of the parts need not add up to the median of the whole."""
    from dataclasses import replace

    from lightning_mgpu.cli import main
    from lightning_mgpu.whatif import Scenario, System, link_from_profile, load_profile, predict

    path = accumulated["export"] / "comm_profile.json"
    summary = json.loads(path.read_text())["summary"]
    assert summary["accumulate_grad_batches"] == ACCUMULATE
    assert accumulated["rank0"]["micro_batches"] == ACCUMULATE  # every profiled window was whole
    full = summary["optimizer_step_ms"]
    assert full["median"] > summary["step_ms"]["median"] and full["p90"] >= full["median"]
    assert 0 < summary["accumulation_compute_ms"] <= summary["accumulation_ms"] < full["median"]
    measured_by_step = {int(step): ms for step, ms in accumulated["optimizer_steps_ms"].items()}
    measured = statistics.median(measured_by_step[step] for step in accumulated["profiled_steps"])
    rank0 = accumulated["rank0"]["optimizer_step_ms"]
    assert rank0 == pytest.approx(measured, rel=PREDICTION_TOLERANCE)
    assert full["median"] >= rank0  # the summary is the slowest rank's

    assert main(["whatif", str(path), "--json", "--costs", "none"]) == 0  # the system as profiled
    predicted = json.loads(capsys.readouterr().out)["predicted"]
    assert predicted["world_size"] == 2 and predicted["accumulate_grad_batches"] == ACCUMULATE
    run = load_profile(path)
    assert predicted["accumulation_ms"] == pytest.approx(run.accumulation_ms) and run.accumulation_ms > 0
    # the whole step: the synchronising micro-batch's replay plus the others as profiled (the replay of the
    # micro-batch alone is what whatif predicted before issue 28)
    system = System(nodes=run.world_size, inter=link_from_profile(run))
    whole = predict(run, Scenario(system=system))
    alone = replace(run, accumulate_grad_batches=1, accumulation_ms=0.0, accumulation_compute_ms=0.0)
    assert whole.step_ms == pytest.approx(predict(alone, Scenario(system=system)).step_ms + run.accumulation_ms)
    assert whole.micro_batches == ACCUMULATE
    # about the optimizer step, not the micro-batch: nearer the one than the other
    synchronising = summary["step_ms"]["median"]
    assert abs(predicted["step_ms"] - full["median"]) < abs(predicted["step_ms"] - synchronising)
    # the "what would help" block speaks of the same step
    block = json.loads(path.read_text())["what_would_help"]
    assert f"per optimizer step of {ACCUMULATE} micro-batches" in block["title"]


def test_world_size_one(tmp_path: Path) -> None:
    result = profile_run(tmp_path, "--steps", "8", "--devices", "1")
    summary = result["summary"]
    assert result["world_size"] == 1
    assert summary["steps"] == 8 - WARMUP
    assert summary["busbw_gbps"] == 0.0  # 2(n-1)/n = 0: nothing crosses a wire
    assert summary["straggler_ms"] == 0.0


def test_other_strategies_get_step_timings_and_a_clear_warning(tmp_path: Path) -> None:
    result = profile_run(tmp_path, "--steps", "8", "--devices", "1", "--strategy", "auto")
    summary = result["summary"]
    # issue 18: says what it cannot see, and reports it as not measured (null), no longer as 0.0
    assert "communication is not measured under SingleDeviceStrategy" in result["stdout"]
    assert summary["measures_comm"] is False
    assert summary["steps"] == 8 - WARMUP
    assert summary["step_ms"]["median"] > 0 and summary["comm_ms"] is None
    assert not {"comm/comm_ms", "comm/busbw_gbps"} & set(result["logged"])


def test_wandb_gets_the_bucket_table_and_the_timeline(tmp_path: Path) -> None:
    """Offline W&B run: the table and the image land in the run's media."""
    pytest.importorskip("wandb")
    result = profile_run(tmp_path, "--steps", "8", "--export-dir", str(tmp_path / "export"), "--wandb")
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/comm/buckets_*.table.json"))
    images = list(tmp_path.glob("wandb/offline-run-*/files/media/images/comm/timeline_*.png"))
    assert len(tables) == 1 and len(images) == 1, result["stdout"]
    table = json.loads(tables[0].read_text())
    assert table["columns"] == [
        "index",
        "bytes",
        "num_params",
        "launch_ms",
        "done_ms",
        "duration_ms",
        "algbw_gbps",
        "busbw_gbps",
    ]
    assert sum(row[1] for row in table["data"]) == result["gradient_bytes"]


def test_fitting_twice_registers_one_timed_hook_each_time(tmp_path: Path) -> None:
    """A second fit on the same trainer must not stack a second timer on the first (stale, leaking)."""
    result = profile_run(tmp_path, "--steps", "8", "--fits", "2")
    assert result["comm_hooks"] == ["timed_averaging_allreduce", "timed_averaging_allreduce"]
    assert result["global_step"] == 16
    assert result["summary"]["steps"] == 8 - WARMUP  # the second fit's own profile
    assert result["summary"]["bytes_per_step"] == result["gradient_bytes"]
