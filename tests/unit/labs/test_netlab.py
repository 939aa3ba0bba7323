"""The network lab's logic without building anything: a fake runner records the ``ip``/``tc`` commands.

What a lab is made of (names, addresses, shaping on both ends), what happens when a command
fails half-way (everything made so far is removed), the refusal when it cannot be built, the
torchrun command per node and the stale-namespace sweep. The real thing, with namespaces, is
tests/dist/labs/test_netlab.py.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from pathlib import Path
from typing import Sequence

import pytest

from bench.harness.launch import rank_env, torchrun_argv
from bench.labs import network
from bench.labs.network import Lab, LabError, parse_gbps, remove_stale, tbf_rate


class FakeRunner:
    """Records every command; fails the one containing ``fail_on``."""

    def __init__(self, fail_on: str = "", listing: str = "") -> None:
        self.commands: list[list[str]] = []
        self.fail_on = fail_on
        self.listing = listing

    def __call__(self, argv: Sequence[str]) -> str:
        self.commands.append(list(argv))
        line = " ".join(argv)
        if self.fail_on and self.fail_on in line:
            raise LabError(f"{line} failed: simulated")
        if list(argv) == ["ip", "netns", "list"]:
            return self.listing
        return ""

    def lines(self) -> list[str]:
        return [" ".join(c) for c in self.commands]


def test_two_nodes_are_a_shaped_veth_pair_with_loopback_range_addresses() -> None:
    runner = FakeRunner()
    lab = Lab(2, [1.0, 2.5], runner=runner).build()
    lines = runner.lines()
    a, b = lab.nodes
    assert a.namespace != b.namespace and a.namespace.startswith(f"nlab-{os.getpid()}-")
    assert all(len(node.interface) <= 15 for node in lab.nodes)  # the kernel's limit for interface names
    for node in lab.nodes:
        address = ipaddress.ip_interface(node.address)
        assert address.ip.is_loopback and address.network.prefixlen == 30
        assert f"ip netns exec {node.namespace} sysctl -qw net.ipv4.conf.all.route_localnet=1" in lines
    assert lab.master_addr == "127.78.0.1" and lab.address(1) == "127.78.0.2"
    assert (
        f"ip link add {a.interface} netns {a.namespace} type veth peer name {b.interface} netns {b.namespace}" in lines
    )
    shaping = [line for line in lines if " tc qdisc add " in line]
    assert shaping == [
        f"ip netns exec {a.namespace} tc qdisc add dev {a.interface} root tbf rate 1000mbit burst 256kb latency 50ms",
        f"ip netns exec {b.namespace} tc qdisc add dev {b.interface} root tbf rate 2500mbit burst 256kb latency 50ms",
    ]
    lab.set_rates(0.1)
    assert lines != runner.lines() and runner.lines()[-1].endswith("tbf rate 100mbit burst 256kb latency 50ms")
    assert "qdisc replace" in runner.lines()[-1]
    lab.teardown()
    assert runner.lines()[-2:] == [f"ip netns delete {b.namespace}", f"ip netns delete {a.namespace}"]
    count = len(runner.commands)
    lab.teardown()  # idempotent
    assert len(runner.commands) == count
    with pytest.raises(LabError, match="already built"):
        lab.build()


def test_more_nodes_meet_at_a_bridge_shaped_on_both_ends_of_every_link() -> None:
    runner = FakeRunner()
    lab = Lab(3, 1.0, runner=runner).build()
    assert lab.switch is not None
    lines = runner.lines()
    assert f"ip netns exec {lab.switch} ip link add br0 type bridge" in lines
    for node in lab.nodes:
        assert node.address.endswith("/24") and node.switch_port is not None
        assert f"ip netns exec {lab.switch} ip link set {node.switch_port} master br0" in lines
    assert sum(" tc qdisc add " in line for line in lines) == 6
    lab.teardown()
    assert sum(line.startswith("ip netns delete") for line in runner.lines()) == 4


def test_a_failure_half_way_removes_what_was_made() -> None:
    runner = FakeRunner(fail_on="tc qdisc add")
    lab = Lab(2, 1.0, runner=runner)
    with pytest.raises(LabError, match="simulated"):
        lab.build()
    made = [c[3] for c in runner.commands if c[:3] == ["ip", "netns", "add"]]
    deleted = [c[3] for c in runner.commands if c[:3] == ["ip", "netns", "delete"]]
    assert made and sorted(made) == sorted(deleted)


def test_the_lab_refuses_clearly_where_it_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    assert "tc" in (network.lab_unavailable() or "") and "iproute2" in (network.lab_unavailable() or "")
    with pytest.raises(LabError, match="cannot build the network lab: the tc command"):
        Lab(2, 1.0).build()
    monkeypatch.setattr(network.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(network.os, "geteuid", lambda: 1000)
    assert "root" in (network.lab_unavailable() or "") and "uid 1000" in (network.lab_unavailable() or "")


def test_rates_and_node_counts_are_checked() -> None:
    assert parse_gbps("2.5") == 2.5 and parse_gbps("100mbit") == pytest.approx(0.1) and parse_gbps(10) == 10
    assert parse_gbps("10gbit") == 10 and tbf_rate(2.5) == "2500mbit" and tbf_rate(0.0004) == "1mbit"
    with pytest.raises(ValueError, match="'fast' is not a rate"):
        parse_gbps("fast")
    with pytest.raises(ValueError, match="outside"):
        parse_gbps(1000)
    with pytest.raises(ValueError, match="one per node"):
        Lab(2, [1.0, 1.0, 1.0], runner=FakeRunner())
    with pytest.raises(ValueError, match="nodes must be"):
        Lab(1, 1.0, runner=FakeRunner())


def test_each_node_runs_torchrun_static_with_gloo_on_its_link() -> None:
    lab = Lab(2, 1.0, runner=FakeRunner())
    argv = torchrun_argv(["train.py", "--x"], nproc_per_node=2, lab=lab, node=1, port=29555)
    assert argv[:4] == ["ip", "netns", "exec", lab.nodes[1].namespace]
    for flag in (
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=2",
        "--master-addr=127.78.0.1",
        "--master-port=29555",
        "--rdzv-backend=static",
    ):
        assert flag in argv
    assert argv[-2:] == ["train.py", "--x"]
    env = rank_env(threads=3, lab=lab, node=1, extra={"FOO": "1"})
    assert env["GLOO_SOCKET_IFNAME"] == lab.nodes[1].interface and env["OMP_NUM_THREADS"] == "3" and env["FOO"] == "1"
    assert "MASTER_ADDR" not in env and "RANK" not in env


def test_stale_namespaces_of_dead_runs_are_removed_and_live_ones_kept() -> None:
    dead = 2**22 + 17  # above any pid_max default: no such process
    listing = f"nlab-{dead}-abc123-n0 (id: 3)\nnlab-{os.getpid()}-abc123-n0\nsomeone-else\nnlab-{dead}-abc123-sw\n"
    runner = FakeRunner(listing=listing)
    assert remove_stale(runner) == [f"nlab-{dead}-abc123-n0", f"nlab-{dead}-abc123-sw"]
    assert not any("someone-else" in line or f"nlab-{os.getpid()}" in line for line in runner.lines()[1:])


def test_the_command_refuses_clearly_and_checks_its_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import netlab

    monkeypatch.setattr(netlab, "lab_unavailable", lambda: "network namespaces need root (running as uid 1000)")
    assert netlab.main(["--measure"]) == 2
    assert "netlab: cannot build the network lab: network namespaces need root" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        netlab.parse_args([])  # nothing to run
    assert "give a target after '--'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        netlab.parse_args(["--sweep", "--options", "ddp,zip"])
    assert "unknown ['zip']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        netlab.parse_args(["--sweep", "--rates", "1,fast"])
    assert "'fast' is not a rate" in capsys.readouterr().err
    args = netlab.parse_args(["--gbps", "10,1", "--nproc-per-node", "2", "--", "-m", "mod", "--x"])
    assert args.gbps == [10.0, 1.0] and args.target == ["-m", "mod", "--x"] and args.nproc_per_node == 2
    quick = netlab.parse_args(["--sweep", "--quick", "--steps", "7"])
    assert quick.rates == [1.0] and quick.models == ["mlp"] and quick.steps == 7 and quick.rounds == 1


def _sweep_report(path: Path, rates: list[float], losses: list[dict[str, object]]) -> dict[str, object]:
    """A sweep report as ``--sweep --quick`` writes it: one run per rate of ddp and fp16 on the MLP."""
    from bench.netlab_sweep import QUICK

    runs = [
        {"model": "mlp", "option": option, "rate_gbps": rate, "round": 0, "step_ms": [9.0, 9.0, ms, ms, ms]}
        for rate in rates
        for option, ms in (("ddp", 100.0 / rate), ("fp16", 60.0 / rate))
    ]
    links = [{"configured_gbps": rate, "measured_gbps": [rate * 0.95, rate * 0.96], "round": 0} for rate in rates]
    settings = {
        "models": ["mlp"],
        "options": ["ddp", "fp16"],
        "rates": rates,
        "rounds": 1,
        **{key: QUICK[key] for key in ("steps", "auto_steps", "warmup", "loss_steps")},
        "quick": True,
    }
    report = {
        "benchmark": "netlab_sweep",
        "settings": settings,
        "raw": {"runs": runs, "links": links, "losses": losses},
    }
    path.write_text(json.dumps({**report, "rows": [], "wall_s": 60.0}))
    return report


def test_a_rate_is_added_to_an_existing_sweep_keeping_its_losses(tmp_path: Path) -> None:
    """``--sweep --rates 0.1 --add-to REPORT``: the report's rows gain the rate; its losses and rounds stand."""
    from bench import netlab
    from bench.netlab_sweep import analyse, merge

    losses = [
        {"model": "mlp", "option": "ddp", "eval_loss": 0.5},
        {"model": "mlp", "option": "fp16", "eval_loss": 0.51},
    ]
    existing = _sweep_report(tmp_path / "sweep.json", [1.0, 10.0], losses)
    args = netlab.parse_args(
        ["--sweep", "--quick", "--options", "ddp,fp16", "--rates", "0.1", "--add-to", str(tmp_path / "sweep.json")]
    )
    added = _sweep_report(tmp_path / "new.json", [0.1], [])["raw"]
    raw, settings = merge(existing, added, args)  # type: ignore[arg-type]
    assert settings["rates"] == [0.1, 1.0, 10.0]
    assert settings["rounds_by_rate"] == {"0.1": 1, "1": 1, "10": 1}
    assert settings["added"] == [{"rates": [0.1], "rounds": 1}]
    assert raw["losses"] == losses  # the loss does not depend on the link: the first run's stands
    rows = analyse(raw, argparse.Namespace(**{**vars(args), "rates": settings["rates"]}))
    slow = {row["option"]: row for row in rows if row["rate_gbps"] == 0.1}
    assert slow["ddp"]["step_ms"] == pytest.approx(1000.0) and slow["fp16"]["speedup_vs_ddp"] == pytest.approx(
        1000 / 600
    )
    assert slow["fp16"]["eval_loss"] == 0.51 and slow["ddp"]["measured_gbps"] == pytest.approx(0.0955)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rates", "1"], "already has 1 Gbit/s"),
        (["--rates", "0.1", "--steps", "9"], "steps: 5 there, 9 here"),
        (["--rates", "0.1", "--options", "ddp"], "options: ['ddp', 'fp16'] there, ['ddp'] here"),
    ],
)
def test_adding_to_a_sweep_refuses_rows_that_would_not_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from bench import netlab

    _sweep_report(tmp_path / "sweep.json", [1.0, 10.0], [])
    base = ["--sweep", "--quick", "--options", "ddp,fp16", "--add-to", str(tmp_path / "sweep.json")]
    with pytest.raises(SystemExit):
        netlab.parse_args([*base, *argv])
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        netlab.parse_args(["--measure", "--add-to", str(tmp_path / "sweep.json")])
    assert "only with --sweep" in capsys.readouterr().err
