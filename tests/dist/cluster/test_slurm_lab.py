"""The SLURM lab itself (issue 31 item 1), with real daemons: jobs run on both nodes, and nothing is left behind.

* a job of 2 nodes x 2 tasks runs each node's tasks inside that node: its host name (the SLURM
  node name), its loopback-range address, the other node's name resolving to the other address;
* teardown leaves no namespace, no process (daemons, job steps, ranks: nothing in the nodes'
  network namespaces, nothing naming the cluster's directory) and no directory, after ``with``,
  after an exception, after SIGTERM and SIGINT to the process holding the cluster, and after
  SIGKILL once :func:`bench.labs.slurm.remove_stale` ran (what the next cluster or ``--cleanup`` does);
* two clusters side by side never collide.

The cluster's configuration, the refusal and the job-state parsing without daemons:
tests/unit/labs/test_slurm_lab.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.labs.slurm import Cluster, lab_unavailable, remove_stale
from tests.conftest import REPO
from tests.dist.cluster.conftest import cluster_or_skip

pytestmark = [pytest.mark.multiprocess]


def _namespace_inodes(cluster: Cluster) -> set[int]:
    return {os.stat(f"/run/netns/{node.namespace}").st_ino for node in cluster.nodes}


def _leftovers(directory: str, namespaces: list[str], inodes: set[int]) -> list[str]:
    """What of a cluster is still there: its directory, namespaces, and any process in its nodes or naming its directory."""
    found = [directory] if Path(directory).exists() else []
    found += [name for name in namespaces if Path(f"/run/netns/{name}").exists()]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            net = os.readlink(proc / "ns" / "net")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(net.split("[")[1].rstrip("]")) in inodes or directory in cmdline:
            found.append(f"pid {proc.name}: {cmdline[:120]}")
    return found


@pytest.mark.timeout(120)
def test_a_job_runs_each_nodes_tasks_inside_that_node() -> None:
    with cluster_or_skip() as cluster:
        probe = "echo $SLURM_PROCID $(hostname) $(ip -o -4 addr show | grep -o '127\\.78\\.[0-9.]*' | head -n1)"
        probe += " $(getent hosts " + " ".join(cluster.hostnames) + " | awk '{print $1}' | tr '\\n' ,)"
        done = cluster.run(["bash", "-c", probe], nodes=2, tasks_per_node=2, timeout=60)
        assert done.ok, done.output
        lines = sorted(line.split() for line in done.output.splitlines() if line[:1].isdigit())
        expected_names = ",".join(cluster.addresses) + ","
        assert [line[0] for line in lines] == ["0", "1", "2", "3"]
        for rank, host, address, resolved in lines:
            node = int(rank) // 2  # block distribution: ranks 0-1 on node 0, 2-3 on node 1
            assert (host, address) == (cluster.hostnames[node], cluster.addresses[node]), lines
            assert resolved == expected_names  # every node's name resolves to its address, on every node
        assert all(address.startswith("127.78.0.") for address in cluster.addresses)
        with cluster_or_skip() as second:  # unique names: a second cluster beside the first
            assert not set(second.hostnames) & set(cluster.hostnames) and second.name != cluster.name
            assert second.run(["hostname"], nodes=2, timeout=60).ok


@pytest.mark.timeout(120)
def test_with_and_an_exception_leave_nothing_behind() -> None:
    cluster = cluster_or_skip()
    directory, names, inodes = str(cluster.directory), [n.namespace for n in cluster.nodes], _namespace_inodes(cluster)
    with cluster:
        job = cluster.srun_job(["sleep", "300"], nodes=2)  # a running job's step and tasks must go too
        job.wait_until(lambda: job.state().state == "RUNNING", 30, what="RUNNING")
        assert _leftovers(directory, names, inodes)
    assert _leftovers(directory, names, inodes) == []
    broken = cluster_or_skip()
    directory, names, inodes = str(broken.directory), [n.namespace for n in broken.nodes], _namespace_inodes(broken)
    with pytest.raises(RuntimeError, match="inside"):
        with broken:
            raise RuntimeError("inside")
    assert _leftovers(directory, names, inodes) == []


KEEP_ALIVE = """
import sys, time
sys.path.insert(0, {repo!r})
from bench.labs.network import handle_signals
from bench.labs.slurm import Cluster
handle_signals()
with Cluster(2) as cluster:
    job = cluster.srun_job(["sleep", "300"], nodes=2)
    job.wait_until(lambda: job.state().state == "RUNNING", 30, what="RUNNING")
    print(cluster.directory, *(node.namespace for node in cluster.nodes), flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_stopped_cluster_is_torn_down(how: str) -> None:
    if lab_unavailable() is not None:
        pytest.skip(f"the SLURM lab cannot be built here: {lab_unavailable()}")
    child = subprocess.Popen(
        [sys.executable, "-c", KEEP_ALIVE.format(repo=str(REPO))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stderr is not None
        line = child.stdout.readline().split()
        assert line, child.stderr.read()
        directory, names = line[0], line[1:]
        inodes = {os.stat(f"/run/netns/{name}").st_ino for name in names}
        assert _leftovers(directory, names, inodes)
        child.send_signal(getattr(signal, how))
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if how == "SIGKILL":  # nothing runs in a killed process: the next cluster (or --cleanup) removes its leftovers
        assert _leftovers(directory, names, inodes)
        removed = remove_stale()
        assert set(names) <= set(removed) and directory in removed
    assert _leftovers(directory, names, inodes) == []
