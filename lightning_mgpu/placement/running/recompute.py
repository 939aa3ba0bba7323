"""Activation checkpointing of a stage's micro-batches: which ones recompute, and when recomputing is unsafe."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

__all__ = ["CHECKPOINT_MODES", "check_checkpoint_mode", "check_recompute_randomness", "recomputes", "run_checkpointed"]

CHECKPOINT_MODES = ("never", "except_last", "always")
"""``"never"`` keeps every micro-batch's activations; ``"always"`` recomputes each stage's
forward during backward; ``"except_last"`` recomputes all but the last micro-batch of a
forward call, whose backward starts at once (GPipe's choice)."""

_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def check_checkpoint_mode(checkpoint: object) -> str:
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    return str(checkpoint)


def recomputes(checkpoint: str, microbatch: int, num_microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` of ``num_microbatches`` runs its forward again in backward."""
    return checkpoint == "always" or (checkpoint == "except_last" and microbatch < num_microbatches - 1)


def run_checkpointed(run: Callable[[torch.Tensor], Any], inp: torch.Tensor) -> Any:
    """``run(inp)`` keeping only its input: non-reentrant ``torch.utils.checkpoint``, RNG state preserved."""
    return activation_checkpoint(run, inp, use_reentrant=False)


def check_recompute_randomness(stages: Sequence[nn.Module], checkpoint: str, devices: Optional[Sequence[Any]]) -> None:
    """Refuse activation recomputation of dropout layers when several stages share the CPU's generator.

    Recomputation replays a stage's forward with the random state saved before it; with
    several CPU stages running concurrently, other stages draw from the same global generator
    in between, so the recomputed dropout masks would differ from the forward's and the
    gradients would be wrong (not just nondeterministic).
    """
    if checkpoint == "never" or devices is None:
        return
    cpu_stages = sum(torch.device(device).type == "cpu" for device in devices)
    if cpu_stages < 2:
        return
    if any(isinstance(module, _RANDOM_LAYERS) for stage in stages for module in stage.modules()):
        raise ValueError(
            f"checkpoint={checkpoint!r} with dropout in a model split over {cpu_stages} CPU stages: the stages share "
            "the CPU's random generator, so recomputed dropout masks would differ from the forward's and the gradients "
            "would be wrong. Use checkpoint='never', or put the stages on GPUs (one generator each)."
        )
