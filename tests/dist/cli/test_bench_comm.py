"""``lightning-mgpu bench-comm`` for real: one 2-process run, and its errors.

The real run is not judged on speed (a benchmark never is in this suite): it checks the
table's shape, that every size was measured and summed correctly by gloo, and that the
JSON's numbers follow nccl-tests' definitions. The sweep's pieces, in-process:
tests/unit/cli/test_bench_comm.py.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mgpu._sizes import KiB, MiB, format_size
from lightning_mgpu.comm import bus_factor
from lightning_mgpu.comm.allreduce_bench import load_report
from tests.conftest import cpu_env, run_python


# ---------------------------------------------------------------------------------------
# One real run: 2 gloo processes, 1 KiB .. 1 MiB
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    workdir = tmp_path_factory.mktemp("bench_comm")
    out = workdir / "nested" / "bench_comm.json"
    proc = run_python(
        [
            "-m",
            "lightning_mgpu.cli",
            "bench-comm",
            "--nproc",
            "2",
            "--max-bytes",
            "1MiB",
            "--iters",
            "3",
            "--dtype",
            "float16,float32",
            "--json",
            str(out),
        ],
        cwd=workdir,
        timeout=90,
        env=cpu_env(),
    )
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_cli_run_measures_every_size_and_gloo_sums_correctly(cli_run: tuple[dict[str, Any], str]) -> None:
    report, _ = cli_run
    rows = report["rows"]
    assert [row["bytes"] for row in rows] == [KiB * 2**k for k in range(11)]  # 1 KiB .. 1 MiB, increasing
    for row in rows:
        assert row["count"] == row["bytes"] // 4
        assert row["iters"] == 3 and row["warmup"] == 5
        assert row["time_us"] > 0 and len(row["rank_time_us"]) == 2
        assert all(t > 0 for t in row["rank_time_us"])
        assert row["time_us"] == max(row["rank_time_us"])
        assert row["wrong"] == 0
    assert report["wrong_total"] == 0
    # --dtype: float32 at the top level whatever the order named, float16's sweep beside it, summed as exactly
    assert report["dtype"] == "float32" and report["settings"]["dtypes"] == ["float32", "float16"]
    halves = report["other_dtypes"]["float16"]["rows"]
    assert [row["bytes"] for row in halves] == [row["bytes"] for row in rows]
    assert all(row["count"] == row["bytes"] // 2 and row["wrong"] == 0 and row["time_us"] > 0 for row in halves)
    assert report["other_dtypes"]["float16"]["peak_busbw_gbps"] == max(row["busbw_gbps"] for row in halves)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_cli_json_follows_nccl_tests_definitions(cli_run: tuple[dict[str, Any], str]) -> None:
    report, _ = cli_run
    n = report["world_size"]
    assert n == 2 and report["backend"] == "gloo" and report["device_type"] == "cpu"
    assert report["bus_factor"] == pytest.approx(2 * (n - 1) / n) == bus_factor("all_reduce", n)
    for row in report["rows"]:
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (n - 1) / n)
    peak = max(report["rows"], key=lambda row: row["busbw_gbps"])
    assert report["peak_busbw_gbps"] == peak["busbw_gbps"] and report["peak_busbw_bytes"] == peak["bytes"]
    assert report["latency_us"] == report["rows"][0]["time_us"] and report["latency_bytes"] == KiB
    assert report["machine"]["torch"] == torch.__version__
    assert report["settings"]["timing"] == "host_clock" and report["settings"]["iters"] == 3
    assert report["settings"]["max_bytes"] == MiB and report["duration_s"] > 0
    assert report["schema_version"] == 1 and report["collective"] == "all_reduce"
    # its own ranks on this host's loopback, and the file says so (whatif refuses it as a link between nodes)
    assert (report["launcher"], report["nodes"], report["ranks_per_node"]) == ("bench-comm", 1, [2])
    assert report["hosts"][0]["address"] == "127.0.0.1" and report["hosts"][0]["ranks"] == [0, 1]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_cli_prints_the_table_and_a_summary_line(cli_run: tuple[dict[str, Any], str], tmp_path: Path) -> None:
    report, stdout = cli_run
    for header in ("size", "count", "time (µs)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"):
        assert header in stdout
    assert "1 KiB" in stdout and "1 MiB" in stdout
    summary = [line for line in stdout.splitlines() if line.startswith("peak busbw")]
    assert len(summary) == 1
    assert f"at {format_size(report['peak_busbw_bytes'])};" in summary[0]
    assert "small-message latency" in summary[0] and "0 wrong" in summary[0] and "; float16: peak busbw" in summary[0]
    assert "all_reduce (float32, sum, in place)" in stdout and "all_reduce (float16, sum, in place)" in stdout
    # What the profiler will read back.
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(report))
    assert load_report(copy)["peak_busbw_gbps"] == report["peak_busbw_gbps"]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_bad_argument_from_the_console_has_no_traceback(tmp_path: Path) -> None:
    proc = run_python(
        ["-m", "lightning_mgpu.cli", "bench-comm", "--max-bytes", "512"], cwd=tmp_path, timeout=60, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--max-bytes (512 B) is smaller than --min-bytes (1 KiB)")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# ---------------------------------------------------------------------------------------
# Never hang: a deadline, and a dead worker named
# ---------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_timeout_stops_every_worker_and_says_so(tmp_path: Path) -> None:
    # The default sweep (1 KiB .. 256 MiB) takes far longer than 2 s, process start alone about that.
    proc = run_python(
        ["-m", "lightning_mgpu.cli", "bench-comm", "--nproc", "2", "--timeout", "2", "--quiet"],
        cwd=tmp_path,
        timeout=45,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lightning-mgpu bench-comm: error: did not finish within --timeout 2 s; stopped rank(s)")
    assert "Traceback" not in proc.stderr


DYING_WORKERS = """
    import os
    import time

    from lightning_mgpu.comm.allreduce_run import BenchCommError, launch_workers


    def exit_on_rank_1(rank):
        if rank == 1:
            os._exit(3)  # like the OOM killer: no Python error, no traceback
        time.sleep(120)  # rank 0 would wait for rank 1 forever


    def raise_on_rank_0(rank):
        if rank == 0:
            raise RuntimeError("boom on rank 0")
        time.sleep(120)


    if __name__ == "__main__":
        for worker in (exit_on_rank_1, raise_on_rank_0):
            started = time.monotonic()
            try:
                launch_workers(worker, (), nproc=2, timeout_s=100, grace_s=2)
            except BenchCommError as exc:
                print(f"{worker.__name__}|{exc}|{exc.details.strip().splitlines()[-1:]}|{time.monotonic() - started:.1f}")
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_dead_worker_stops_the_run_and_is_named(tmp_path: Path) -> None:
    script = tmp_path / "dying_workers.py"
    script.write_text(textwrap.dedent(DYING_WORKERS))
    proc = run_python([str(script)], cwd=tmp_path, timeout=80)
    results = {line.split("|")[0]: line.split("|") for line in proc.stdout.splitlines() if "|" in line}
    assert set(results) == {"exit_on_rank_1", "raise_on_rank_0"}, proc.stdout + proc.stderr

    # Stopped because rank 1 died, not by the 100 s deadline nor after rank 0's 120 s sleep: either of
    # those would outlast this test's 90 s ceiling (no wall-clock assertion needed).
    _, message, details, _ = results["exit_on_rank_1"]
    assert message.startswith("rank 1 (pid ") and "exited with code 3 without a Python error" in message

    _, message, details, _ = results["raise_on_rank_0"]
    assert message.startswith("rank 0 (pid ") and message.endswith("failed: RuntimeError: boom on rank 0")
    assert "boom on rank 0" in details
