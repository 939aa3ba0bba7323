"""Every node's machine checks as one report: ``lightning-mgpu doctor`` under ``srun`` or ``torchrun --nnodes``.

The first rank of each node runs the checks of :func:`lightning_mgpu.envcheck.collect` there and
rank 0 receives them all (the command gathers them: :mod:`lightning_mgpu.cli._across_nodes`).
:func:`merge` makes one list of them, in the order the checks run:

* a check with the same status and value on every node is one line, as on one machine, its
  value followed by ``(every node)``;
* one that differs and warns or fails somewhere is one line naming each node's value
  (``host0: ...; host1: ...``), with the worst status and that status's fix, saying on which node(s);
* one that is ``ok`` everywhere but differs (the launcher's rank variables, say) shows the first
  node's value and how many others differ; the JSON keeps every node's line (``details.per_node``);

and :func:`check_nodes` adds what only a view of every node can see: the same Python, torch,
Lightning and lightning_mgpu on every node (a mismatch fails: pickled objects and collectives
differ between releases), and the same number of ranks on every node (Lightning gives every
node the same ``devices``).

Pure: no torch, no process group; the input is plain data (each node's ``Check`` rows as dicts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from lightning_mgpu.envcheck.checks import STATUSES, Check

VERSIONED = ("python", "torch", "lightning")
"""Checks whose value starts with a version that must be the same on every node."""


@dataclass
class NodeChecks:
    """One node's part of the report: where it is, which ranks run there, its checks and the package version."""

    node: int
    hostname: str
    ranks: list[int]
    checks: list[dict[str, Any]] = field(default_factory=list)
    package: str = ""

    @property
    def label(self) -> str:
        return f"{self.hostname} (node {self.node})"


def _worst(statuses: Sequence[str]) -> str:
    return max(statuses, key=STATUSES.index)


def merge(nodes: Sequence[NodeChecks]) -> list[Check]:
    """One line per check across ``nodes`` (see the module docstring)."""
    order: list[str] = []
    rows: dict[str, list[tuple[NodeChecks, dict[str, Any]]]] = {}
    for node in nodes:
        for check in node.checks:
            if check["name"] not in rows:
                order.append(check["name"])
                rows[check["name"]] = []
            rows[check["name"]].append((node, check))
    merged = []
    for name in order:
        found = rows[name]
        status = _worst([check["status"] for _, check in found])
        values = {check["value"] for _, check in found}
        statuses = {check["status"] for _, check in found}
        details = {"per_node": {node.label: check for node, check in found}}
        missing = [node.label for node in nodes if node not in [n for n, _ in found]]
        if len(values) == 1 and len(statuses) == 1 and not missing:
            check = found[0][1]
            value = check["value"] + (" (every node)" if len(nodes) > 1 else "")
            merged.append(Check(name, status, value, fix=check.get("fix"), details=details))
            continue
        if status == "ok":
            others = len(found) - 1
            value = f"{found[0][0].hostname}: {found[0][1]['value']} ({others} other node(s) differ; --json lists each)"
        else:
            value = "; ".join(f"{node.hostname}: {check['value']}" for node, check in found)
        if missing:
            value += f"; not run on {', '.join(missing)}"
        worst = [(node, check) for node, check in found if check["status"] == status]
        fix = worst[0][1].get("fix")
        if fix:
            fix = f"on {', '.join(node.hostname for node, _ in worst)}: {fix}"
        elif status != "ok":  # pragma: no cover - every warn/fail carries a fix (Check enforces it)
            fix = "see each node's line"
        merged.append(Check(name, status, value, fix=fix, details=details))
    return merged


def _release(check: dict[str, Any]) -> str:
    return str(check["value"]).split()[0] if check.get("value") else "?"


def check_nodes(nodes: Sequence[NodeChecks]) -> Check:
    """The same releases and the same number of ranks on every node, and where each rank runs."""
    placement = "; ".join(f"{node.hostname}: rank(s) {_ranks(node.ranks)}" for node in nodes)
    details: dict[str, Any] = {
        "nodes": [{"node": n.node, "hostname": n.hostname, "ranks": n.ranks} for n in nodes],
    }
    differing = []
    for name in (*VERSIONED, "lightning_mgpu"):
        by_node = {
            node.hostname: node.package if name == "lightning_mgpu" else _release(_find(node, name)) for node in nodes
        }
        if len(set(by_node.values())) > 1:
            differing.append(f"{name} " + ", ".join(f"{version} on {host}" for host, version in by_node.items()))
    value = f"{len(nodes)} node(s): {placement}"
    if differing:
        return Check(
            "nodes",
            "fail",
            f"{value}; different releases: {'; '.join(differing)}",
            fix="install the same Python, torch, Lightning and lightning_mgpu on every node (one environment "
            "on a shared file system, or one container image): ranks of different releases pickle, check "
            "and communicate differently",
            details=details,
        )
    counts = {len(node.ranks) for node in nodes}
    if len(counts) > 1:
        return Check(
            "nodes",
            "warn",
            value + " (not the same number of ranks on every node)",
            fix="start the same number of ranks on every node (srun --ntasks-per-node=G, torchrun "
            "--nproc-per-node=G): Lightning's Trainer(devices=G, num_nodes=N) expects G on each",
            details=details,
        )
    return Check("nodes", "ok", value, details=details)


def _find(node: NodeChecks, name: str) -> dict[str, Any]:
    return next((check for check in node.checks if check["name"] == name), {})


def _ranks(ranks: Sequence[int]) -> str:
    ordered = sorted(ranks)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(str(r) for r in ordered)
