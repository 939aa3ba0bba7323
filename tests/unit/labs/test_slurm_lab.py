"""The SLURM lab's logic without starting anything (issue 31 item 1): a fake runner stands in for ``ip``/``tc``.

The configuration the daemons get (loopback-range addresses, the settings that make SLURM work
without cgroups and requeue fast, the cluster's own munge socket), unique names, the refusal
where the lab cannot be built, teardown of the directory and namespaces, and the parsing of
``scontrol``'s job lines. With real daemons: tests/dist/cluster/test_slurm_lab.py.
"""

from __future__ import annotations

import ipaddress
from typing import Sequence

import pytest

from bench.labs import network, slurm
from bench.labs.network import LabError
from bench.labs.slurm import Cluster, JobState


class FakeRunner:
    def __init__(self) -> None:
        self.commands: list[str] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.commands.append(" ".join(argv))
        return ""


def test_the_configuration_names_every_node_at_a_loopback_range_address() -> None:
    runner = FakeRunner()
    cluster = Cluster(2, runner=runner).build()  # a fake runner: the files are written, no daemon is started
    try:
        conf = cluster.conf.read_text()
        assert cluster.directory.name == cluster.tag and cluster.tag.startswith("slab-")
        for node in cluster.nodes:
            assert ipaddress.ip_address(node.address).is_loopback and node.address.startswith("127.78.0.")
            assert f"NodeName={node.name} NodeAddr={node.address} NodeHostname={node.name} CPUs=8" in conf
            assert node.namespace.startswith(cluster.tag) and f"ip netns add {node.namespace}" in runner.commands
        assert f"SlurmctldHost={cluster.hostnames[0]}({cluster.addresses[0]})" in conf
        for setting in (
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SlurmdParameters=config_overrides",
            "SchedulerParameters=sched_interval=2,bf_interval=1",
            f"AuthInfo=socket={cluster.munge_socket},cred_expire=5",
            "KillWait=30",
        ):
            assert setting in conf.splitlines(), setting
        assert "/etc/munge" not in conf and oct(cluster.directory.stat().st_mode & 0o777) == "0o700"
        assert cluster.hosts().splitlines()[1:] == [f"{n.address} {n.name}" for n in cluster.nodes]
        other = Cluster(2, runner=FakeRunner())
        assert other.name != cluster.name and not set(other.hostnames) & set(cluster.hostnames)
        assert cluster.client_argv(["sinfo"]) == ["nsenter", f"--net=/run/netns/{cluster.nodes[0].namespace}", "sinfo"]
        env = cluster.client_env({"X": "1"})
        assert env["SLURM_CONF"] == str(cluster.conf) and env["CUDA_VISIBLE_DEVICES"] == "" and env["X"] == "1"
    finally:
        cluster.teardown()
    assert not cluster.directory.exists()
    assert [c for c in runner.commands if c.startswith("ip netns delete")] == [
        f"ip netns delete {node.namespace}" for node in reversed(cluster.nodes)
    ]
    with pytest.raises(LabError, match="already built"):
        cluster.build()


def test_the_lab_refuses_clearly_where_it_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network, "lab_unavailable", lambda: None)
    monkeypatch.setattr(
        slurm.shutil, "which", lambda tool: None if tool in ("slurmd", "munged") else f"/usr/bin/{tool}"
    )
    reason = slurm.lab_unavailable() or ""
    assert "slurmd, munged" in reason and "apt-get install -y slurm-wlm munge" in reason
    with pytest.raises(LabError, match="cannot build the SLURM lab: the slurmd, munged command"):
        Cluster(2).build()
    monkeypatch.setattr(network, "lab_unavailable", lambda: "network namespaces need root (running as uid 1000)")
    assert slurm.lab_unavailable() == "network namespaces need root (running as uid 1000)"


def test_job_lines_and_node_lists_are_parsed() -> None:
    line = "JobId=7 JobName=x JobState=PENDING Reason=BeginTime Requeue=1 Restarts=2 ExitCode=0:15 RunTime=00:00:01"
    state = JobState.parse("7", line)
    assert (state.state, state.reason, state.restarts, state.exit_code, state.signal) == (
        "PENDING",
        "BeginTime",
        2,
        0,
        15,
    )
    assert not state.done and JobState.parse("7", "JobState=COMPLETED ExitCode=0:0").done
    assert slurm._expand("slab1n[0-1]") == ["slab1n0", "slab1n1"] and slurm._expand("a,b") == ["a", "b"]
    assert slurm._expand("n[0,2-3]") == ["n0", "n2", "n3"]
