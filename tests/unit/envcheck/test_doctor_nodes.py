"""``lightning-mgpu doctor`` on every node (issue 31 item 6), in-process: which world a launcher started, and one
report made of every node's checks. The command under a real scheduler: tests/dist/cluster/test_slurm_jobs.py."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_mgpu.cli._across_nodes import combine
from lightning_mgpu.comm.launched import LaunchedWorld, first_host, launched_world
from lightning_mgpu.envcheck import Check
from lightning_mgpu.envcheck.nodes import NodeChecks, check_nodes, merge

SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}
TORCHRUN = {
    "RANK": "2",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "gpu07",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "x",
}


def test_srun_tasks_meet_where_lightning_does() -> None:
    world = launched_world(SRUN)
    assert world == LaunchedWorld("srun", 3, 4, 1, 1, 2, "gpu07", 15000 + 3456)
    assert launched_world({**SRUN, "MASTER_PORT": "29999", "MASTER_ADDR": "head"}) == LaunchedWorld(
        "srun", 3, 4, 1, 1, 2, "head", 29999
    )


def test_torchrun_wins_inside_a_slurm_job_and_one_rank_or_a_batch_script_is_no_world() -> None:
    assert launched_world({**SRUN, **TORCHRUN}) == LaunchedWorld("torchrun", 2, 4, 0, 1, 2, "gpu07", 29400)
    assert launched_world({**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}) is None
    batch = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}  # the batch script: no step
    assert launched_world(batch) is None
    assert launched_world({**SRUN, "SLURM_STEP_NUM_TASKS": "1"}) is None
    assert launched_world({}) is None
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not an integer"):
        launched_world({**SRUN, "SLURM_PROCID": "x"})


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("gpu[07-08]", "gpu07"),
        ("a,b", "a"),
        ("n[3,5-6],m1", "n3"),
        ("rack1-n[001-004]-ib", "rack1-n001-ib"),
        ("x", "x"),
    ],
)
def test_the_first_host_of_a_slurm_node_list(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def _node(node: int, host: str, ranks: list[int], *checks: Check, package: str = "0.1.0") -> NodeChecks:
    return NodeChecks(node, host, ranks, [c.__dict__ for c in checks], package)


def test_every_node_checks_become_one_line_each() -> None:
    a = _node(0, "n0", [0, 1], Check("torch", "ok", "2.13.0 (CPU build)"), Check("shm", "ok", "64 GiB"))
    b = _node(
        1,
        "n1",
        [2, 3],
        Check("torch", "ok", "2.13.0 (CPU build)"),
        Check("shm", "warn", "64 MiB", fix="mount a larger /dev/shm"),
    )
    torch_line, shm_line = merge([a, b])
    assert (torch_line.status, torch_line.value) == ("ok", "2.13.0 (CPU build) (every node)")
    assert shm_line.status == "warn" and shm_line.value == "n0: 64 GiB; n1: 64 MiB"
    assert shm_line.fix == "on n1: mount a larger /dev/shm"
    assert set(shm_line.details["per_node"]) == {"n0 (node 0)", "n1 (node 1)"}
    launcher = merge(
        [_node(0, "n0", [0], Check("launcher", "ok", "rank 0")), _node(1, "n1", [1], Check("launcher", "ok", "rank 1"))]
    )
    assert launcher[0].value == "n0: rank 0 (1 other node(s) differ; --json lists each)"


def test_different_releases_on_two_nodes_fail_and_uneven_ranks_warn() -> None:
    same = [
        _node(0, "n0", [0, 1], Check("torch", "ok", "2.13.0")),
        _node(1, "n1", [2, 3], Check("torch", "ok", "2.13.0")),
    ]
    assert check_nodes(same).status == "ok" and check_nodes(same).value == "2 node(s): n0: rank(s) 0,1; n1: rank(s) 2,3"
    other = [same[0], _node(1, "n1", [2, 3], Check("torch", "ok", "2.11.0"))]
    failed = check_nodes(other)
    assert failed.status == "fail" and "torch 2.13.0 on n0, 2.11.0 on n1" in failed.value
    package = [same[0], _node(1, "n1", [2, 3], Check("torch", "ok", "2.13.0"), package="0.0.9")]
    assert "lightning_mgpu 0.1.0 on n0, 0.0.9 on n1" in check_nodes(package).value
    uneven = [same[0], _node(1, "n1", [2], Check("torch", "ok", "2.13.0"))]
    assert check_nodes(uneven).status == "warn" and "--ntasks-per-node" in (check_nodes(uneven).fix or "")


def _record(rank: int, node: int, host: str, checks: Any) -> dict[str, Any]:
    allreduce = {"gloo": {"rank": rank, "wrong": 0, "allreduce_ms": 1.0 + rank}}
    return {"rank": rank, "node": node, "hostname": host, "checks": checks, "package": "0.1.0", "allreduce": allreduce}


def test_rank_zero_reports_every_node_once_with_the_world_all_reduce_after_the_backends() -> None:
    checks = [Check("torch", "ok", "2.13.0").__dict__, Check("backends", "ok", "gloo").__dict__]
    checks.append(Check("open files", "ok", "4096").__dict__)
    records = [
        _record(0, 0, "n0", checks),
        _record(1, 0, "n0", None),
        _record(2, 1, "n1", checks),
        _record(3, 1, "n1", None),
    ]
    world = LaunchedWorld("srun", 0, 4, 0, 0, 2, "n0", 15000)
    report = combine(records, world, join_s=0.25, elapsed_s=2.0)
    names = [c["name"] for c in report["checks"]]
    assert names == ["torch", "backends", "nodes", "gloo all_reduce (world)", "open files"]
    assert report["status"] == "ok" and report["counts"] == {"ok": 5, "warn": 0, "fail": 0}
    world_line = report["checks"][3]["value"]
    assert world_line.startswith("4 ranks on 2 node(s) (srun): 4 MiB correct, 4.00 ms per all_reduce")
    assert report["world"]["nodes"] == [
        {"node": 0, "hostname": "n0", "ranks": [0, 1]},
        {"node": 1, "hostname": "n1", "ranks": [2, 3]},
    ]
    records[3]["allreduce"]["gloo"]["wrong"] = 5
    assert combine(records, world, 0.25, 2.0)["status"] == "fail"


def test_the_records_wait_for_the_other_nodes_machine_checks_longer_than_the_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen under srun on a busy machine: a node's machine checks took over --timeout (20 s), and the ranks waiting
    for its record gave up inside the gather ("Timed out waiting 20000ms for send operation"). The gather has a
    group of its own, with MACHINE_CHECKS_S more; the rendezvous keeps --timeout."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_mgpu.cli import _across_nodes
    from tests.conftest import destroy_default_group

    joined: list[timedelta] = []

    def join(world: LaunchedWorld, *, timeout: timedelta) -> None:
        joined.append(timeout)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    groups: dict[int, timedelta] = {}
    new_group, gather = dist.new_group, dist.all_gather_object

    def spy_new_group(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        groups[id(group)] = kwargs["timeout"]
        return group

    gathered_on: list[Any] = []

    def spy_gather(output: list[Any], obj: Any, group: Any = None) -> None:
        gathered_on.append(groups.get(id(group)))
        gather(output, obj, group=group)

    monkeypatch.setattr(_across_nodes, "join", join)
    monkeypatch.setattr(_across_nodes.envcheck, "collect", lambda *_, **__: [Check("torch", "ok", "2.13")])
    monkeypatch.setattr(dist, "new_group", spy_new_group)
    monkeypatch.setattr(dist, "all_gather_object", spy_gather)
    world = LaunchedWorld("srun", 0, 1, 0, 0, 1, "127.0.0.1", 29500)
    try:
        report, prints = _across_nodes.run({}, world, timeout=20.0, allreduce=False)
    finally:
        if dist.is_initialized():
            destroy_default_group()
    assert prints and report["world"]["nodes"][0]["ranks"] == [0]
    assert joined == [timedelta(seconds=20)]
    assert gathered_on == [timedelta(seconds=20 + _across_nodes.MACHINE_CHECKS_S)]
