"""``lightning-mgpu bench-comm`` started by a launcher (issue 31 item 4), in-process.

Under ``torchrun`` or ``srun`` every process is one rank of the launcher's world: the command must
join that world (one sweep across the real link) instead of starting its own ranks on 127.0.0.1,
and only rank 0 may print and write ``--json``, recording where the ranks ran. Before, every
process ran a loopback sweep of its own and they overwrote each other's file.

For real, across two nodes (torchrun in the network lab, srun in the SLURM lab):
tests/dist/labs/test_netlab.py and tests/dist/cluster/test_slurm_jobs.py.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch.distributed as dist

from lightning_mgpu.cli import main
from lightning_mgpu.cli.bench_comm import where_line
from lightning_mgpu.comm import allreduce_run
from lightning_mgpu.comm.allreduce_bench import SweepSettings, size_row
from lightning_mgpu.comm.launched import LaunchedWorld
from tests.conftest import destroy_default_group

TORCHRUN = {"RANK": "{rank}", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "{rank}"}
SRUN = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "{rank}", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "{rank}"}
SRUN.update(SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="node[1-2]", SLURM_LOCALID="0", SLURM_JOB_ID="4242")
LAUNCHER_VARIABLES = {*TORCHRUN, *SRUN, "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def two_node_report(launcher: str) -> dict[str, Any]:
    """What rank 0 of a 2-node world assembles (the real assembly, measured rows made up)."""
    records = [
        {"rank": 1, "node": 1, "hostname": "node2", "address": "10.0.0.2"},
        {"rank": 0, "node": 0, "hostname": "node1", "address": "10.0.0.1"},
    ]
    rows = [size_row(nbytes, [1e-4, 1.1e-4], [0, 0], iters=5, warmup=1) for nbytes in (1024, 4096)]
    settings = SweepSettings(device="cpu", nproc=1, min_bytes=1024, max_bytes=4096, factor=4)
    hosts = allreduce_run.hosts_of(records)
    return allreduce_run._report(settings, 2, {"torch": "x"}, {"float32": rows}, 0.0, launcher, hosts)


def test_ranks_are_grouped_by_node_in_node_order() -> None:
    records = [
        {"rank": 3, "node": 1, "hostname": "b", "address": "10.0.0.2"},
        {"rank": 0, "node": 0, "hostname": "a", "address": "10.0.0.1"},
        {"rank": 2, "node": 1, "hostname": "b", "address": "10.0.0.2"},
        {"rank": 1, "node": 0, "hostname": "a", "address": "10.0.0.1"},
    ]
    assert allreduce_run.hosts_of(records) == [
        {"node": 0, "hostname": "a", "address": "10.0.0.1", "ranks": [0, 1]},
        {"node": 1, "hostname": "b", "address": "10.0.0.2", "ranks": [2, 3]},
    ]
    report = two_node_report("srun")
    assert (report["world_size"], report["nodes"], report["ranks_per_node"]) == (2, 2, [1, 1])
    assert [h["hostname"] for h in report["hosts"]] == ["node1", "node2"] and report["launcher"] == "srun"


def test_a_node_is_told_apart_by_the_address_it_leaves_by() -> None:
    assert allreduce_run.link_address("127.0.0.1", 29500) == "127.0.0.1"
    assert allreduce_run.link_address("no-such-host.invalid", 29500) is None


@pytest.mark.parametrize(("launcher", "variables"), [("torchrun", TORCHRUN), ("srun", SRUN)])
def test_under_a_launcher_it_joins_the_world_and_only_rank_0_prints_and_writes(
    launcher: str,
    variables: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def loopback_sweep(*_: Any, **__: Any) -> dict[str, Any]:
        raise AssertionError("started its own loopback ranks under a launcher")

    worlds: list[LaunchedWorld] = []

    def launched_sweep(settings: SweepSettings, world: LaunchedWorld, *, progress: bool) -> dict[str, Any]:
        worlds.append(world)
        return two_node_report(world.launcher)

    monkeypatch.setattr(allreduce_run, "run_sweep", loopback_sweep)
    monkeypatch.setattr(allreduce_run, "run_launched_sweep", launched_sweep)
    out = tmp_path / "link.json"
    for rank in (1, 0):
        for name, value in variables.items():
            monkeypatch.setenv(name, value.format(rank=rank))
        assert main(["bench-comm", "--json", str(out), "--quiet"]) == 0
        printed = capsys.readouterr().out
        if rank == 1:
            assert printed == "" and not out.exists()  # rank 1 measured its part, and said nothing
    assert [(w.launcher, w.rank, w.world_size, w.nodes) for w in worlds] == [(launcher, 1, 2, 2), (launcher, 0, 2, 2)]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["nodes"] == 2 and report["launcher"] == launcher
    assert f"2 nodes ({launcher}): node1 10.0.0.1 [rank 0], node2 10.0.0.2 [rank 1]" in printed
    assert printed.count("peak busbw") == 1 and f"wrote {out}" in printed


def test_nproc_under_a_launcher_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value.format(rank=0))
    with pytest.raises(SystemExit) as exited:
        main(["bench-comm", "--nproc", "2"])
    assert exited.value.code == 2
    assert "--nproc: started by torchrun as one of 2 ranks, the launcher decides" in capsys.readouterr().err


@pytest.fixture
def in_memory_join(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``join`` makes a one-rank group on an in-memory store (no socket, no process)."""

    def join(world: LaunchedWorld, *, backend: str, timeout: timedelta) -> None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    monkeypatch.setattr(allreduce_run, "join", join)
    monkeypatch.setattr(allreduce_run, "_machine_facts", lambda *_: {})  # platform's asks `uname -p`: a process
    yield
    if dist.is_initialized():
        destroy_default_group()


@pytest.mark.usefixtures("in_memory_join")
def test_a_launched_sweep_measures_on_the_joined_group_and_records_where() -> None:
    world = LaunchedWorld("srun", 0, 1, 0, 0, 1, "127.0.0.1", 29500)
    settings = SweepSettings(device="cpu", nproc=1, min_bytes=1024, max_bytes=4096, factor=2, iters=2, warmup=0)
    report = allreduce_run.run_launched_sweep(settings, world)
    assert not dist.is_initialized()  # the group is gone after the sweep
    assert [row["bytes"] for row in report["rows"]] == [1024, 2048, 4096] and report["wrong_total"] == 0
    assert report["launcher"] == "srun" and report["nodes"] == 1 and report["ranks_per_node"] == [1]
    assert report["hosts"][0]["address"] == "127.0.0.1" and report["hosts"][0]["ranks"] == [0]


def test_the_table_says_where_the_ranks_ran() -> None:
    assert where_line(two_node_report("torchrun")).startswith("2 nodes (torchrun): node1 10.0.0.1 [rank 0]")
    loopback = {**two_node_report("bench-comm"), "nodes": 1}
    loopback["hosts"] = [{"node": 0, "hostname": "box", "address": "127.0.0.1", "ranks": [0, 1]}]
    assert where_line(loopback) == "one host (box), 2 ranks started by bench-comm over loopback"
    assert "not recorded" in where_line({"world_size": 2})
