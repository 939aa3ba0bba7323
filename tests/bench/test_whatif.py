"""``python -m bench.whatif --quick`` runs end to end on the network lab, and ``--repredict`` on its result.

Not a timing test (the suite never judges a benchmark's numbers): it checks that every
validation has its predictions beside measurements, that re-bucketed layouts are the ones DDP
built, that the inputs needed to predict again are kept, and that the figure is drawn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.labs.network import lab_unavailable
from tests.conftest import REPO, run_python

pytestmark = pytest.mark.bench


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_whatif_quick_run_and_repredict(tmp_path: Path) -> None:
    reason = lab_unavailable()
    if reason is not None:
        pytest.skip(f"the network lab cannot be built here: {reason}")
    out = tmp_path / "whatif.json"
    run_python(["-m", "bench.whatif", "--quick", "--out", str(out)], cwd=REPO, timeout=880)
    report = json.loads(out.read_text())
    assert report["settings"]["quick"] and report["settings"]["models"] == ["mlp"]
    assert 0 < report["links"]["1"]["gbps"] <= 1.05  # the lab's 1 Gbit/s, as its raw TCP transfer achieved it
    configs = {"default", "4 MiB", "fp16", "powersgd r1"}
    assert {row["config"] for row in report["validations"]["loopback_profile"]} == configs
    assert {row["config"] for row in report["validations"]["profile_at_1gbps"]} == configs - {"default"}
    # the documented route (a 1-rank profile + the link) on what issue 31 item 5 names: default buckets and fp16
    routes = ("one_rank_plus_bench_comm", "one_rank_plus_achieved_rate", "one_rank_plus_nominal_rate")
    for route in (*routes, "one_rank_beside_plus_bench_comm"):
        assert [row["config"] for row in report["validations"][route]] == ["default", "fp16"], route
    # bench-comm across the lab swept float16 beside float32, and each beside compute
    sweep = report["bench_comm"]["1"]
    assert sweep["nodes"] == 2 and set(sweep["other_dtypes"]) == {"float16"}
    for row in [*sweep["rows"], *sweep["other_dtypes"]["float16"]["rows"]]:
        assert row["beside_time_us"] > 0 and 0 < row["beside_compute_share"], row
    assert set(report["inputs"]["loopback_1_beside"]["mlp"]) == {"profile", "gradients"}
    for rows in report["validations"].values():
        for row in rows:
            assert row["predicted_ms"] > 0 and row["measured_ms"] > 0
            assert row["layout_matches"], row  # the 4 MiB layout predicted is the one DDP built
    assert out.with_suffix(".png").stat().st_size > 1000
    assert set(report["inputs"]["loopback_2"]["mlp"]) == {"profile", "gradients"}

    again = tmp_path / "again.json"
    run_python(
        ["-m", "bench.whatif", "--repredict", str(out), "--host-overlap", "0", "--out", str(again)],
        cwd=REPO,
        timeout=120,
    )
    repredicted = json.loads(again.read_text())
    assert repredicted["settings"]["host_overlap"] == 0
    before = {r["config"]: r["measured_ms"] for r in report["validations"]["loopback_profile"]}
    assert {r["config"]: r["measured_ms"] for r in repredicted["validations"]["loopback_profile"]} == before
