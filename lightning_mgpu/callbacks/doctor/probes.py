"""What several of the doctor's rules observe: the model's parameters as DDP sees them, the train loader, a batch.

* :class:`ParameterWatch`: under DDP, its options, the trainable parameters and (without
  ``broadcast_buffers``) the buffers, with exact checksums (:func:`bitsum`: a tensor's bit patterns
  summed as integers, wrapping: independent of the reduction order, so bitwise-equal replicas agree
  on any kernel or thread count);
* :func:`train_loader`, :func:`fingerprint` (a batch's hash), :func:`nested`.

Probes read public state and return plain data. What Lightning offers no public way to see goes
through ``lightning_mgpu._compat.lightning``; when that cannot see it either, the rule says so
(``None``, ``order_unknown``) and is reported as not checked rather than as passed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

__all__ = ["DDPOptions", "ParameterWatch", "bitsum", "fingerprint", "nested", "train_loader"]

_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitsum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s bit patterns as integers, wrapping (mod 2**32 or 2**64), as an int64 scalar."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    size = tensor.element_size()
    try:
        bits = tensor.view(_INT_VIEWS[size])
    except (KeyError, RuntimeError):  # an odd dtype or layout: bytes instead
        bits, size = tensor.contiguous().reshape(-1).view(torch.uint8), 1
    accumulate = torch.int64 if size == 8 else torch.int32
    return bits.sum(dtype=accumulate).to(torch.int64)


@dataclass(frozen=True)
class DDPOptions:
    """The DDP options the parameter rules depend on."""

    find_unused: bool
    static_graph: bool
    broadcast_buffers: bool


class ParameterWatch:
    """The model's trainable parameters as DDP sees them."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the model: a fresh watch for the next fit."""
        self.ddp: Optional[DDPOptions] = None
        """None: the model is not under DDP (nothing here is checked)."""
        self.param_names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.buffer_names: list[str] = []
        """Buffers checksummed too (DDP does not broadcast them)."""
        self._module: Optional[nn.Module] = None

    def attach(self, ddp_model: nn.Module, module: nn.Module) -> None:
        """Watch ``module``'s parameters when ``ddp_model`` is DDP."""
        self.reset()
        if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
            return
        self.ddp = DDPOptions(
            find_unused=bool(ddp_model.find_unused_parameters),
            static_graph=bool(getattr(ddp_model, "static_graph", False)),
            broadcast_buffers=bool(getattr(ddp_model, "broadcast_buffers", True)),
        )
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._module = module
        if not self.ddp.broadcast_buffers:
            # DDP leaves buffers (BatchNorm's running statistics, ...) to each rank: compare them too.
            self.buffer_names = [n for n, b in module.named_buffers() if b.is_floating_point()]

    @property
    def tensor_names(self) -> list[str]:
        """Names for :meth:`checksums`' entries."""
        return self.param_names + [f"buffer {name}" for name in self.buffer_names]

    def checksums(self) -> list[int]:
        """:func:`bitsum` per parameter, then per watched buffer. Cheap: one integer pass, no float64 copies."""
        tensors = [p.detach() for p in self.params]
        if self.buffer_names and self._module is not None:
            # Looked up by name each time: a module may replace a buffer tensor.
            buffers = dict(self._module.named_buffers())
            tensors += [buffers[name].detach() for name in self.buffer_names]
        if not tensors:
            return []
        with torch.no_grad():
            sums = torch.stack([bitsum(t) for t in tensors])
            return [int(v) for v in sums.cpu().tolist()]

    def missing_grads(self) -> list[str]:
        """Watched parameters whose ``.grad`` is None now."""
        return [name for name, p in zip(self.param_names, self.params) if p.grad is None]


T = TypeVar("T")


def nested(obj: Any, kind: type[T]) -> Iterator[T]:
    """The ``kind`` objects in ``obj``: ``obj`` itself, or those in its lists, tuples and dicts, at any depth."""
    if isinstance(obj, kind):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from nested(value, kind)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from nested(item, kind)


def train_loader(trainer: L.Trainer) -> Optional[DataLoader[Any]]:
    """The first ``DataLoader`` among the fit's train loaders (as Lightning uses them: samplers replaced)."""
    return next(nested(trainer.train_dataloader, DataLoader), None)


def fingerprint(obj: Any, max_bytes: int = 1 << 20) -> Optional[str]:
    """A short hash of a batch (tensors, arrays, numbers, strings, nested in lists/dicts).

    Each tensor contributes its shape, dtype and its first ``max_bytes`` bytes. ``None`` when
    nothing in ``obj`` could be hashed (opaque objects): no verdict is better than a wrong one.
    """
    digest = hashlib.blake2b(digest_size=12)
    return digest.hexdigest() if _feed(digest, obj, max_bytes) else None


def _feed(digest: Any, obj: Any, max_bytes: int) -> bool:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        digest.update(f"T{tuple(tensor.shape)}{tensor.dtype}".encode())
        if tensor.is_sparse or tensor.numel() == 0:
            return True
        count = max(1, max_bytes // max(1, tensor.element_size()))
        part = tensor.reshape(-1)[:count]
        if part.device.type != "cpu":
            part = part.cpu()
        digest.update(part.contiguous().view(torch.uint8).numpy().tobytes())
        return True
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        digest.update(repr(obj).encode())
        return True
    if isinstance(obj, Mapping):
        seen = False
        for key in sorted(obj, key=str):
            digest.update(repr(key).encode())
            seen = _feed(digest, obj[key], max_bytes) or seen
        return seen
    if isinstance(obj, (list, tuple)):
        digest.update(f"L{len(obj)}".encode())
        seen = False
        for item in obj:
            seen = _feed(digest, item, max_bytes) or seen
        return seen
    tobytes = getattr(obj, "tobytes", None)  # numpy arrays and scalars
    if callable(tobytes) and hasattr(obj, "shape"):
        digest.update(f"A{obj.shape}".encode())
        digest.update(bytes(tobytes())[:max_bytes])
        return True
    return False
