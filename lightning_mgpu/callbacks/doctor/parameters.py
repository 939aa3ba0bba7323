"""What the doctor watches on the model's parameters: exact checksums, and which parameters get gradients.

* :func:`bitsum`: a tensor's bit patterns summed as integers (wrapping): exact, independent of
  the reduction order, so bitwise-equal replicas agree on any kernel or thread count.
* :class:`ParameterWatch`: under DDP, the parameters (and, without ``broadcast_buffers``, the
  buffers) to checksum; with ``find_unused_parameters=True`` gradient hooks counting each
  parameter's use over a first window of batches; without it, ``.grad`` still None after the
  first backward (DDP would fail at the next step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_mgpu.callbacks.doctor.protocol import UsageReport

__all__ = ["DDPOptions", "ParameterWatch", "bitsum"]

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
    """The model's trainable parameters as DDP sees them, watched for the parameter rules."""

    def __init__(self) -> None:
        self._hooks: list[Any] = []
        self.reset()

    def reset(self) -> None:
        """Forget the model (hooks removed): a fresh watch for the next fit."""
        self.detach()
        self.ddp: Optional[DDPOptions] = None
        """None: the model is not under DDP (nothing here is checked)."""
        self.param_names: list[str] = []
        self.buffer_names: list[str] = []
        """Buffers checksummed too (DDP does not broadcast them)."""
        self._params: list[nn.Parameter] = []
        self._module: Optional[nn.Module] = None
        self._counts: list[int] = []  # since the last report
        self._used_now: set[int] = set()
        self._batches = 0
        self._grads_checked = False

    def attach(self, ddp_model: nn.Module, module: nn.Module, *, count_use: bool) -> None:
        """Watch ``module``'s parameters when ``ddp_model`` is DDP; with ``count_use`` (and
        ``find_unused_parameters=True`` without a static graph) count each parameter's use."""
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
        self._params = [p for _, p in named]
        self._module = module
        if not self.ddp.broadcast_buffers:
            # DDP leaves buffers (BatchNorm's running statistics, ...) to each rank: compare them too.
            self.buffer_names = [n for n, b in module.named_buffers() if b.is_floating_point()]
        if count_use and self.ddp.find_unused and not self.ddp.static_graph:
            # Local use, whatever other ranks did: .grad alone would show the all-reduced result.
            self._counts = [0] * len(self._params)
            for index, param in enumerate(self._params):
                self._hooks.append(param.register_post_accumulate_grad_hook(lambda _p, i=index: self._used_now.add(i)))  # type: ignore[no-untyped-call]

    @property
    def counting(self) -> bool:
        """The use window is open (its hooks are in place)."""
        return bool(self._hooks)

    def detach(self) -> None:
        """Remove the hooks (the window closes)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def tensor_names(self) -> list[str]:
        """Names for :meth:`checksums`' entries."""
        return self.param_names + [f"buffer {name}" for name in self.buffer_names]

    def checksums(self) -> list[int]:
        """:func:`bitsum` per parameter, then per watched buffer. Cheap: one integer pass, no float64 copies."""
        tensors = [p.detach() for p in self._params]
        if self.buffer_names and self._module is not None:
            # Looked up by name each time: a module may replace a buffer tensor.
            buffers = dict(self._module.named_buffers())
            tensors += [buffers[name].detach() for name in self.buffer_names]
        if not tensors:
            return []
        with torch.no_grad():
            sums = torch.stack([bitsum(t) for t in tensors])
            return [int(v) for v in sums.cpu().tolist()]

    def after_backward(self, *, check_grads: bool) -> list[str]:
        """Count this batch's use while the window is open; otherwise, once per fit and only with
        ``check_grads`` under ``find_unused_parameters=False`` (no static graph), the parameters whose
        ``.grad`` is still None (returned; empty otherwise)."""
        if self._hooks:
            self._batches += 1
            for index in self._used_now:
                self._counts[index] += 1
            self._used_now = set()
            return []
        if self._grads_checked or not check_grads or self.ddp is None or self.ddp.find_unused or self.ddp.static_graph:
            return []
        self._grads_checked = True
        return self.missing_grads()

    def missing_grads(self) -> list[str]:
        """Watched parameters whose ``.grad`` is None now."""
        return [name for name, p in zip(self.param_names, self._params) if p.grad is None]

    def take_usage(self, *, done: bool) -> Optional[UsageReport]:
        """The use counted since the last call (None when the window is not open); with ``done``
        the window closes."""
        if not self._hooks:
            return None
        report = UsageReport(counts=self._counts, batches=self._batches, done=done)
        self._counts = [0] * len(self._counts)
        self._batches = 0
        if done:
            self.detach()
        return report
