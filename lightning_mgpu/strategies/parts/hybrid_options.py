"""``HybridParallelStrategy``'s arguments: each checked at construction, before any process starts, with an
error that names what was given, what is allowed and how to fix it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from lightning_mgpu.placement.runner import BALANCE_MODES, CHECKPOINT_MODES, SCHEDULES, PipelineOptions, check_sizes

__all__ = ["check_hybrid_options"]


def check_hybrid_options(
    *,
    devices_per_replica: object,
    balance: Union[str, Sequence[int]],
    microbatches: object,
    checkpoint: object,
    split_module: object,
    split_points: Optional[Sequence[str]],
    schedule: object,
    sample_input: object,
    threads_per_stage: object,
    ddp_kwargs: dict[str, Any],
) -> PipelineOptions:
    """Raise ``ValueError`` for the first argument that is wrong; return them checked."""
    if isinstance(devices_per_replica, bool) or not isinstance(devices_per_replica, int) or devices_per_replica < 1:
        raise ValueError(f"devices_per_replica must be an integer >= 1, got {devices_per_replica!r}")
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES} or a list of stage sizes, got {balance!r}")
        checked: Union[str, list[int]] = balance
    else:
        checked = check_sizes(balance, None, devices_per_replica)  # the layer count is checked at setup
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    if split_module is not None and (not isinstance(split_module, str) or not split_module):
        raise ValueError(
            f"split_module must be the attribute name of an nn.Sequential (a string), got {split_module!r}"
        )
    if split_points is not None:
        _check_split_points(split_points, split_module, devices_per_replica)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
    if sample_input is not None and not isinstance(sample_input, torch.Tensor):
        raise ValueError(
            f"sample_input must be a tensor (a batch of the split module's input), got {type(sample_input).__name__}"
        )
    if threads_per_stage is not None and (
        isinstance(threads_per_stage, bool) or not isinstance(threads_per_stage, int) or threads_per_stage < 1
    ):
        raise ValueError(f"threads_per_stage must be an integer >= 1 or None, got {threads_per_stage!r}")
    if ddp_kwargs.get("static_graph"):
        raise ValueError(
            "static_graph=True is not supported by the hybrid strategy: DDP's static-graph mode all-reduces when "
            "loss.backward() ends, before the split module's stages have run their backward."
        )
    if ddp_kwargs.get("find_unused_parameters"):
        raise ValueError(
            "find_unused_parameters=True is not supported by the hybrid strategy: the split module's parameters "
            "get their gradients from the pipeline's own backward, which DDP's search from the loss cannot see."
        )
    return PipelineOptions(
        devices_per_replica=devices_per_replica,
        balance=checked,
        microbatches=microbatches,
        checkpoint=str(checkpoint),
        split_module=split_module,
        split_points=None if split_points is None else list(split_points),
        schedule=str(schedule),
        sample_input=sample_input,
        threads_per_stage=threads_per_stage,
    )


def _check_split_points(split_points: Sequence[str], split_module: object, devices_per_replica: int) -> None:
    if (
        isinstance(split_points, str)
        or not isinstance(split_points, Sequence)
        or not all(isinstance(point, str) and point for point in split_points)
    ):
        raise ValueError(
            f"split_points must be a list of qualified submodule names (e.g. ['model.transformer.h.2']), "
            f"got {split_points!r}"
        )
    if split_module is not None:
        raise ValueError(
            "give split_points or split_module, not both: split_points name where stages begin in any model, "
            "split_module names an nn.Sequential whose layers the planner cuts"
        )
    if len(split_points) != devices_per_replica - 1:
        raise ValueError(
            f"split_points={list(split_points)!r} makes {len(split_points) + 1} stage(s) but devices_per_replica="
            f"{devices_per_replica}: give {devices_per_replica - 1} name(s), where stages 1.. begin"
        )
