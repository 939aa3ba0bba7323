"""What a DDP-wrapped model's reducer holds: its parameters in reducer order and the bucket layout it built."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu._compat.torch import ddp_rebuilt_buckets


@dataclass(frozen=True)
class BucketInfo:
    """One gradient bucket as DDP built it (after its rebuild on the first iteration)."""

    index: int
    """Position in launch order: bucket 0 holds the gradients that are ready first."""
    bytes: int
    """Size of the bucket's flat gradient buffer in bytes."""
    num_params: int
    param_names: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def reducer_named_params(model: DistributedDataParallel) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) in the order DDP's reducer indexes them."""
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor]] = []
    for module_name, module in model.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if param.requires_grad and full not in ignored and id(param) not in seen:
                seen.add(id(param))
                named.append((full, param))
    return named


def read_bucket_layout(model: object) -> Optional[list[BucketInfo]]:
    """Gradient buckets as DDP built them, in launch order; None until DDP recorded them.

    DDP rebuilds its buckets once, at the start of the second training step, from the order
    in which gradients became ready during the first; it records the rebuilt layout in its
    logging data during the third step. This reads that record (without allocating any
    gradient-sized buffer).
    """
    if not isinstance(model, DistributedDataParallel):
        return None
    rebuilt = ddp_rebuilt_buckets(model)
    if rebuilt is None:
        return None
    sizes, indices = rebuilt
    names = [name for name, _ in reducer_named_params(model)]
    return [
        BucketInfo(index=b, bytes=size, num_params=len(idx), param_names=tuple(names[i] for i in idx))
        for b, (size, idx) in enumerate(zip(sizes, indices, strict=True))
    ]
