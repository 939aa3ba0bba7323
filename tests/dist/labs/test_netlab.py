"""The network lab for real: two namespaces over a shaped veth link, and the package across it.

* the lab: the link is shaped (a 0.1 Gbit/s link never carries much more) and measured, two
  labs never collide, and nothing is left behind: after ``with``, after an exception, after
  SIGTERM, and after SIGKILL (the next run removes what a killed one left);
* multi-node correctness: ``tests/scripts/netlab_fit.py`` runs every strategy and callback of
  the package (``ddp_tuned``, fp16, bf16, PowerSGD, ``bucket_cap_mb="auto"``, ``CommProfiler``,
  ``DistributedDoctor``, ``hybrid`` with 2 replicas x 2 CPU devices) with Lightning
  ``num_nodes=2`` under ``torchrun --nnodes=2 --rdzv-backend=static``, one rank per namespace,
  and must end on exactly the parameters of the same run on loopback, with its gradients
  having crossed the link (the link's byte counters say so);
* ``lightning-mgpu bench-comm`` under ``torchrun --nnodes=2`` joins that world: one sweep over the
  link, one JSON and one table, from rank 0, recording both nodes (issue 31 item 4);
* the rendezvous of a multi-node run started without torchrun (Lightning's own environment:
  ``MASTER_ADDR``/``NODE_RANK``, loopback-range ``MASTER_ADDR`` on a real link).

Skipped, with the reason, only where namespaces cannot be made (not root, no ``ip``/``tc``, a
kernel or container that refuses them). Small models and few steps: the lane takes about a
minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from bench.harness.launch import check, rank_env, run
from bench.labs.network import Lab, LabError, lab_unavailable, remove_stale
from tests.conftest import REPO, SCRIPTS, TORCHRUN_2, cpu_env, run_python

pytestmark = [pytest.mark.multiprocess]

CONFIGS = ("ddp_tuned", "fp16", "bf16", "powersgd", "auto", "profiler", "doctor", "hybrid")


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _lab_or_skip(rates: Any = 1.0) -> Lab:
    reason = lab_unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    try:
        return Lab(2, rates).build()
    except LabError as error:
        pytest.skip(f"network namespaces cannot be made here: {error}")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    built = _lab_or_skip(1.0)
    try:
        yield built
    finally:
        built.teardown()


# ----------------------------------------------------------------------------- the lab itself


@pytest.mark.timeout(60)
def test_the_link_is_shaped_and_measured_and_the_lab_leaves_nothing_behind() -> None:
    lab = _lab_or_skip([0.1, 0.2])
    names = {node.namespace for node in lab.nodes}
    with lab:
        assert names <= _namespaces()
        forward, backward = lab.measure_link(0, 1, seconds=0.3), lab.measure_link(1, 0, seconds=0.3)
        # A token bucket lets a burst of 256 KiB through, never a sustained rate above its own:
        # the transfer (~4 MB) cannot reach 1.5x the configured rate, whatever the machine's load.
        assert 0 < forward.gbps < 0.15 and 0 < backward.gbps < 0.3, (forward, backward)
        with _lab_or_skip(0.1) as second:  # unique names: a second lab beside the first
            assert not names & {node.namespace for node in second.nodes}
    assert not names & _namespaces()
    broken = _lab_or_skip(0.1)
    with pytest.raises(RuntimeError, match="inside"):
        with broken:
            raise RuntimeError("inside")
    assert not {node.namespace for node in broken.nodes} & _namespaces()


KEEP_ALIVE = """
import sys, time
sys.path.insert(0, {repo!r})
from bench.labs.network import Lab, handle_signals
handle_signals()
with Lab(2, 0.1) as lab:
    print(" ".join(node.namespace for node in lab.nodes), flush=True)
    time.sleep(120)
"""


def _ignore_sigint() -> None:
    """What a shell without job control does to a background job (``nohup ... &``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGINT, inherited ignored", "SIGKILL"])
def test_a_stopped_lab_is_torn_down(how: str) -> None:
    if lab_unavailable() is not None:
        pytest.skip(f"network namespaces cannot be made here: {lab_unavailable()}")
    child = subprocess.Popen(
        [sys.executable, "-c", KEEP_ALIVE.format(repo=str(REPO))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint if "ignored" in how else None,
    )
    try:
        assert child.stdout is not None
        names = set(child.stdout.readline().split())
        if not names:
            pytest.skip(f"network namespaces cannot be made here: {child.stderr.read() if child.stderr else ''}")
        assert names <= _namespaces()
        child.send_signal(getattr(signal, how.split(",")[0]))
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if how == "SIGKILL":  # nothing runs in a killed process: the next lab removes its leftovers
        assert names <= _namespaces()
        assert names <= set(remove_stale())
    assert not names & _namespaces()


# ----------------------------------------------------------------------------- the package across the link


@pytest.fixture(scope="module")
def runs(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One lab run and one loopback run of every configuration; rank 0's records and the link's counters."""
    lab_dir, loop_dir = tmp_path_factory.mktemp("lab"), tmp_path_factory.mktemp("loopback")
    script = [str(SCRIPTS / "netlab_fit.py"), "--configs", ",".join(CONFIGS)]
    before = lab.traffic(0)
    check(run([*script, "--out-dir", str(lab_dir)], nproc_per_node=1, lab=lab, timeout=150, log_dir=lab_dir), "lab run")
    after = lab.traffic(0)
    run_python([*TORCHRUN_2, *script, "--out-dir", str(loop_dir)], cwd=loop_dir, timeout=150, cold=True)
    return {
        "lab": {c: json.loads((lab_dir / f"{c}.json").read_text()) for c in CONFIGS},
        "loopback": {c: json.loads((loop_dir / f"{c}.json").read_text()) for c in CONFIGS},
        "sent": after["tx_bytes"] - before["tx_bytes"],
        "received": after["rx_bytes"] - before["rx_bytes"],
        "profile": json.loads((lab_dir / "profile" / "comm_profile.json").read_text()),
    }


@pytest.mark.timeout(330)
def test_the_gradients_crossed_the_link(runs: dict[str, Any]) -> None:
    ddp = runs["lab"]["ddp_tuned"]
    gradient_bytes = 4 * len(ddp["params"])
    # Every configuration all-reduced its gradients every step through node 0's link, both ways.
    assert runs["sent"] > gradient_bytes * ddp["global_step"] * len(CONFIGS) / 2, runs["sent"]
    assert runs["received"] > gradient_bytes * ddp["global_step"] * len(CONFIGS) / 2, runs["received"]


@pytest.mark.timeout(330)
@pytest.mark.parametrize("config", CONFIGS)
def test_across_two_namespaces_equals_loopback(runs: dict[str, Any], config: str) -> None:
    lab, loopback = runs["lab"][config], runs["loopback"][config]
    assert (lab["num_nodes"], lab["world_size"]) == (2, 2) and (loopback["num_nodes"], loopback["world_size"]) == (1, 2)
    assert lab["global_step"] == loopback["global_step"] > 0
    assert lab["ranks_agree"] and loopback["ranks_agree"]
    assert lab["params"] == loopback["params"], f"{config}: the lab run ended on other parameters than loopback"
    assert lab["losses"] == loopback["losses"]
    hook_names = {"fp16": "fp16", "bf16": "bf16", "powersgd": "powerSGD", "profiler": ""}  # what DDP's hook is called
    if config in hook_names:
        assert lab["comm_hook"] == loopback["comm_hook"] not in (None, "", "builtin_allreduce")
        assert hook_names[config] in lab["comm_hook"], lab["comm_hook"]
    if config == "auto":
        assert lab["tuning"]["status"] == "done" and len(lab["tuning"]["candidates"]) >= 2
    if config == "doctor":  # the data is deliberately not sharded: the ranks' batch hashes crossed the link
        assert lab["findings"] == loopback["findings"] == ["data-not-sharded"]
    if config == "hybrid":
        assert lab["plan"] == loopback["plan"] == [2, 2]
    if config == "profiler":
        profile = runs["profile"]
        assert profile["world_size"] == 2 and profile["backend"] == "gloo"
        assert profile["summary"]["bytes_per_step"] > 0 and profile["summary"]["comm_ms"] > 0


@pytest.mark.timeout(120)
def test_a_multi_node_run_without_torchrun_rendezvous_across_the_link(lab: Lab, tmp_path: Path) -> None:
    """Lightning's own environment (MASTER_ADDR, NODE_RANK), with a loopback-range MASTER_ADDR on a real link."""
    port = str(29000 + os.getpid() % 1000)
    children = []
    for node in range(2):
        env = rank_env(
            lab=lab, node=node, extra={"MASTER_ADDR": lab.master_addr, "MASTER_PORT": port, "NODE_RANK": str(node)}
        )
        env = {**cpu_env(), **env}
        argv = [sys.executable, str(SCRIPTS / "fit_tiny.py"), "--out", str(tmp_path / f"node{node}.json")]
        argv += ["--devices", "1", "--num-nodes", "2", "--steps", "4"]
        log = open(tmp_path / f"node{node}.log", "w")
        children.append(
            (
                subprocess.Popen(
                    [*lab.nodes[node].exec_prefix(), *argv],
                    env=env,
                    stdout=log,
                    stderr=log,
                    cwd=tmp_path,
                    start_new_session=True,
                ),
                log,
            )
        )
    deadline = time.monotonic() + 100
    try:
        for child, _ in children:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for child, log in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            log.close()
    outputs = [(tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2)]
    assert [child.returncode for child, _ in children] == [0, 0], outputs
    report = json.loads((tmp_path / "node0.json").read_text())
    assert report["world_size"] == 2 and report["params_per_rank"][0] == report["params_per_rank"][1]


@pytest.mark.timeout(120)
def test_bench_comm_under_torchrun_across_two_nodes_writes_one_report_of_the_link(lab: Lab, tmp_path: Path) -> None:
    """Before issue 31, each node ran a loopback sweep of its own and both wrote the same --json."""
    out = tmp_path / "link.json"
    command = ["-m", "lightning_mgpu.cli", "bench-comm", "--max-bytes", "256KiB", "--iters", "3", "--quiet"]
    nodes = run([*command, "--json", str(out)], nproc_per_node=1, lab=lab, timeout=90, log_dir=tmp_path, cwd=tmp_path)
    check(nodes, "bench-comm across the lab")
    report = json.loads(out.read_text())
    assert (report["launcher"], report["world_size"], report["nodes"], report["ranks_per_node"]) == (
        "torchrun",
        2,
        2,
        [1, 1],
    )
    assert [(h["address"], h["ranks"]) for h in report["hosts"]] == [(lab.address(0), [0]), (lab.address(1), [1])]
    assert report["wrong_total"] == 0 and len(report["rows"]) == 9  # 1 KiB .. 256 KiB
    assert [node.output.count("peak busbw") for node in nodes] == [1, 0]  # one table, from rank 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["link.json"]
