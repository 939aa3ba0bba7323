"""The benchmarks' harness (bench/harness/) in-process: its rounds, statistics and options.

The launcher, for real, is tested in tests/dist/harness/test_bench_harness.py.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from bench.harness import cli, interleave
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


def test_median_confidence_interval_uses_binomial_order_statistics() -> None:
    from bench.harness.stats import median_ci

    # Binomial(12, 1/2): P(X <= 2) = 79/4096 <= 0.025 < P(X <= 3): the 3rd and 10th values.
    assert median_ci(list(range(12))) == (2, 9)
    assert median_ci([5.0, 1.0, 3.0, 2.0, 4.0]) == (1.0, 5.0)  # n = 5 cannot reach 95%: the range
    assert median_ci(list(range(100)))[0] < 49.5 < median_ci(list(range(100)))[1]
    with pytest.raises(ValueError):
        median_ci([])
