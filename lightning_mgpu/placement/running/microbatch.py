"""Cutting a batch into micro-batches, joining the outputs, and the record a forward call leaves for its backward.

* :func:`scatter` / :func:`gather` / :class:`PendingForward`: the ``nn.Sequential`` pipeline
  (one tensor in, one tensor out).
* :func:`split_batch` / :func:`map_tensors`: the staged pipeline, whose batch is whatever the
  user's ``training_step`` takes (tensors nested in tuples, lists, dicts, named tuples, with
  non-tensors beside them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from lightning_mgpu.placement.running.handover import StagedStepError

__all__ = ["PendingForward", "gather", "map_tensors", "scatter", "split_batch"]

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


def split_batch(value: Any, microbatches: int) -> tuple[list[Any], list[int]]:
    """``value`` (tensors, nested in tuples, lists and dicts) cut along the first dimension into
    at most ``microbatches`` pieces; non-tensors are given to every piece. Returns the pieces and their sizes."""
    sizes: set[int] = set()
    _collect_sizes(value, sizes)
    if not sizes:
        raise StagedStepError(
            "the batch holds no tensor with a batch dimension: the pipeline cuts the batch into micro-batches along "
            "the first dimension of its tensors"
        )
    if len(sizes) > 1:
        raise StagedStepError(
            f"the batch's tensors have different first dimensions {sorted(sizes)}: the pipeline cuts every tensor "
            "of the batch along its first dimension (the samples), so they must all have the same length"
        )
    (n,) = sizes
    if n == 0:
        raise StagedStepError("the batch is empty: there is nothing to cut into micro-batches")
    count = min(microbatches, n)
    pieces = [_take(value, count, i) for i in range(count)]
    base, extra = divmod(n, count)
    return pieces, [base + (1 if i < extra else 0) for i in range(count)]


def _collect_sizes(value: Any, sizes: set[int]) -> None:
    if isinstance(value, torch.Tensor):
        if value.dim() > 0:
            sizes.add(value.shape[0])
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect_sizes(item, sizes)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect_sizes(item, sizes)


def _take(value: Any, count: int, i: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tensor_split(count)[i] if value.dim() > 0 else value
    return map_tensors(value, lambda item: _take(item, count, i), tensors_only=False)


def map_tensors(value: Any, fn: Callable[[Any], Any], *, tensors_only: bool = True) -> Any:
    """``fn`` applied to every tensor (or, with ``tensors_only=False``, every direct item) in tuples, lists and dicts,
    keeping their types (named tuples, dict subclasses); anything else is returned as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [fn(item) if not tensors_only else map_tensors(item, fn) for item in value]
        if type(value) is tuple:
            return tuple(items)
        try:
            return type(value)(*items)  # a named tuple
        except TypeError:
            return type(value)(items)
    if isinstance(value, list):
        return [fn(item) if not tensors_only else map_tensors(item, fn) for item in value]
    if isinstance(value, dict):
        out = {key: fn(item) if not tensors_only else map_tensors(item, fn) for key, item in value.items()}
        try:
            return type(value)(out)
        except TypeError:
            return out
    return value


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
        return list(torch.split(grad, self.splits))
