"""``lightning-mgpu bench-comm``: the sweep's pieces (unit), one real 2-process run, and its errors.

The real run is not judged on speed (a benchmark never is in this suite): it checks the
table's shape, that every size was measured and summed correctly by gloo, and that the
JSON's numbers follow nccl-tests' definitions.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mgpu import cli
from lightning_mgpu._sizes import GiB, KiB, MiB, format_size, parse_size
from lightning_mgpu.cli.bench_comm import summary_line
from lightning_mgpu.comm import bus_factor
from lightning_mgpu.comm.allreduce_bench import (
    SweepSettings,
    count_wrong,
    fill_check_pattern,
    load_report,
    message_sizes,
    size_row,
    summarize_rows,
    time_iterations,
    timed_iterations,
    warmup_iterations,
)

from tests.conftest import cpu_env, run_python

# ---------------------------------------------------------------------------------------
# Units: sizes, the iteration rule, the correctness check, the clock, the rows
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4096", 4096), ("1KiB", KiB), ("1K", KiB), ("1k", KiB), ("256MiB", 256 * MiB), ("1GiB", GiB), ("64B", 64)],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["1MB", "1.5MiB", "-4", "MiB", "", "1 TiB"])
def test_parse_size_refuses_what_it_cannot_read_exactly(text: str) -> None:
    with pytest.raises(ValueError, match="KiB/MiB/GiB"):
        parse_size(text)


def test_format_size() -> None:
    assert [format_size(n) for n in (1000, KiB, 3 * KiB, 256 * MiB, 2 * GiB, 1536)] == [
        "1000 B",
        "1 KiB",
        "3 KiB",
        "256 MiB",
        "2 GiB",
        "1536 B",
    ]


def test_message_sizes() -> None:
    assert message_sizes(KiB, 256 * MiB, 2) == [KiB * 2**k for k in range(19)]
    assert message_sizes(KiB, MiB, 4) == [KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB]
    assert message_sizes(KiB, 3 * KiB, 2) == [KiB, 2 * KiB]  # max is an upper bound, not a size to add
    assert message_sizes(8, 8, 2) == [8]


def test_large_messages_get_fewer_iterations_by_the_documented_rule() -> None:
    defaults = SweepSettings(device="cpu")
    timed = {format_size(n): timed_iterations(n, defaults.iters) for n in defaults.sizes}
    warmup = {format_size(n): warmup_iterations(n, defaults.warmup) for n in defaults.sizes}
    assert all(timed[format_size(n)] == 20 for n in defaults.sizes if n <= 32 * MiB)
    assert (timed["64 MiB"], timed["128 MiB"], timed["256 MiB"]) == (16, 8, 5)
    assert all(warmup[format_size(n)] == 5 for n in defaults.sizes if n <= 32 * MiB)
    assert (warmup["64 MiB"], warmup["128 MiB"], warmup["256 MiB"]) == (4, 2, 1)
    # The bound that keeps the default CPU sweep short: at most 1 GiB timed per size,
    # except where the floor of 5 iterations takes over (256 MiB: 1.25 GiB).
    for nbytes in defaults.sizes:
        assert timed_iterations(nbytes, defaults.iters) * nbytes <= max(GiB, 5 * nbytes)
    # --iters / --warmup below the floor win.
    assert timed_iterations(256 * MiB, 3) == 3 and warmup_iterations(256 * MiB, 0) == 0


@pytest.mark.parametrize("count", [1, 250, 251, 252, 1000, 65536])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_check_pattern_sums_exactly_and_catches_wrong_elements(count: int, world_size: int) -> None:
    # What an all_reduce would leave: the sum of every rank's pattern.
    contributions = []
    for rank in range(world_size):
        buffer = torch.full((count,), float("nan"))
        fill_check_pattern(buffer, rank)
        assert not buffer.isnan().any() and buffer.min() >= 1 and buffer.max() <= 251
        contributions.append(buffer)
    reduced = torch.stack(contributions).sum(0)
    assert count_wrong(reduced, world_size) == 0

    if world_size > 1:  # ranks contribute differently (else a mixed-up rank would go unnoticed)
        assert not torch.equal(contributions[0], contributions[1])
    corrupted = reduced.clone()
    corrupted[count // 2] += 1
    assert count_wrong(corrupted, world_size) == 1
    assert count_wrong(reduced, world_size + 1) == count  # a rank's contribution missing: all wrong
    if count > 251:
        shifted = torch.roll(reduced, 1)  # right values, wrong places
        assert count_wrong(shifted, world_size) > 0


def test_time_iterations_on_cpu_reads_the_clock_between_calls() -> None:
    ticks = iter([1_000, 3_000, 3_500, 13_500])  # ns: 2 us, 0.5 us, 10 us
    calls = []
    seconds = time_iterations(lambda: calls.append(1), 3, device=torch.device("cpu"), clock=lambda: next(ticks))
    assert seconds == pytest.approx([2e-6, 0.5e-6, 10e-6])
    assert len(calls) == 3


def test_the_slowest_rank_decides_a_row() -> None:
    row = size_row(MiB, [0.001, 0.004, 0.002, 0.003], [0, 2, 0, 1], iters=20, warmup=5)
    assert row["time_us"] == pytest.approx(4000.0)  # rank 1's median, not the mean (2500)
    assert row["rank_time_us"] == pytest.approx([1000.0, 4000.0, 2000.0, 3000.0])
    assert row["algbw_gbps"] == pytest.approx(MiB / 0.004 / 1e9)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 1.5)  # 2 (4-1) / 4
    assert row["count"] == MiB // 4 and row["wrong"] == 3


def test_summary_names_the_peak_and_the_small_message_latency() -> None:
    rows = [size_row(n, [t, t / 2], [0, 0], iters=5, warmup=1) for n, t in ((KiB, 50e-6), (MiB, 1e-3), (4 * MiB, 8e-3))]
    summary = summarize_rows(rows)
    assert summary["peak_busbw_bytes"] == MiB and summary["latency_bytes"] == KiB
    assert summary["latency_us"] == pytest.approx(50.0) and summary["wrong_total"] == 0
    report = {"rows": rows, "world_size": 2, "duration_s": 1.0, **summary}
    assert summary_line(report) == (
        "peak busbw 1.05 GB/s at 1 MiB; small-message latency 50.0 µs (1 KiB); 0 wrong; 3 sizes in 1.0 s"
    )


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
    assert "small-message latency" in summary[0] and "0 wrong" in summary[0]
    # What the profiler will read back.
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(report))
    assert load_report(copy)["peak_busbw_gbps"] == report["peak_busbw_gbps"]


# ---------------------------------------------------------------------------------------
# Bad arguments: exit code 2, one error line naming the flag, no traceback
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--nproc", "0"], "argument --nproc"),
        (["--nproc", "two"], "argument --nproc"),
        (["--max-bytes", "512"], "--max-bytes (512 B) is smaller than --min-bytes (1 KiB)"),
        (["--min-bytes", "1MiB", "--max-bytes", "64KiB"], "--max-bytes (64 KiB) is smaller than --min-bytes (1 MiB)"),
        (["--max-bytes", "1MB"], "argument --max-bytes: cannot read '1MB'"),
        (["--min-bytes", "6"], "--min-bytes must be a positive multiple of 4"),
        (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
        (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs --device cuda"),
        (["--device", "tpu"], "argument --device: invalid choice"),
        (["--factor", "1"], "--factor must be an integer >= 2"),
        (["--iters", "0"], "--iters must be an integer >= 1"),
        (["--timeout", "0"], "--timeout must be > 0"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench-comm", *argv])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("lightning-mgpu bench-comm: error: ") and flag in last
    assert "Traceback" not in stderr


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


def test_help_states_the_defaults_the_sweep_uses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench-comm", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    defaults = SweepSettings(device="cpu")
    assert defaults.nproc == 2 and defaults.backend == "gloo"
    assert f"smallest message (default {format_size(defaults.min_bytes).replace(' ', '')})" in help_text
    assert f"largest message (default {format_size(defaults.max_bytes).replace(' ', '')})" in help_text
    assert f"(default {defaults.factor})" in help_text and f"(default {defaults.iters})" in help_text
    assert f"(default {defaults.warmup})" in help_text and f"(default {defaults.timeout_s:g})" in help_text
