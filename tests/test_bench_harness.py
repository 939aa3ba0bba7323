"""The benchmarks' harness (bench/harness/): its rounds, statistics and options in-process, and the launcher for real.

The launcher is what every benchmark starts its ranks with: a launch that passes its timeout
or has a failing node must end every rank it started (whole process groups, not only
torchrun) and stop the benchmark with the end of the output, never leave ranks behind.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from bench.harness import cli, interleave, launch
from bench.harness.stats import paired_ratios, summarize


def test_rounds_interleave_by_the_packages_rule() -> None:
    abba = [config for _, _, config in interleave.schedule(("A", "B"), 2)]
    assert abba == ["A", "B", "B", "A"]
    rotated = interleave.schedule(("A", "B", "C"), 2, scheme="rotate")
    assert rotated == [(0, 0, "A"), (0, 1, "B"), (0, 2, "C"), (1, 0, "B"), (1, 1, "C"), (1, 2, "A")]
    warm_up_first = interleave.schedule(("A", "B"), 2, first=-1)  # round -1 (dropped) reversed, then A B
    assert [(r, c) for r, _, c in warm_up_first] == [(-1, "B"), (-1, "A"), (0, "A"), (0, "B")]


def test_one_p90_and_ratios_paired_within_a_round() -> None:
    stats = summarize([float(v) for v in range(1, 11)])
    assert stats["median"] == 5.5 and stats["p90"] == 9.0 and stats["n"] == 10  # p90 by nearest rank
    runs = [
        {"config": "with", "round": 1, "ms": 12.0},
        {"config": "without", "round": 1, "ms": 10.0},
        {"config": "without", "round": 0, "ms": 20.0},
        {"config": "with", "round": 0, "ms": 21.0},
    ]
    assert paired_ratios(runs, "with", "without", lambda run: run["ms"]) == [1.05, 1.2]


def test_quick_sets_smoke_values_except_those_given_and_counts_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    def parser() -> argparse.ArgumentParser:
        made = cli.parser("A benchmark.\n\nMore.")
        made.add_argument("--steps", type=int, default=100)
        made.add_argument("--rounds", type=int, default=5)
        cli.add_launch_options(made, out=Path("x.json"), quick={"steps": 3, "rounds": 1}, timeout=60)
        return made

    quick = {"steps": 3, "rounds": 1}
    args = cli.finish(parser(), ["--quick", "--steps", "7", "--nproc", "4"], quick, positive=("steps", "nproc"))
    assert (args.steps, args.rounds, args.nproc) == (7, 1, 4) and args.threads == max(1, (os.cpu_count() or 1) // 4)
    with pytest.raises(SystemExit):
        cli.finish(parser(), ["--nproc", "0"], quick, positive=("nproc",))
    assert "argument --nproc: must be >= 1, got 0" in capsys.readouterr().err


SLEEPER = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
if sys.argv[2] == "fail" and os.environ["RANK"] == "1":
    print("rank 1 gives up", flush=True)
    sys.exit(3)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie not yet reaped by its (killed) parent has ended too
        return stat.read().split(") ")[-1].startswith("Z")


def _pids(where: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(where.glob("rank*.pid"))]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["timeout", "fail"])
def test_a_launch_past_its_timeout_or_with_a_failed_rank_ends_every_rank(tmp_path: Path, how: str) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    started = time.monotonic()
    runs = launch.run(
        [str(script), str(tmp_path), how], nproc_per_node=2, timeout=25 if how == "timeout" else 60, log_dir=tmp_path
    )
    assert time.monotonic() - started < 55
    assert len(_pids(tmp_path)) == 2, runs[0].output  # both ranks had started
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in _pids(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in _pids(tmp_path)), "a rank outlived its launch"
    with pytest.raises(launch.LaunchFailed) as failed:
        launch.check(runs, "sleepers", timeout=25)
    message = str(failed.value)
    if how == "timeout":
        assert runs[0].timed_out and "sleepers: launch timed out after 25 s" in message
    else:
        assert not runs[0].timed_out and "sleepers: launch failed" in message and "exit code 1" in message
        assert "rank 1 gives up" in runs[0].output
