"""CommProfiler changes no gradient, under every DDP option users set (issue 28).

One torchrun launch of ``tests/scripts/exactness_matrix.py`` (2 gloo ranks) fits a small MLP under
``static_graph`` x ``gradient_as_bucket_view`` x ``find_unused_parameters`` x ``accumulate_grad_batches``
(1, 3) x compression (none, fp16), with ``ddp_tuned`` and stock ``ddp``, three times each: without
the profiler, with its default schedule and with a windowed one (its hook in and out, ``ddp_tuned``
re-wrapping DDP at every switch); then ``bucket_cap_mb="auto"`` with and without the windowed
profiler. Every optimizer step's all-reduced gradient is compared with the unprofiled run's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import REPO, TORCHRUN_2, run_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

TOLERANCE = 1e-6  # relative to the step's largest gradient, where a different (but averaging) hook runs


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("matrix") / "rows.json"
    run_python([*TORCHRUN_2, "-m", "tests.scripts.exactness_matrix", "--out", str(out)], cwd=REPO, timeout=840)
    result: list[dict[str, Any]] = json.loads(out.read_text())
    return result


def _name(row: dict[str, Any]) -> str:
    keys = ("strategy", "static_graph", "gradient_as_bucket_view", "find_unused_parameters")
    keys += ("accumulate_grad_batches", "compression", "bucket_cap_mb", "profiler")
    return " ".join(f"{key}={row[key]}" for key in keys if key in row)


def test_the_matrix_is_complete(rows: list[dict[str, Any]]) -> None:
    grid = [r for r in rows if "bucket_cap_mb" not in r]
    assert len(grid) == 2 * 2**5 * 2  # strategies x 5 binary options x 2 profiler schedules
    assert len(rows) - len(grid) == 2  # bucket_cap_mb="auto", without and with fp16
    windowed = [r for r in rows if r["profiler"] == "windowed" and not r["error"]]
    # the windowed schedule really takes the hook out and puts it back (else it would test nothing)
    assert all(len(r["switches"]) >= 3 for r in windowed), [_name(r) for r in windowed if len(r["switches"]) < 3]


def test_ddp_tuned_gradients_are_those_of_the_run_without_the_profiler(rows: list[dict[str, Any]]) -> None:
    tuned = [r for r in rows if r["strategy"] == "ddp_tuned" and "bucket_cap_mb" not in r]
    failed = [
        f"{_name(r)}: {r['error'] or r['error_unprofiled']}" for r in tuned if r["error"] or r["error_unprofiled"]
    ]
    assert not failed, failed
    # the same hook runs with and without the profiler (fp16's): bitwise
    same_hook = [r for r in tuned if r["compression"] == "fp16"]
    assert [(_name(r), r["max_abs"]) for r in same_hook if r["max_abs"] != 0.0] == []
    # DDP's built-in all-reduce against the profiler's averaging hook
    assert [(_name(r), r["max_rel"]) for r in tuned if r["max_rel"] > TOLERANCE] == []
    assert all(r["steps"] == 10 for r in tuned)


def test_ddp_tuned_static_graph_trains_as_without_it_even_when_accumulating(rows: list[dict[str, Any]]) -> None:
    """torch's DDP refuses a static graph's first backward under ``no_sync`` (stock Lightning crashes with
    ``accumulate_grad_batches > 1``); ``ddp_tuned`` synchronises that backward and gets DDP's average."""
    static = [r for r in rows if r["strategy"] == "ddp_tuned" and r.get("static_graph") and r["compression"] is None]
    assert len(static) == 16
    assert [(_name(r), r["vs_dynamic"]) for r in static if not r["vs_dynamic"]["max_rel"] <= TOLERANCE] == []


def test_stock_ddp_gradients_are_those_of_the_run_without_the_profiler(rows: list[dict[str, Any]]) -> None:
    stock = [r for r in rows if r["strategy"] == "ddp"]
    # The profiler never changes the outcome: where stock DDP fails, it fails the same way without the profiler
    # (torch 2.13: static_graph with accumulate_grad_batches > 1, see docs/strategies.md).
    assert [(_name(r), r["error"], r["error_unprofiled"]) for r in stock if r["error"] != r["error_unprofiled"]] == []
    trained = [r for r in stock if not r["error"]]
    assert len(trained) >= 48
    assert [(_name(r), r["max_rel"]) for r in trained if r["max_rel"] > TOLERANCE] == []
    assert all(r["steps"] == 10 for r in trained)


def test_the_tuners_rewraps_change_no_gradient_under_the_profiler(rows: list[dict[str, Any]]) -> None:
    auto = [r for r in rows if r.get("bucket_cap_mb") == "auto"]
    for row in auto:
        assert row["error"] == row["error_unprofiled"] == "", _name(row)
        assert row["tuning_status"] == {"none": "done", "windowed": "done"}, row["tuning_status"]
        # it re-wrapped DDP (a new bucket size) at the same steps with and without the profiler
        assert row["tuner_rewraps"]["none"] == row["tuner_rewraps"]["windowed"] != []
        assert row["max_abs"] == 0.0 and row["steps"] == 60, row
