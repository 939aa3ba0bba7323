"""``dataloader-starving``: the step waits for data (time in the train loader's ``next()`` above a threshold)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional, TypedDict

import lightning as L
from torch.utils.data import DataLoader

from lightning_mgpu._compat.lightning import time_train_fetches
from lightning_mgpu.callbacks.doctor.findings import Finding
from lightning_mgpu.callbacks.doctor.probes import train_loader
from lightning_mgpu.callbacks.doctor.rule import Check, CheckKind, Rule, Watch
from lightning_mgpu.watch.hooks import local_ranks

RULE = Rule(
    "dataloader-starving",
    catches="the step waits for data: time in the train loader's next() above data_wait_threshold (25%) of "
    "the iteration time",
    detection="Lightning's fetch hooks timed on every rank between checks (each epoch's first 2 batches left out)",
    cost="two clock reads per batch",
    fix="more DataLoader workers (num_workers), persistent_workers=True, pin_memory=True on GPUs, or less work "
    "per sample",
    severity="wasteful",
)

EPOCH_EDGE_BATCHES = 2
"""Each epoch's first batches wait for the loader's workers to start: not timed."""


class LoaderInfo(TypedDict):
    """What bounds the train loader's speed on this rank (``local_world_size``: processes on this node)."""

    num_workers: int
    cpus: int
    local_world_size: int
    cuda: bool


class Timing(TypedDict):
    """Time spent since the last check: in the train loader's ``next()``, and in whole iterations."""

    fetch_s: float
    iteration_s: float
    batches: int


def describe_loader(loader: Optional[DataLoader[Any]], trainer: L.Trainer) -> LoaderInfo:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return {
        "num_workers": int(getattr(loader, "num_workers", 0) or 0),
        "cpus": cpus,
        "local_world_size": len(local_ranks(trainer)),  # processes on this node
        "cuda": trainer.strategy.root_device.type == "cuda",
    }


def check_data_wait(
    timings: Sequence[Timing], threshold: float, loaders: Sequence[Mapping[str, Any]], min_batches: int = 4
) -> Optional[Finding]:
    """``timings[r]``: {"fetch_s", "iteration_s", "batches"} since the last check."""
    shares = []
    for rank, timing in enumerate(timings):
        if timing.get("batches", 0) >= min_batches and timing.get("iteration_s", 0) > 0:
            shares.append((timing["fetch_s"] / timing["iteration_s"], rank, timing))
    starving = [(share, rank, t) for share, rank, t in shares if share > threshold]
    if not starving:
        return None
    share, rank, timing = max(starving)
    loader = loaders[rank] if loaders else {}
    workers = loader.get("num_workers")
    cpus, local_ranks = loader.get("cpus"), loader.get("local_world_size")
    fix = RULE.fix
    if workers == 0:
        fix = (
            f"num_workers=0: the samples are loaded in the training process, between steps. Use DataLoader("
            f"num_workers={max(1, min(8, (cpus or 2) // max(1, local_ranks or 1) - 1))}, persistent_workers=True"
            f"{', pin_memory=True' if loader.get('cuda') else ''}) ({cpus} CPUs for {local_ranks} rank(s) on this node)"
        )
    elif workers:
        fix = (
            f"the {workers} workers per rank do not keep up: raise num_workers (this node has {cpus} CPUs for "
            f"{local_ranks} rank(s)), set persistent_workers=True{', pin_memory=True' if loader.get('cuda') else ''}, "
            "or make __getitem__ cheaper (decode/resize once, offline)"
        )
    per_batch = 1e3 * timing["fetch_s"] / timing["batches"]
    step = 1e3 * timing["iteration_s"] / timing["batches"]
    return RULE.finding(
        seen=f"rank {rank} spent {share:.0%} of its training time waiting for the next batch "
        f"({per_batch:.1f} ms of a {step:.1f} ms iteration, over {int(timing['batches'])} batches; threshold "
        f"{threshold:.0%})",
        why="the devices idle while the loader works: adding devices will not make this run faster",
        fix=fix,
    )


class DataWait(Watch):
    """Times the train loader's ``next()`` against whole iterations (Lightning's fetch hooks, through
    ``_compat``, and each batch's start), each epoch's first :data:`EPOCH_EDGE_BATCHES` batches left out;
    sends the times since the last check at periodic checks and the end of training."""

    rules = (RULE,)

    def reset(self) -> None:
        super().reset()
        self.undo: Optional[Callable[[], None]] = None
        self.last_fetch_s = 0.0
        self.last_batch_start: Optional[float] = None
        self.timing = Timing(fetch_s=0.0, iteration_s=0.0, batches=0)

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.setup = describe_loader(train_loader(trainer), trainer)
        self.undo = time_train_fetches(trainer, self._fetched)
        if self.undo is None:
            self.doctor.cannot_check(RULE.id, "the train loader's fetches cannot be timed")

    def _fetched(self, seconds: float) -> None:
        self.last_fetch_s = seconds

    def batch_start(self, trainer: L.Trainer, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self.last_batch_start is not None and batch_idx >= EPOCH_EDGE_BATCHES:
            self.timing["iteration_s"] += now - self.last_batch_start
            self.timing["fetch_s"] += self.last_fetch_s
            self.timing["batches"] += 1
        self.last_batch_start, self.last_fetch_s = now, 0.0

    def report(self, trainer: L.Trainer, kind: CheckKind) -> Any:
        if kind not in ("periodic", "train_end"):
            return None
        timing, self.timing = self.timing, Timing(fetch_s=0.0, iteration_s=0.0, batches=0)
        return timing

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        if reports[0] is not None:
            yield check_data_wait(reports, self.doctor.data_wait_threshold, self.setups)

    def finish(self) -> None:
        if self.undo is not None:
            self.undo()
            self.undo = None
