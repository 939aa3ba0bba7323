"""A network lab on one machine: N "nodes" (network namespaces) joined by rate-limited links.

Every figure taken on one machine's loopback says communication is nearly free; on real
clusters, nodes talk over 1-25 Gbit/s Ethernet. This module builds that regime for real
with the kernel's own network stack, so that the same training script runs as N nodes:

* one network namespace per node, named ``nlab-<pid>-<random>-n<i>`` (two runs never collide,
  and a later run can tell a dead run's leftovers by its pid: :func:`remove_stale`);
* two nodes: one veth pair between them; more nodes: a ``switch`` namespace with a bridge and
  one veth pair per node;
* addresses from the loopback range only (``127.78.0.<i+1>``, never a private or public range),
  which the kernel routes off ``lo`` once ``net.ipv4.conf.all.route_localnet=1`` is set inside
  the namespace (a ``/30`` per pair, a ``/24`` on a switch: longer than ``lo``'s ``127.0.0.0/8``,
  so the link wins the route lookup);
* each link limited by a token-bucket filter on *both* ends (``tc qdisc ... tbf rate R burst
  256kb latency 50ms``; ``netem`` is not available in every kernel, ``tbf`` is), so each
  direction has its own rate (asymmetric links: one rate per node's upload);
* :meth:`Lab.measure_link`: the rate actually achieved, by a raw TCP transfer between two
  nodes (a tbf at 10 Gbit/s on a busy 2-core machine gives less than it promises: every
  result states the measured rate beside the configured one);
* :func:`bench.harness.launch.run`: any training script as N nodes, one
  ``torchrun --nnodes=N --node-rank=i --master-addr=<node 0> --rdzv-backend=static`` per
  namespace, with ``GLOO_SOCKET_IFNAME`` set to that namespace's link.

Teardown is not optional: :class:`Lab` is a context manager, registers an ``atexit`` handler,
and :func:`handle_signals` turns SIGTERM/SIGHUP into an exception so ``finally`` runs; the
namespaces of a run killed with SIGKILL are removed by a lab built 10 minutes later, or at
once by ``python -m bench.netlab --cleanup`` (:func:`remove_stale`).
Building needs root and the ``ip`` and ``tc`` commands: :func:`lab_unavailable` says why not.

No torch import here: this module is also the link's probe, started inside two nodes by
:meth:`Lab.measure_link` (it starts in a blink)::

    ip netns exec NODE1 python -m bench.labs.network --receive 127.78.0.2 29001 125000000
    ip netns exec NODE0 python -m bench.labs.network --send 127.78.0.2 29001 125000000

The receiver prints ``{"bytes": ..., "seconds": ...}`` timed from the first chunk to the last
(connection set-up is no part of a link's rate).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from bench import REPO_ROOT, pythonpath_with_repo

PREFIX = "nlab"
PREFIXES = (PREFIX, "slab")
"""Every lab's namespace prefix: this lab's, and the SLURM lab's (:mod:`bench.labs.slurm`), which builds on this one."""
SUBNET = "127.78.0"
"""Node i has ``127.78.0.<i+1>``: loopback range, never a private or public address."""
BURST = "256kb"
LATENCY = "50ms"


_NAME = re.compile(rf"^(?:{'|'.join(PREFIXES)})-(\d+)-[0-9a-f]+-(?:n\d+|sw)$")

Runner = Callable[[Sequence[str]], str]
"""Runs a command (argv), returns its stdout, raises :class:`LabError` on failure."""


class LabError(RuntimeError):
    """The lab cannot be built or used; the message says what was missing and how to fix it."""


def run_command(argv: Sequence[str]) -> str:
    """The default :data:`Runner`: ``subprocess.run``, errors as :class:`LabError` with the command's stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LabError(f"{' '.join(argv)}: {error}") from None
    if done.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed (exit code {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def lab_unavailable() -> Optional[str]:
    """Why no lab can be built here (not root, ``ip``/``tc`` missing), or None when it can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the {' and '.join(missing)} command(s) are missing: install iproute2 (e.g. apt-get install iproute2)"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()}): run as root, e.g. with sudo"
    return None


def parse_gbps(text: Union[str, float]) -> float:
    """A link rate in Gbit/s from ``2.5``, ``"2.5"``, ``"2.5gbit"``, ``"100mbit"``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gbit|mbit|g|m)?\s*", str(text).lower())
        if match is None:
            raise ValueError(f"link rate {text!r} is not a rate; write it in Gbit/s (e.g. 2.5) or as 100mbit / 10gbit")
        value = float(match.group(1)) / (1000.0 if match.group(2) in ("mbit", "m") else 1.0)
    if not 0.001 <= value <= 400:
        raise ValueError(f"link rate {text!r} is outside 1 Mbit/s .. 400 Gbit/s")
    return value


def tbf_rate(gbps: float) -> str:
    """``tc``'s spelling of a rate: whole Mbit/s (tbf takes no fractions)."""
    return f"{max(1, round(gbps * 1000))}mbit"


def remove_stale(runner: Runner = run_command, *, min_age_s: float = 0.0) -> list[str]:
    """Delete lab namespaces (of every lab: :data:`PREFIXES`) whose creating process is gone (a run killed with
    SIGKILL), with every process left in them; returns their names.

    ``min_age_s``: leave younger ones alone. A new lab passes 10 minutes: where the namespace
    list is shared with another pid namespace (a container), a live run there looks dead here.
    """
    removed = []
    for line in runner(["ip", "netns", "list"]).splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NAME.match(name)
        if match is None or _alive(int(match.group(1))) or _age_s(name) < min_age_s:
            continue
        _kill_namespace_processes(name, runner)
        try:
            runner(["ip", "netns", "delete", name])
            removed.append(name)
        except LabError:
            pass
    return removed


def _age_s(namespace: str) -> float:
    try:
        return time.time() - os.stat(f"/run/netns/{namespace}").st_mtime
    except OSError:
        return float("inf")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str, runner: Runner) -> None:
    try:
        pids = [int(p) for p in runner(["ip", "netns", "pids", namespace]).split()]
    except (LabError, ValueError):
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@dataclass(frozen=True)
class Node:
    """One node: its namespace, the interface its traffic leaves by, and its address there."""

    index: int
    namespace: str
    interface: str
    address: str
    switch_port: Optional[str] = None
    """The link's other end in the switch namespace (more than two nodes), else None."""

    def exec_prefix(self) -> list[str]:
        """Prefix an argv with this to run it inside the node."""
        return ["ip", "netns", "exec", self.namespace]


@dataclass(frozen=True)
class LinkMeasurement:
    """A raw TCP transfer from one node to another."""

    source: int
    destination: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "from": self.source,
            "to": self.destination,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "gbps": self.gbps,
        }


class Lab:
    """N nodes joined by rate-limited links; build with ``with Lab(...) as lab:`` (always torn down).

    Args:
        nodes: how many namespaces (2: one veth pair; more: a bridge in a switch namespace).
        gbps: each node's upload rate in Gbit/s, one number for all or one per node
            (asymmetric links); every link end is shaped, so a node's download is limited by
            the senders' upload (and, behind a switch, by its port's rate too).
        runner: runs ``ip``/``tc`` (tests pass a fake one).
        prefix: the namespaces' prefix, one of :data:`PREFIXES` (the SLURM lab passes its own).
    """

    def __init__(
        self,
        nodes: int = 2,
        gbps: Union[float, Sequence[float]] = 1.0,
        *,
        runner: Runner = run_command,
        prefix: str = PREFIX,
    ) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= 200:
            raise ValueError(f"nodes must be an integer in 2..200, got {nodes!r}")
        if prefix not in PREFIXES:
            raise ValueError(f"prefix must be one of {PREFIXES} (remove_stale finds those), got {prefix!r}")
        self.rates = self._rates(gbps, nodes)
        self.runner = runner
        self.tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        short = self.tag.rsplit("-", 1)[1]  # interface names have at most 15 characters
        letter = prefix[0]  # nl...: the network lab's links, sl...: the SLURM lab's
        switched = nodes > 2
        mask = 24 if switched else 30
        self.nodes = [
            Node(
                index=i,
                namespace=f"{self.tag}-n{i}",
                interface=f"{letter}l{short}n{i}",
                address=f"{SUBNET}.{i + 1}/{mask}",
                switch_port=f"{letter}l{short}s{i}" if switched else None,
            )
            for i in range(nodes)
        ]
        self.switch = f"{self.tag}-sw" if switched else None
        self.created: list[str] = []
        self._torn_down = False

    @staticmethod
    def _rates(gbps: Union[float, Sequence[float]], nodes: int) -> list[float]:
        rates = [parse_gbps(gbps)] * nodes if isinstance(gbps, (int, float, str)) else [parse_gbps(g) for g in gbps]
        if len(rates) != nodes:
            raise ValueError(f"gbps: give one rate or one per node ({nodes}), got {len(rates)}: {list(gbps)!r}")  # type: ignore[arg-type]
        return rates

    # ------------------------------------------------------------------ addresses

    @property
    def master_addr(self) -> str:
        """Node 0's address (torchrun's ``--master-addr``)."""
        return self.nodes[0].address.split("/")[0]

    def address(self, index: int) -> str:
        return self.nodes[index].address.split("/")[0]

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Lab:
        if not self.created:  # ``with Lab(...).build() as lab`` builds once
            self.build()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def build(self) -> Lab:
        """Create namespaces, links, addresses and shaping; on any failure remove what was made and raise."""
        if self._torn_down or self.created:
            raise LabError(
                f"lab {self.tag} was already built{' and torn down' if self._torn_down else ''}; make a new Lab"
            )
        reason = lab_unavailable() if self.runner is run_command else None
        if reason is not None:
            raise LabError(f"cannot build the network lab: {reason}")
        atexit.register(self.teardown)
        try:
            if self.runner is run_command:
                remove_stale(self.runner, min_age_s=600)
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def _ip(self, namespace: Optional[str], *argv: str) -> str:
        prefix = ["ip", "netns", "exec", namespace] if namespace else []
        return self.runner([*prefix, *argv])

    def _namespace(self, name: str) -> None:
        self.runner(["ip", "netns", "add", name])
        self.created.append(name)
        self._ip(name, "ip", "link", "set", "lo", "up")

    def _veth(self, end: str, namespace: str, peer: str, peer_namespace: str) -> None:
        """A veth pair: ``end`` inside ``namespace``, ``peer`` inside ``peer_namespace`` (names hold no spaces)."""
        self.runner(f"ip link add {end} netns {namespace} type veth peer name {peer} netns {peer_namespace}".split())

    def _build(self) -> None:
        for node in self.nodes:
            self._namespace(node.namespace)
            self._ip(node.namespace, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1")
        if self.switch is None:
            a, b = self.nodes
            self._veth(a.interface, a.namespace, b.interface, b.namespace)
        else:
            self._namespace(self.switch)
            self._ip(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            self._ip(self.switch, "ip", "link", "set", "br0", "up")
            for node in self.nodes:
                assert node.switch_port is not None
                self._veth(node.interface, node.namespace, node.switch_port, self.switch)
                self._ip(self.switch, "ip", "link", "set", node.switch_port, "master", "br0")
                self._ip(self.switch, "ip", "link", "set", node.switch_port, "up")
        for node in self.nodes:
            self._ip(node.namespace, "ip", "addr", "add", node.address, "dev", node.interface)
            self._ip(node.namespace, "ip", "link", "set", node.interface, "up")
        self.set_rates(self.rates, change=False)

    def set_rates(self, gbps: Union[float, Sequence[float]], *, change: bool = True) -> None:
        """Shape every link end: node i's upload at ``gbps[i]``, its switch port (download) at the same."""
        self.rates = self._rates(gbps, len(self.nodes))
        verb = "replace" if change else "add"
        for node, rate in zip(self.nodes, self.rates):
            shape = ["root", "tbf", "rate", tbf_rate(rate), "burst", BURST, "latency", LATENCY]
            self._ip(node.namespace, "tc", "qdisc", verb, "dev", node.interface, *shape)
            if self.switch is not None and node.switch_port is not None:
                self._ip(self.switch, "tc", "qdisc", verb, "dev", node.switch_port, *shape)

    def teardown(self) -> None:
        """Kill every process left in the namespaces and delete them (idempotent; never raises)."""
        if self._torn_down:
            return
        self._torn_down = True
        for name in reversed(self.created):
            _kill_namespace_processes(name, self.runner)
        problems = []
        for name in reversed(self.created):
            try:
                self.runner(["ip", "netns", "delete", name])
            except LabError as error:
                problems.append(str(error))
        self.created = []
        try:
            atexit.unregister(self.teardown)
        except Exception:  # interpreter shutting down
            pass
        if problems:
            print(f"netlab: teardown left something behind: {'; '.join(problems)}", file=sys.stderr)

    # ------------------------------------------------------------------ measuring

    def traffic(self, node: int) -> dict[str, int]:
        """Bytes sent and received so far on a node's link (the kernel's interface counters)."""
        interface = self.nodes[node].interface
        counters = {}
        for name in ("tx_bytes", "rx_bytes"):
            path = f"/sys/class/net/{interface}/statistics/{name}"
            counters[name] = int(self._ip(self.nodes[node].namespace, "cat", path).strip())
        return counters

    def measure_both_ways(self, seconds: float = 1.0) -> dict[str, Any]:
        """The link between nodes 0 and 1, each way: ``{"configured_gbps", "measured_gbps": [0->1, 1->0]}``."""
        there, back = self.measure_link(0, 1, seconds=seconds), self.measure_link(1, 0, seconds=seconds)
        return {"configured_gbps": min(self.rates[:2]), "measured_gbps": [there.gbps, back.gbps]}

    def measure_link(
        self, source: int = 0, destination: int = 1, *, seconds: float = 1.0, timeout: float = 60
    ) -> LinkMeasurement:
        """Send about ``seconds`` worth of data at the configured rate from one node to another over TCP."""
        total = int(min(self.rates[source], self.rates[destination]) * 1e9 / 8 * seconds)
        total = max(total, 1 << 20)
        port = 29000 + secrets.randbelow(2000)
        probe = [sys.executable, "-m", "bench.labs.network"]
        env = {**os.environ, "PYTHONPATH": pythonpath_with_repo()}
        receiver = subprocess.Popen(
            [
                *self.nodes[destination].exec_prefix(),
                *probe,
                "--receive",
                self.address(destination),
                str(port),
                str(total),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO_ROOT,
        )
        try:
            sender = subprocess.run(
                [*self.nodes[source].exec_prefix(), *probe, "--send", self.address(destination), str(port), str(total)],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                cwd=REPO_ROOT,
            )
            out, err = receiver.communicate(timeout=timeout)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.communicate()
        if sender.returncode != 0 or receiver.returncode != 0:
            raise LabError(f"link measurement {source} -> {destination} failed:\n{sender.stderr}\n{err}")
        report = json.loads(out)
        return LinkMeasurement(source, destination, int(report["bytes"]), float(report["seconds"]))


def handle_signals() -> None:
    """SIGTERM and SIGHUP raise ``SystemExit`` and SIGINT ``KeyboardInterrupt``, so ``finally`` tears down.

    SIGINT is set explicitly: a process started in the background by a shell without job
    control (``nohup ... &``) inherits SIGINT ignored, and Python then never raises
    ``KeyboardInterrupt``: ``kill -INT`` would leave the namespaces behind.
    """

    def stop(signum: int, _: Any) -> None:
        raise SystemExit(f"netlab: stopped by signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ----------------------------------------------------------------------------- the link probe (inside a node)
def _receive(host: str, port: int, total: int) -> dict[str, Any]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, port))
        server.listen(1)
        server.settimeout(30)
        connection, _ = server.accept()
        with connection:
            buffer = bytearray(1 << 20)
            received, first, start = 0, 0, 0.0
            while received < total:
                count = connection.recv_into(buffer)
                if count == 0:
                    break
                if received == 0:  # time from the first chunk: connection set-up is no part of the rate
                    start, first = time.perf_counter(), count
                received += count
            elapsed = time.perf_counter() - start
    return {"bytes": received - first, "seconds": elapsed}


def _send(host: str, port: int, total: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = socket.create_connection((host, port), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with connection:
        chunk = b"\0" * (1 << 20)
        sent = 0
        while sent < total:
            sent += connection.send(chunk[: min(len(chunk), total - sent)])


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="the network lab's link probe (run inside a node by Lab.measure_link)")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--receive", nargs=3, metavar=("HOST", "PORT", "BYTES"))
    group.add_argument("--send", nargs=3, metavar=("HOST", "PORT", "BYTES"))
    args = parser.parse_args(argv)
    if args.receive:
        host, port, total = args.receive
        print(json.dumps(_receive(host, int(port), int(total))))
    else:
        host, port, total = args.send
        _send(host, int(port), int(total))


if __name__ == "__main__":
    main()
