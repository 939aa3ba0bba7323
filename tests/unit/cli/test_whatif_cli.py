"""``lightning-mgpu whatif`` in-process (flags, table, ``--json``, sweep PNG, errors) and the compression
costs measured with torch. That the command imports no torch when it does not measure is checked in a
fresh interpreter: tests/dist/cli/test_whatif_cli.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from lightning_mgpu.cli import main
from lightning_mgpu.whatif import load_profile
from lightning_mgpu.whatif.compression import plan_bucket
from lightning_mgpu.whatif.measure import measure_costs
from lightning_mgpu.whatif.records import Gradient
from tests.helpers.whatif import MLP_BUCKETS, mlp_profile
from tests.conftest import REPO
from tests.helpers import cli

profile = cli.profile  # a fixture, shared with tests/dist/cli/test_whatif_cli.py


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["whatif", *argv, "--json", "--costs", "none"]) == 0
    document: dict[str, Any] = json.loads(capsys.readouterr().out)
    return document


def test_json_has_the_predicted_step_inputs_and_levers(profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, str(profile), "--world-size", "2", "--link-gbps", "1")
    predicted = document["predicted"]
    assert {"step_ms", "comm_ms", "exposed_comm_ms", "speedup", "efficiency"} <= set(predicted)
    assert (
        predicted["world_size"] == 2 and predicted["step_ms"] > 55.0
    )  # 33 MiB over 1 Gbit/s: far slower than loopback
    assert predicted["efficiency"] == pytest.approx(predicted["speedup"] / 2)
    inputs = document["inputs"]
    assert inputs["profile"]["world_size"] == 2 and inputs["system"]["inter"]["name"] == "1 Gbit/s"
    assert inputs["system"]["host"]["name"] == "as profiled"  # CPU profile: the host's own cost is added
    assert document["levers"] and all("sentence" in lever for lever in document["levers"])


def test_flags_reach_the_scenario(profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = run_json(capsys, str(profile), "--link", "1gbe")["predicted"]
    fp16 = run_json(capsys, str(profile), "--link", "1gbe", "--compression", "fp16")["predicted"]
    assert fp16["wire_bytes_per_step"] == base["wire_bytes_per_step"] // 2 and fp16["step_ms"] < base["step_ms"]
    small = run_json(capsys, str(profile), "--link", "1gbe", "--bucket-cap-mb", "4")["predicted"]
    assert len(small["buckets"]) > len(base["buckets"])
    faster = run_json(capsys, str(profile), "--link", "1gbe", "--compute-scale", "0.5")["predicted"]
    assert faster["forward_ms"] == pytest.approx(base["forward_ms"] / 2)
    host_only = run_json(capsys, str(profile), "--link", "loopback")["predicted"]["buckets"]
    assert all(b["done_ms"] > b["start_ms"] for b in host_only)  # no wire: the host's own cost remains
    free = run_json(capsys, str(profile), "--link", "loopback", "--no-host")["predicted"]["buckets"]
    assert all(b["done_ms"] == b["start_ms"] for b in free)
    in_series = run_json(capsys, str(profile), "--link", "1gbe", "--host-overlap", "0")["predicted"]
    assert in_series["comm_ms"] > base["comm_ms"]
    nodes = run_json(capsys, str(profile), "--nodes", "2", "--devices-per-node", "4", "--link", "10gbe")
    assert nodes["predicted"]["world_size"] == 8 and nodes["inputs"]["system"]["intra"]["name"] == "loopback"


def test_a_profile_taken_with_fp16_is_predicted_with_it_unless_told_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = mlp_profile()
    document["summary"]["compression_ratio"] = 2.0
    path = tmp_path / "comm_profile.json"
    path.write_text(json.dumps(document))
    as_profiled = run_json(capsys, str(path), "--link", "1gbe")
    assert as_profiled["inputs"]["compression"] == "fp16"
    without = run_json(capsys, str(path), "--link", "1gbe", "--compression", "none")
    assert without["inputs"]["compression"] is None
    assert without["predicted"]["wire_bytes_per_step"] == 2 * as_profiled["predicted"]["wire_bytes_per_step"]


def test_sweep_prints_the_curve_and_writes_a_png(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "curve.png"
    assert (
        main(
            [
                "whatif",
                str(profile),
                "--world-size",
                "1,2,4,8,16",
                "--link",
                "10gbe",
                "--costs",
                "none",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert png.stat().st_size > 1000 and f"wrote {png}" in out
    assert "levers at 16 rank(s)" in out and "speed-up" in out
    document = run_json(capsys, str(profile), "--world-size", "1,2,4", "--link", "10gbe", "--plot", str(png))
    assert [p["world_size"] for p in document["sweep"]] == [1, 2, 4]
    assert document["sweep"][0]["speedup"] == pytest.approx(1.0) and document["predicted"]["world_size"] == 4


def test_list_links_names_every_preset_with_its_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", "--list-links", "--json"]) == 0
    links = json.loads(capsys.readouterr().out)
    assert {"1gbe", "10gbe", "25gbe", "100gbe", "ib-hdr", "pcie4-x16", "nvlink3", "nvlink4"} <= {
        l["name"] for l in links
    }
    assert all(link["source"] for link in links)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "0"], "expected an integer >= 1"),
        (["--link", "1gbe", "--link-gbps", "1"], "not allowed with argument"),
        (["--link-gbps", "-3"], "expected a number > 0"),
        (["--world-size", "2", "--nodes", "2"], "not allowed with argument"),
        (["--devices-per-node", "2"], "--devices-per-node needs --nodes N"),
    ],
)
def test_bad_flags_get_one_error_line(
    profile: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["whatif", str(profile), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_one_rank_profile_needs_a_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "one.json"
    path.write_text(json.dumps(mlp_profile(world_size=1)))
    with pytest.raises(SystemExit):
        main(["whatif", str(path), "--world-size", "2", "--costs", "none"])
    assert "profiled on one rank, so it measured no link" in capsys.readouterr().err
    document = run_json(capsys, str(path), "--world-size", "2", "--link", "10gbe")
    assert document["predicted"]["world_size"] == 2


def test_an_unreadable_profile_is_an_error_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.json"
    path.write_text("[]")
    assert main(["whatif", str(path), "--costs", "none"]) == 2
    assert "no 'summary' object" in capsys.readouterr().err


def test_measured_costs_cover_every_compressed_shape_and_feed_the_plan() -> None:
    run = load_profile(mlp_profile())
    costs = measure_costs(run.parameters, powersgd_ranks=(1,), threads=1, repeats=1)
    assert costs.cast_ms_per_mib > 0 and costs.uncast_ms_per_mib > 0 and costs.gflops > 0
    assert set(costs.matrices) == {"256,1024,1", "1024,2048,1", "2048,2048,1", "2048,1024,1"}
    gradients = [Gradient(shape=tuple(s), bucket=1) for s in MLP_BUCKETS[1]]
    plan = plan_bucket(sum(g.bytes for g in gradients), gradients, compression="powersgd", costs=costs)
    assert plan.pre_ms > 0 and all(amount >= 0 for _, amount in plan.segments)
    assert costs.as_dict()["matrices"]["2048,2048,1"] == list(costs.matrices["2048,2048,1"])
    assert set(costs.gloo_ms_per_mib) == {"float32", "float16", "bfloat16"}  # gloo in-process, two threads
    assert 0 < costs.allreduce_overhead_ms < 100
    assert all(value > 0 for value in costs.gloo_ms_per_mib.values())


def test_docs_list_every_preset_with_the_figures_the_code_uses() -> None:
    from lightning_mgpu.whatif import PRESETS

    rows = {}
    for line in (REPO / "docs" / "whatif.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[0].strip("`") in PRESETS:
            rows[cells[0].strip("`")] = cells
    assert set(rows) == set(PRESETS)
    for name, link in PRESETS.items():
        busbw = rows[name][2].split()[0]
        if math.isinf(link.busbw_gbps):
            assert busbw == "no"
        else:
            assert float(busbw) == pytest.approx(link.busbw_gbps, rel=0.01), name
        if link.latency_us:
            assert rows[name][3].startswith(f"{link.latency_us:g} µs"), name


BAD_CONTENTS = {
    "binary": bytes(range(256)) * 4,  # e.g. a checkpoint or a PNG given by mistake
    "text, not JSON": b"step_ms,comm_ms\n12.0,3.0\n",
    "a JSON number": b"42",
    "a JSON list of numbers": b"[1, 2, 3]",
    "an unrelated object": b'{"hello": "world"}',
}


@pytest.mark.parametrize("content", list(BAD_CONTENTS), ids=list(BAD_CONTENTS))
@pytest.mark.parametrize(
    ("role", "expected"),
    [
        ("PROFILE", "comm_profile.json"),
        ("--params", "'shape'"),
        ("--costs-file", "compression costs"),
        ("--link-bench", "bench-comm"),
        ("--intra-link-bench", "bench-comm"),
    ],
)
def test_every_bad_input_file_is_named_with_what_was_expected(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str, expected: str, content: str
) -> None:
    """Issue 28: `whatif` on a binary file said only "'utf-8' codec can't decode byte ..."; every file it
    reads must be named in its error, with what it should have been, and never a traceback."""
    bad = tmp_path / "given.bin"
    bad.write_bytes(BAD_CONTENTS[content])
    if role == "PROFILE":
        argv = [str(bad)]
    elif role == "--intra-link-bench":
        argv = [str(profile), "--nodes", "2", "--devices-per-node", "2", "--link", "10gbe", role, str(bad)]
    else:
        argv = [str(profile), role, str(bad)]
    assert main(["whatif", *argv, "--costs", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lightning-mgpu whatif: error: {bad}: ") and "Traceback" not in err, err
    assert "expected" in err and expected in err, err
    assert len(err.splitlines()) == 1


def test_a_parameter_list_that_does_not_fit_the_profile_names_its_file(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params = tmp_path / "params.json"
    params.write_text(json.dumps([{"shape": [3, 3], "dtype": "float32"}]))  # 36 bytes: fits no recorded bucket
    assert main(["whatif", str(profile), "--params", str(params), "--costs", "none"]) == 2
    err = capsys.readouterr().err
    assert f"{params}: 36 bytes of gradients, the profile's buckets hold" in err
    params.write_text(json.dumps([{"shape": [3, 3], "dtype": "int8"}]))
    assert main(["whatif", str(profile), "--params", str(params), "--costs", "none"]) == 2
    assert f"{params}: entry 0: unknown gradient dtype 'int8'" in capsys.readouterr().err


def test_saved_costs_are_read_from_a_json_run_or_its_costs_object(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = run_json(capsys, str(profile))
    whole, costs = tmp_path / "run.json", tmp_path / "costs.json"
    whole.write_text(json.dumps(document))
    costs.write_text(json.dumps(document["inputs"]["compression_costs"]))
    for path in (whole, costs):
        again = run_json(capsys, str(profile), "--costs-file", str(path))
        assert again["inputs"]["compression_costs"]["how"] == f"from {path}"


def _sweep(tmp_path: Path, name: str, **placement: Any) -> Path:
    """bench/results/bench_comm_cpu.json (a 2-rank sweep) with where its ranks ran set, or left unrecorded."""
    report = json.loads((REPO / "bench" / "results" / "bench_comm_cpu.json").read_text())
    for key in ("launcher", "nodes", "ranks_per_node", "hosts"):
        report.pop(key, None)
    path = tmp_path / name
    path.write_text(json.dumps({**report, **placement}))
    return path


def test_a_one_host_sweep_cannot_stand_for_the_link_between_nodes(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 31: bench-comm on one host measures loopback; given as --link-bench for a 2-node prediction it
    was taken for the link. Refused, naming the file and how to measure the link instead."""
    host = [{"node": 0, "hostname": "box", "address": "127.0.0.1", "ranks": [0, 1]}]
    loopback = _sweep(tmp_path, "loopback.json", launcher="bench-comm", nodes=1, ranks_per_node=[2], hosts=host)
    for scale in (["--world-size", "2"], ["--world-size", "1,2,4"], ["--nodes", "2"]):
        assert main(["whatif", str(profile), "--link-bench", str(loopback), *scale, "--costs", "none"]) == 2
        err = capsys.readouterr().err
        assert f"error: {loopback} is a one-host bench-comm sweep (2 ranks over loopback)" in err, err
        assert "srun --nodes=2 --ntasks-per-node=1 lightning-mgpu bench-comm --json FILE" in err
    one_node = run_json(capsys, str(profile), "--link-bench", str(loopback), "--world-size", "1")
    assert one_node["predicted"]["world_size"] == 1  # nothing crosses a node: the sweep is not used


def test_a_sweep_across_nodes_is_the_link_and_an_unrecorded_one_is_said_to_be_unknown(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hosts = [
        {"node": 0, "hostname": "node1", "address": "10.0.0.1", "ranks": [0]},
        {"node": 1, "hostname": "node2", "address": "10.0.0.2", "ranks": [1]},
    ]
    across = _sweep(tmp_path, "across.json", launcher="srun", nodes=2, ranks_per_node=[1, 1], hosts=hosts)
    document = run_json(capsys, str(profile), "--link-bench", str(across), "--world-size", "2")
    inter = document["inputs"]["system"]["inter"]
    assert inter["measured_nodes"] == 2 and "across 2 nodes (srun: node1, node2)" in inter["source"]
    assert not any("does not record where its ranks ran" in note for note in document["assumptions"])
    unknown = _sweep(tmp_path, "unknown.json")
    document = run_json(capsys, str(profile), "--link-bench", str(unknown), "--world-size", "2")
    assert document["inputs"]["system"]["inter"]["measured_nodes"] is None
    assert f"{unknown} does not record where its ranks ran" in " ".join(document["assumptions"])
    assert main(["whatif", str(profile), "--link-bench", str(unknown), "--world-size", "2", "--costs", "none"]) == 0
    assert "if they ran on one host it measured that host's loopback" in " ".join(capsys.readouterr().out.split())
    bad = _sweep(tmp_path, "bad.json", nodes="two")
    assert main(["whatif", str(profile), "--link-bench", str(bad), "--costs", "none"]) == 2
    assert f"{bad}: 'nodes' must be an integer >= 1" in capsys.readouterr().err
