"""Measure what each layer of an ``nn.Sequential`` costs: time, memory, boundary size.

:func:`profile_layers` runs the layers one by one on a sample batch, each on the output of
the previous one, and returns one :class:`LayerCost` per layer:

* ``forward_ms`` / ``backward_ms``: median over ``repeats`` timed runs after ``warmup``
  untimed ones; ``time_spread_ms`` is the interquartile range of their sum (how far to
  trust the median). Backward is ``torch.autograd.grad`` of the layer's output with respect
  to its input and parameters, i.e. exactly the work a pipeline stage does per
  micro-batch; with respect to its input only where a gradient flows into it (from
  ``sample.requires_grad`` or a trainable layer before it: a batch of data needs none, so a
  pipeline's first layers never compute one). On CUDA the times come from ``torch.cuda.Event`` pairs (read once per
  layer, after all repeats, so the GPU is not drained between runs); on CPU from
  ``time.perf_counter``.
* ``param_bytes`` + ``grad_bytes`` + ``optimizer_bytes``: parameters, their gradients,
  and optimizer state at ``optimizer_state_factor`` times the parameter bytes (2 for Adam's
  two moments, 1 for SGD with momentum, 0 for plain SGD).
* ``activation_bytes``: the tensors autograd saves for this layer's backward (counted
  through ``torch.autograd.graph.saved_tensors_hooks``, each storage once), which a
  stage keeps alive per in-flight micro-batch.
* ``output_bytes``: the size of the layer's output, the tensor that crosses a device
  boundary when a cut follows this layer (its gradient crosses back, same size).

The sample should be the batch one micro-batch will see: all times and activation sizes
scale with it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_mgpu._checks import check_int, check_real
from lightning_mgpu._compat.torch import is_batchnorm

__all__ = ["LayerCost", "profile_batch_size", "profile_layers"]


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs per micro-batch (see the module docstring for how each is measured)."""

    index: int
    name: str
    kind: str
    forward_ms: float
    backward_ms: float
    param_count: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    output_bytes: int
    time_spread_ms: float = 0.0  # interquartile range of forward + backward over the repeats: how stable the median is

    @property
    def time_ms(self) -> float:
        """Forward plus backward: the layer's share of a training step per micro-batch."""
        return self.forward_ms + self.backward_ms

    @property
    def memory_bytes(self) -> int:
        """Parameters, gradients, optimizer state and one micro-batch's saved activations."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "time_ms": self.time_ms, "memory_bytes": self.memory_bytes}

    @classmethod
    def from_parameters(cls, index: int, name: str, kind: str, params: Sequence[torch.Tensor]) -> LayerCost:
        """A cost from parameter counts only (no sample run): enough for balance="params" or given sizes;
        gradients as large as the parameters, optimizer state twice that (Adam's two moments)."""
        count = sum(p.numel() for p in params)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        return cls(
            index=index,
            name=name,
            kind=kind,
            forward_ms=0.0,
            backward_ms=0.0,
            param_count=count,
            param_bytes=nbytes,
            grad_bytes=nbytes,
            optimizer_bytes=2 * nbytes,
            activation_bytes=0,
            output_bytes=0,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerCost:
        names = cls.__dataclass_fields__
        return cls(**{key: value for key, value in data.items() if key in names})


def profile_batch_size(batch_size: int, microbatches: int, model: nn.Module) -> int:
    """Rows of the sample each layer is measured on: one micro-batch (``ceil(N / M)``), but at least 2 when the
    model has BatchNorm (training-mode BatchNorm refuses one sample per channel). The fit and
    ``lightning-mgpu plan`` both use it, so they measure the same thing."""
    rows = max(1, -(-batch_size // microbatches))
    if rows < 2 <= batch_size and any(is_batchnorm(m) for m in model.modules()):
        return 2
    return rows


def profile_layers(
    layers: nn.Sequential,
    sample: torch.Tensor,
    *,
    repeats: int = 5,
    warmup: int = 2,
    device: Union[str, torch.device, None] = None,
    optimizer_state_factor: float = 2.0,
    threads: Optional[int] = None,
) -> list[LayerCost]:
    """Profile every layer of ``layers`` on ``sample`` (one micro-batch); see the module docstring.

    ``device``: where to run (default: where the layers' first parameter is, else the
    sample's device). The layers are moved there for the measurement and moved back after.
    Their gradients are not touched (``torch.autograd.grad`` is used, never ``.backward``).
    ``threads``: intra-op threads while measuring (default: as they are); give a pipeline
    stage's share to measure what a stage will see. In-place layers (``nn.ReLU(inplace=True)``)
    get a copy of their input, BatchNorm's running statistics are restored after.
    """
    if not isinstance(layers, nn.Sequential):
        raise TypeError(f"profile_layers needs an nn.Sequential, got {type(layers).__name__}")
    if len(layers) == 0:
        raise ValueError("profile_layers got an empty nn.Sequential: there is nothing to place")
    if not isinstance(sample, torch.Tensor):
        raise TypeError(
            f"sample must be a torch.Tensor (one micro-batch of the sequential's input), got {type(sample).__name__}"
        )
    check_int("repeats", repeats, minimum=1)
    check_int("warmup", warmup, minimum=0)
    factor = check_real("optimizer_state_factor", optimizer_state_factor, what="a number >= 0")
    if factor < 0:
        raise ValueError(f"optimizer_state_factor must be a number >= 0, got {optimizer_state_factor!r}")

    homes = [_home_device(layer) for layer in layers]
    target = (
        torch.device(device)
        if device is not None
        else (next((h for h in homes if h is not None), None) or sample.device)
    )
    costs: list[LayerCost] = []
    # A copy: the caller's sample is never written (an in-place first layer), and a micro-batch sliced from a
    # larger batch saves bytes of its own, not the batch's.
    x = sample.detach().to(target, copy=True)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_int("threads", threads))
    input_grad = sample.requires_grad  # does a gradient flow into this layer's input?
    try:
        for index, (name, layer) in enumerate(layers.named_children()):
            layer.to(target)
            with torch.cuda.device(target) if target.type == "cuda" else contextlib.nullcontext():
                cost, x = _profile_one(index, name, layer, x, repeats, warmup, optimizer_state_factor, input_grad)
            costs.append(cost)
            input_grad = input_grad or any(p.requires_grad for p in layer.parameters())
    finally:
        torch.set_num_threads(previous_threads)
        for layer, home in zip(layers, homes):
            if home is not None and home != target:
                layer.to(home)
    return costs


def _home_device(layer: nn.Module) -> Optional[torch.device]:
    for tensor in layer.parameters():
        return tensor.device
    for buffer in layer.buffers():
        return buffer.device
    return None


def _profile_one(
    index: int,
    name: str,
    layer: nn.Module,
    x: torch.Tensor,
    repeats: int,
    warmup: int,
    optimizer_state_factor: float,
    input_grad: bool,
) -> tuple[LayerCost, torch.Tensor]:
    params = [p for p in layer.parameters() if p.requires_grad]
    needs_input_grad = input_grad and (x.is_floating_point() or x.is_complex())
    clock = _Clock(x.device)

    in_place = [_starts_in_place(layer)]

    def make_input() -> tuple[torch.Tensor, torch.Tensor]:
        """The leaf to differentiate against, and what the layer is given: a copy where it could be written (an
        in-place first op cannot modify that leaf, and no op may modify the input shared by the repeats;
        nothing raises when it needs no gradient). Made outside the timed region."""
        inp = x.detach().requires_grad_(needs_input_grad)
        return inp, (inp.clone() if in_place[0] or not needs_input_grad else inp)

    def run_forward(prepared: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        inp, given = prepared or make_input()
        try:
            out = layer(given)
        except RuntimeError as exc:
            if in_place[0] or "in-place" not in str(exc) and "inplace" not in str(exc):
                raise
            in_place[0] = True
            out = layer(inp.clone())
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"layer {index} ({name}: {type(layer).__name__}) returns {type(out).__name__}; a pipeline passes one "
                "tensor between layers, so every layer of the split nn.Sequential must return a tensor"
            )
        return inp, out

    def run_backward(inp: torch.Tensor, out: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        wrt = ([inp] if needs_input_grad else []) + params
        if wrt and out.requires_grad:
            torch.autograd.grad(out, wrt, grad, allow_unused=True)

    was_training = layer.training
    layer.train()
    state = _snapshot_buffers(layer)  # BatchNorm running stats must not drift from profiling
    try:
        forward_times, backward_times = [], []
        for repeat in range(warmup + repeats):
            prepared = make_input()
            start = clock.now()
            inp, out = run_forward(prepared)
            middle = clock.now()
            grad = torch.ones_like(out) if out.requires_grad else None
            middle_after_setup = clock.now()
            run_backward(inp, out, grad)
            end = clock.now()
            if repeat >= warmup:
                forward_times.append((start, middle))
                backward_times.append((middle_after_setup, end))
        forwards = [clock.elapsed_ms(a, b) for a, b in forward_times]
        backwards = [clock.elapsed_ms(a, b) for a, b in backward_times]
        forward_ms, backward_ms = statistics.median(forwards), statistics.median(backwards)
        spread = _interquartile([f + b for f, b in zip(forwards, backwards)])
        saved = _saved_bytes(run_forward, layer)
        with torch.no_grad():
            out = layer(x)
    finally:
        _restore_buffers(layer, state)
        layer.train(was_training)
    param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    cost = LayerCost(
        index=index,
        name=name,
        kind=type(layer).__name__,
        forward_ms=forward_ms,
        backward_ms=backward_ms,
        param_count=sum(p.numel() for p in layer.parameters()),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=int(round(grad_bytes * optimizer_state_factor)),
        activation_bytes=saved,
        output_bytes=out.numel() * out.element_size(),
        time_spread_ms=spread,
    )
    return cost, out.detach()


def _interquartile(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return quartiles[2] - quartiles[0]


def _starts_in_place(module: nn.Module) -> bool:
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))


def _saved_bytes(run_forward: Any, layer: nn.Module) -> int:
    # Parameters are saved for backward too, often as views (nn.Linear saves weight.t()): they are the
    # stage's parameter memory, counted once in param_bytes, not activations of each micro-batch.
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        try:
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
            key = (id(tensor), tensor.numel() * tensor.element_size())
        if key not in seen and key[0] not in parameters:
            seen.add(key)
            total += key[1]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run_forward()
    return total


def _snapshot_buffers(layer: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(buffer, buffer.detach().clone()) for buffer in layer.buffers()]


def _restore_buffers(layer: nn.Module, state: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, saved in state:
            buffer.copy_(saved)


class _Clock:
    """Host clock on CPU; CUDA events on GPU, all read once at the end (no per-run sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end))
        return float(end - start) * 1e3
