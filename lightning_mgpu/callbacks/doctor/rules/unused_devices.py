"""``unused-devices``: more GPUs visible than the run uses (or GPUs visible while training on CPU)."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, TypedDict

import lightning as L
import torch

from lightning_mgpu.callbacks.doctor.findings import Finding
from lightning_mgpu.callbacks.doctor.rule import Check, Rule, Watch

RULE = Rule(
    "unused-devices",
    catches="more GPUs visible than the run uses (or GPUs visible while training on CPU)",
    detection="at fit start: torch.cuda.device_count() against the devices this node's Trainer uses",
    cost="none (once)",
    fix="Trainer(devices=-1) uses every visible GPU; if sharing the machine is intended, hide the others "
    "with CUDA_VISIBLE_DEVICES",
    severity="wasteful",
)


class DeviceInfo(TypedDict):
    """The devices one rank's node offers and this run uses: the root device's ``type`` (``"cuda"``, ``"cpu"``,
    ...), the devices the Trainer ``used`` on this node, the GPUs visible there."""

    node: str
    type: str
    used: int
    cuda_visible: int


def cuda_device_count() -> int:
    """GPUs this process can see (a module-level function so tests can stand in for a GPU machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_unused_devices(devices: Sequence[Mapping[str, Any]]) -> Optional[Finding]:
    """``devices[r]``: rank ``r``'s :class:`DeviceInfo`."""
    seen_nodes: dict[str, Mapping[str, Any]] = {}
    for info in devices:
        seen_nodes.setdefault(str(info.get("node")), info)
    problems = []
    for node, info in seen_nodes.items():
        visible, used, kind = int(info.get("cuda_visible", 0)), int(info.get("used", 0)), info.get("type")
        if kind != "cuda" and visible > 0:
            problems.append(f"{node}: {visible} GPU(s) visible, but the run trains on {kind} ({used} process(es))")
        elif kind == "cuda" and visible > used:
            problems.append(f"{node}: {visible} GPUs visible, the run uses {used}")
    if not problems:
        return None
    return RULE.finding(
        seen="; ".join(problems),
        why="the idle GPUs add nothing; the same job could run that many times faster",
        fix="Trainer(accelerator='gpu', devices=-1) to use every visible GPU (the global batch grows with it: "
        "adjust the learning rate), or hide the GPUs you leave to others with CUDA_VISIBLE_DEVICES",
    )


class UnusedDevices(Watch):
    rules = (RULE,)

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.setup = DeviceInfo(
            node=socket.gethostname(),
            type=trainer.strategy.root_device.type,
            used=len(trainer.device_ids),
            cuda_visible=cuda_device_count(),
        )

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        if check.first:
            yield check_unused_devices(self.setups)
