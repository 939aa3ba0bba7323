"""``lightning-mgpu bench-comm`` in-process: the sweep's pieces, bad flags and the help text.

The real 2-process runs and their errors: tests/dist/cli/test_bench_comm.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_mgpu import cli
from lightning_mgpu._sizes import GiB, KiB, MiB, format_size, parse_size
from lightning_mgpu.cli.bench_comm import summary_line
from lightning_mgpu.comm.allreduce_bench import (
    SweepSettings,
    check_dtypes,
    check_period,
    count_wrong,
    fill_check_pattern,
    message_sizes,
    size_row,
    summarize_rows,
    time_iterations,
    timed_iterations,
    warmup_iterations,
)


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_pattern_sums_exactly_and_catches_wrong_elements(count: int, world_size: int, dtype: torch.dtype) -> None:
    # What an all_reduce would leave: the sum of every rank's pattern, summed in the type itself.
    period = check_period(dtype, world_size)
    contributions = []
    for rank in range(world_size):
        buffer = torch.full((count,), float("nan"), dtype=dtype)
        fill_check_pattern(buffer, rank, world_size)
        assert not buffer.isnan().any() and buffer.min() >= 1 and buffer.max() <= period
        contributions.append(buffer)
    reduced = contributions[0].clone()
    for contribution in contributions[1:]:
        reduced += contribution
    assert count_wrong(reduced, world_size) == 0

    if world_size > 1:  # ranks contribute differently (else a mixed-up rank would go unnoticed)
        assert not torch.equal(contributions[0], contributions[1])
    corrupted = reduced.clone()
    corrupted[count // 2] += 1
    assert count_wrong(corrupted, world_size) == 1
    if check_period(dtype, world_size + 1) == period:
        assert count_wrong(reduced, world_size + 1) == count  # a rank's contribution missing: all wrong
    if count > period:
        shifted = torch.roll(reduced, 1)  # right values, wrong places
        assert count_wrong(shifted, world_size) > 0


def test_the_check_period_keeps_every_sum_exact_in_its_type() -> None:
    # float32 holds 2^24 exactly: 251 for any world a test could start; 16 bits hold far less.
    assert check_period(torch.float32, 1024) == 251
    assert check_period(torch.float16, 2) == 251 and check_period(torch.float16, 16) == 127  # 2048 // 16 = 128
    assert check_period(torch.bfloat16, 2) == 127 and check_period(torch.bfloat16, 8) == 31  # 256 // 8 = 32
    assert check_period(torch.bfloat16, 256) == 1
    for dtype, exact in ((torch.float16, 2048), (torch.bfloat16, 256)):
        for world_size in (2, 3, 7, 64):
            assert check_period(dtype, world_size) * world_size <= exact
    with pytest.raises(ValueError, match="bfloat16 holds integers exactly only up to 256"):
        check_period(torch.bfloat16, 257)


def test_a_dtype_too_narrow_for_the_checks_sums_over_the_ranks_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="--dtype bfloat16 with --nproc 300: bfloat16 holds integers exactly only"):
        SweepSettings(device="cpu", nproc=300, dtypes="float32,bfloat16")
    assert SweepSettings(device="cpu", nproc=256, dtypes="bfloat16").dtypes == ("bfloat16",)


def test_dtypes_are_checked_and_float32_comes_first() -> None:
    assert check_dtypes("float16,float32") == ("float32", "float16")
    assert check_dtypes(["bfloat16"]) == ("bfloat16",)
    assert SweepSettings(device="cpu", dtypes="float16, float32").dtypes == ("float32", "float16")
    for bad, match in (("float64", "--dtype must name"), ("float16,float16", "twice"), ("", "--dtype must name")):
        with pytest.raises(ValueError, match=match):
            check_dtypes(bad)


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


def test_a_row_keeps_the_busiest_ranks_cpu_time_per_all_reduce() -> None:
    row = size_row(MiB, [0.001, 0.002], [0, 0], iters=5, warmup=1, rank_cpu_seconds=[0.0015, 0.0005])
    assert row["cpu_us"] == pytest.approx(1500.0)
    assert "cpu_us" not in size_row(MiB, [0.001], [0], iters=5, warmup=1)


def test_summary_names_the_peak_and_the_small_message_latency() -> None:
    rows = [size_row(n, [t, t / 2], [0, 0], iters=5, warmup=1) for n, t in ((KiB, 50e-6), (MiB, 1e-3), (4 * MiB, 8e-3))]
    summary = summarize_rows(rows)
    assert summary["peak_busbw_bytes"] == MiB and summary["latency_bytes"] == KiB
    assert summary["latency_us"] == pytest.approx(50.0) and summary["wrong_total"] == 0
    report = {"rows": rows, "world_size": 2, "duration_s": 1.0, **summary}
    assert summary_line(report) == (
        "peak busbw 1.05 GB/s at 1 MiB; small-message latency 50.0 µs (1 KiB); 0 wrong; 3 sizes in 1.0 s"
    )
    halves = [size_row(n, [t, t], [0, 0], iters=5, warmup=1, dtype="float16") for n, t in ((KiB, 80e-6), (MiB, 2e-3))]
    report["other_dtypes"] = {"float16": {"rows": halves, **summarize_rows(halves)}}
    assert halves[1]["count"] == MiB // 2
    assert summary_line(report) == (
        "peak busbw 1.05 GB/s at 1 MiB; small-message latency 50.0 µs (1 KiB); "
        "float16: peak busbw 0.52 GB/s at 1 MiB; small-message latency 80.0 µs (1 KiB); 0 wrong; 5 sizes in 1.0 s"
    )


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
