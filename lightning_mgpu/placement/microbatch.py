"""Cutting a batch into micro-batches, joining the outputs, and the record a forward call leaves for its backward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

__all__ = ["PendingForward", "gather", "scatter"]

Move = Callable[[Optional[torch.Tensor], torch.device], Optional[torch.Tensor]]


def scatter(batch: object, microbatches: int) -> list[torch.Tensor]:
    """``batch`` cut along its first dimension into ``microbatches`` pieces (fewer if it has fewer samples)."""
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"the pipelined module takes one tensor (batch first), got {type(batch).__name__}")
    if batch.dim() == 0 or batch.shape[0] == 0:
        raise ValueError(
            f"the pipelined module needs a batch dimension with at least one sample, got shape {tuple(batch.shape)}"
        )
    return list(batch.tensor_split(min(microbatches, batch.shape[0])))


def gather(outputs: Sequence[torch.Tensor], device: torch.device, move: Move) -> torch.Tensor:
    """The micro-batches' outputs joined on ``device``, detached, in a tensor of its own."""
    final = [move(out, device).detach() if out.device != device else out.detach() for out in outputs]  # type: ignore[union-attr]
    return torch.cat(final) if len(final) > 1 else final[0].clone()


@dataclass
class PendingForward:
    """One forward call whose backward is pending."""

    source: torch.Tensor  # the input as the caller gave it (may carry a graph from earlier layers)
    splits: list[int]  # micro-batch sizes
    inputs: list[list[Optional[torch.Tensor]]]  # [stage][micro-batch] detached input (requires_grad or None)
    outputs: list[list[Optional[torch.Tensor]]]  # [stage][micro-batch] output with the stage's graph
    result: torch.Tensor  # the leaf handed back to the caller
    input_grads: list[Optional[torch.Tensor]] = field(default_factory=list)

    def output_grads(self) -> list[torch.Tensor]:
        """Take the gradient ``loss.backward()`` left on the result, cut per micro-batch (the result's is cleared)."""
        grad = self.result.grad
        assert grad is not None, "only called for a forward whose output received a gradient"
        self.result.grad = None
        return list(grad.split(self.splits))
