"""Rank states as the watch publishes them, made up for the pure tests of the verdict, the diagnosis and the report."""

from __future__ import annotations

from typing import Any, Optional

from lightning_mgpu.watch.sampling import Frame
from lightning_mgpu.watch.state import RankState

USER = "/project/train.py"
LIGHTNING = "/venv/site-packages/lightning/pytorch/loops/training_epoch_loop.py"


def collective(kind: str, seq: int, for_s: float = 25.0, size: int = 2) -> dict[str, Any]:
    return {"kind": kind, "seq": seq, "group_size": size, "for_s": for_s}


def state(rank: int, phase: str = "forward", *, idle: float = 0.0, **fields: Any) -> RankState:
    """A watching rank in ``fit``, batch 2 of 6, ``idle`` seconds without progress."""
    defaults: dict[str, Any] = {
        "stage": "fit",
        "batch": 2,
        "batches": 6,
        "batches_done": 2,
        "backwards": 3,
        "host": "node0 4026531836",
        "pid": 1000 + rank,
    }
    defaults.update(fields)
    return RankState(rank=rank, phase=phase, idle_s=idle, **defaults)


def at(line: int, function: str = "training_step", file: str = USER) -> Frame:
    return Frame(file, line, function)


def in_barrier(rank: int, *, idle: float = 25.0, site: Optional[Frame] = None, seq: int = 7) -> RankState:
    """Blocked in ``barrier()`` called from the user's training_step."""
    return state(rank, idle=idle, collective=collective("barrier", seq), site=site or at(40), in_hook=True)


def in_backward(rank: int, *, idle: float = 25.0) -> RankState:
    """Blocked in DDP's gradient all-reduce (no Python collective on its stack)."""
    return state(rank, "backward", idle=idle, site=at(90, "main"), in_hook=False)
