"""Cutting a batch into micro-batches, and reaching every tensor of a nested value.

The pipeline's batch is whatever the function it runs takes (a ``training_step``'s batch:
tensors nested in tuples, lists, dicts, named tuples, with non-tensors beside them):
:func:`split_batch` cuts every tensor along its first dimension, :func:`map_tensors` applies a
function to every tensor of such a value, keeping its types.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["map_tensors", "split_batch"]


def split_batch(value: Any, microbatches: int) -> tuple[list[Any], list[int]]:
    """``value`` (tensors, nested in tuples, lists and dicts) cut along the first dimension into
    at most ``microbatches`` pieces; non-tensors are given to every piece. Returns the pieces and their sizes."""
    sizes: set[int] = set()
    _collect_sizes(value, sizes)
    if not sizes:
        raise ValueError(
            "the batch holds no tensor with a batch dimension: the pipeline cuts the batch into micro-batches along "
            "the first dimension of its tensors"
        )
    if len(sizes) > 1:
        raise ValueError(
            f"the batch's tensors have different first dimensions {sorted(sizes)}: the pipeline cuts every tensor "
            "of the batch along its first dimension (the samples), so they must all have the same length"
        )
    (n,) = sizes
    if n == 0:
        raise ValueError(
            "the batch is empty (no sample along its batch dimension): there is nothing to cut into micro-batches"
        )
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
