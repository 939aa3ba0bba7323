"""``lightning-mgpu doctor`` started by a launcher on every node (``srun``, ``torchrun --nnodes``): one report.

Started once per rank, the command joins the launcher's world over gloo, through the rendezvous a
Lightning fit in the same job uses (:mod:`lightning_mgpu.comm.launched`), instead of checking
the same machine once per rank:

1. the first rank of every node runs the machine checks there (:func:`lightning_mgpu.envcheck.collect`),
   without the 2-process all_reduce on 127.0.0.1: the world's own all_reduce replaces it;
2. every rank all-reduces a known tensor across the world, the check the loopback one stands for
   on one machine: gloo, and NCCL too when every rank has a GPU (rank ``LOCAL_RANK`` of the node's);
3. rank 0 gathers it all and prints one report (:mod:`lightning_mgpu.envcheck.nodes`): each check
   once, with the nodes it differs on; ``nodes`` (same releases on every node, the same number of
   ranks); the world's all_reduce. Every rank exits with the report's status (1: something failed).

A rank that cannot join (a node that never came, a rendezvous address that does not resolve)
gives up after ``--timeout`` seconds and prints its own node's report with a failing ``world``
check: a broken world still says what is wrong, from each rank that could see it.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Mapping

from lightning_mgpu import envcheck
from lightning_mgpu._version import __version__
from lightning_mgpu.comm.launched import LaunchedWorld, join
from lightning_mgpu.envcheck.checks import Check
from lightning_mgpu.envcheck.nodes import NodeChecks, check_nodes, merge

NBYTES = 4 << 20  # all_reduce 4 MiB of float32, as the one-machine check does
MACHINE_CHECKS_S = 120.0
"""How much longer than ``--timeout`` a rank waits for the other nodes' machine checks before giving up."""


def world_allreduce(world: LaunchedWorld, backend: str) -> dict[str, Any]:
    """All-reduce ``NBYTES`` holding ``rank + 1`` over the joined world (every rank): wrong elements and the median time."""
    import torch
    import torch.distributed as dist

    from lightning_mgpu.cli.workers.allreduce import check_and_time

    group = None if backend == "gloo" else dist.new_group(backend=backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", world.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    wrong, allreduce_ms = check_and_time(world.rank, world.world_size, NBYTES, device, group)
    if group is not None:
        dist.destroy_process_group(group)
    return {"rank": world.rank, "wrong": wrong, "allreduce_ms": allreduce_ms}


def _world_check(backend: str, world: LaunchedWorld, results: list[dict[str, Any]], join_s: float) -> Check:
    name = f"{backend} all_reduce (world)"
    where = f"{world.world_size} ranks on {world.nodes} node(s) ({world.launcher})"
    details = {"world_size": world.world_size, "bytes": NBYTES, "ranks": results}
    wrong = [r["rank"] for r in results if r["wrong"]]
    if wrong:
        return Check(
            name,
            "fail",
            f"{where}: wrong sums on rank(s) {wrong}",
            fix="a rank received corrupted data: rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL NCCL_DEBUG=INFO and check "
            "the network interfaces each backend picks (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)",
            details=details,
        )
    slowest = max(r["allreduce_ms"] for r in results)
    value = f"{where}: {NBYTES >> 20} MiB correct, {slowest:.2f} ms per all_reduce (rendezvous {join_s * 1e3:.0f} ms)"
    return Check(name, "ok", value, details=details)


def run(
    environ: Mapping[str, str], world: LaunchedWorld, *, timeout: float, allreduce: bool
) -> tuple[dict[str, Any], bool]:
    """Every rank's part of the report: returns the report (the same on every rank) and whether this rank prints it
    (rank 0; and every rank that could not join the world, with its own node's report)."""
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    try:
        join(world, timeout=timedelta(seconds=timeout))
    except Exception as error:  # noqa: BLE001 - a world that cannot form is what this check is for
        checks = envcheck.collect(environ, smoke=None, allreduce_placeholder=False)
        checks.insert(
            _after_backends(checks),
            Check(
                "world",
                "fail",
                f"rank {world.rank} on {socket.gethostname()} could not join the {world.world_size} ranks started by "
                f"{world.launcher} at {world.master_addr}:{world.master_port} within {timeout:g} s: "
                f"{str(error).splitlines()[0][:300] if str(error) else type(error).__name__}",
                fix="check that every node started (squeue / the launcher's output), that the first node's address "
                "resolves and is reachable from every node, and that nothing else listens on MASTER_PORT; "
                "--timeout SECONDS allows a slower start",
            ),
        )
        return envcheck.report(checks, time.perf_counter() - started), True
    join_s = time.perf_counter() - started
    # The records are gathered once every node's first rank ran the machine checks, which take seconds, more on a
    # busy node (seen: over 20 s with every core taken): a group of their own, whose collectives may wait that
    # long. The rendezvous and the all_reduce checks keep --timeout.
    records_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout + MACHINE_CHECKS_S))
    world_checks = []
    if allreduce:
        results = [world_allreduce(world, "gloo")]
        world_checks.append(("gloo", results))
        has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available()
        every_gpu: list[Any] = [None] * world.world_size
        dist.all_gather_object(every_gpu, has_gpu)
        if all(every_gpu):
            world_checks.append(("nccl", [world_allreduce(world, "nccl")]))
    mine = None
    if world.local_rank == 0:
        checks = envcheck.collect(environ, smoke=None, allreduce_placeholder=False)
        mine = [asdict(check) for check in checks]
    record = {"rank": world.rank, "node": world.node_rank, "hostname": socket.gethostname(), "checks": mine}
    record.update(package=__version__, allreduce={backend: results[0] for backend, results in world_checks})
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, record, group=records_group)
    dist.destroy_process_group()
    return combine(gathered, world, join_s, time.perf_counter() - started), world.rank == 0


def combine(records: list[dict[str, Any]], world: LaunchedWorld, join_s: float, elapsed_s: float) -> dict[str, Any]:
    """Rank 0's report from every rank's record (pure: the tests feed it records)."""
    nodes: dict[int, NodeChecks] = {}
    for record in sorted(records, key=lambda r: r["rank"]):
        node = nodes.setdefault(
            record["node"], NodeChecks(record["node"], record["hostname"], [], [], record["package"])
        )
        node.ranks.append(record["rank"])
        if record["checks"] is not None:
            node.checks = record["checks"]
    ordered = [nodes[key] for key in sorted(nodes)]
    checks = merge(ordered)
    position = _after_backends(checks)
    world_checks = [check_nodes(ordered)]
    for backend in ("gloo", "nccl"):
        results = [r["allreduce"][backend] for r in records if backend in r["allreduce"]]
        if len(results) == len(records) and results:
            world_checks.append(_world_check(backend, world, results, join_s))
    if not records[0]["allreduce"]:
        world_checks.append(Check("all_reduce (world)", "ok", "not run (--skip-allreduce)"))
    checks[position:position] = world_checks
    result = envcheck.report(checks, elapsed_s)
    result["world"] = {
        "launcher": world.launcher,
        "world_size": world.world_size,
        "nodes": [{"node": n.node, "hostname": n.hostname, "ranks": n.ranks} for n in ordered],
    }
    return result


def _after_backends(checks: list[Check]) -> int:
    names = [c.name for c in checks]
    return names.index("backends") + 1 if "backends" in names else len(checks)


__all__ = ["combine", "run", "world_allreduce"]
