"""The package's own state in checkpoints: ``checkpoint["lightning_mgpu"]``.

What ``TunedDDPStrategy`` stores: the bucket caps in force, the compression, with
``bucket_cap_mb="auto"`` the search's record (a resumed fit reuses the size and does not tune
again), and PowerSGD's memory (error feedback per rank, Q per parameter), so that a resume
continues the same run. Everything is plain data (``weights_only`` loading works).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mgpu.comm.powersgd_memory import PowerSGDLayoutKeeper
from lightning_mgpu.tuning.tuner import DONE, RESUMED, WAITING, BucketTuner

CHECKPOINT_KEY = "lightning_mgpu"
"""Top-level checkpoint key under which the package stores its own state."""


def restore_tuned_size(tuner: Optional[BucketTuner], package: dict[str, Any]) -> Optional[float]:
    """The tuned bucket size to reuse from a checkpoint (the tuner is told), or None to tune again."""
    record = package.get("tuning")
    if tuner is None or tuner.status != WAITING or not isinstance(record, dict):
        return None
    size = package.get("bucket_cap_mb")
    valid = isinstance(size, (int, float)) and not isinstance(size, bool) and math.isfinite(size) and size > 0
    if record.get("status") in (DONE, RESUMED) and valid:
        tuner.resume(float(size), record)  # type: ignore[arg-type]
        return float(size)  # type: ignore[arg-type]
    return None  # saved before the search finished: search again (the steps are ordinary ones)


def gather_powersgd_state(keeper: PowerSGDLayoutKeeper, world_size: int) -> dict[str, Any]:
    """PowerSGD's memory for the checkpoint; a collective that every rank enters."""
    state = keeper.state_dict()
    error = state.pop("error")
    if torch.distributed.is_available() and torch.distributed.is_initialized() and world_size > 1:
        gathered: list[Any] = [None] * world_size
        torch.distributed.all_gather_object(gathered, error)
    else:
        gathered = [error]
    # Each rank's residual is its own; Q and the counters are the same everywhere.
    return {**state, "world_size": world_size, "error_per_rank": gathered}


def restore_powersgd_state(
    keeper: PowerSGDLayoutKeeper, saved: dict[str, Any], *, world_size: int, global_rank: int, owner: str
) -> None:
    """Load checkpointed PowerSGD memory into ``keeper``; warn about what cannot be used."""
    per_rank = saved.get("error_per_rank") or []
    error = None
    if saved.get("world_size") == world_size and global_rank < len(per_rank):
        error = per_rank[global_rank]
    else:
        rank_zero_warn(
            f"{owner}: the checkpoint's PowerSGD error feedback comes from {saved.get('world_size')} "
            f"processes, this run has {world_size}; it starts again from zero."
        )
    rejected = keeper.load_state_dict(saved, error)
    if rejected:
        rank_zero_warn(
            f"{owner}: PowerSGD memory for {len(rejected)} parameter(s) did not match this model "
            f"and was dropped (e.g. {rejected[0]!r})."
        )
