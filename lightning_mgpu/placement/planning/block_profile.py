"""Measure what each candidate block of an unmodified model costs, by running the model's own forward.

:func:`~lightning_mgpu.placement.planning.profile.profile_layers` runs an ``nn.Sequential``'s layers
one by one; a model whose forward is arbitrary Python (GPT-2's, a ResNet's) cannot be run
that way. :func:`profile_blocks` runs the whole model instead (``run()``: one forward on
one micro-batch), ``repeats`` times after ``warmup`` untimed runs, with a forward pre-hook
on each candidate block:

* ``forward_ms``: from the moment block ``i`` is entered to the moment block ``i + 1`` is
  (the code before the first block counts with the first, the code after the last block
  and the loss with the last: where those run in a pipeline), median over the repeats;
* ``backward_ms``: the backward of the whole model (``torch.autograd.grad`` of the result
  with respect to the parameters) shared out in proportion to the forward, as
  ``lightning-mgpu plan --split-points`` does;
* ``activation_bytes``: the tensors autograd saves while block ``i``'s span runs (each
  storage once, parameters left out), what a stage keeps per micro-batch in flight;
* parameters, gradients and optimizer state as
  :func:`~lightning_mgpu.placement.planning.split_points.block_costs` counts them.

Buffers (BatchNorm's running statistics) and the random state are restored after, so
profiling leaves the model as it was.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
from torch import nn

from lightning_mgpu._checks import check_int
from lightning_mgpu.placement.planning.profile import LayerCost
from lightning_mgpu.placement.planning.split_points import block_costs

__all__ = ["profile_blocks"]


def profile_blocks(
    root: nn.Module,
    candidates: Sequence[str],
    run: Callable[[], Any],
    *,
    repeats: int = 5,
    warmup: int = 1,
) -> list[LayerCost]:
    """One :class:`LayerCost` per candidate block of ``root``, measured on ``run()`` (see the module docstring).
    ``run()`` must call every candidate exactly once, in order; its result (a loss, or tensors) is what the
    backward starts from."""
    check_int("repeats", repeats)
    check_int("warmup", warmup, minimum=0)
    modules = [root.get_submodule(name) for name in candidates]
    params = [p for p in root.parameters() if p.requires_grad]
    parameter_storages = {p.untyped_storage().data_ptr() for p in root.parameters()}
    entered: list[float] = []
    current = [0]
    saved = [0] * len(modules)
    seen: set[tuple[int, int]] = set()

    def enter(index: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            entered.append(time.perf_counter())
            current[0] = index

        return hook

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen and key[0] not in parameter_storages:
            seen.add(key)
            saved[current[0]] += key[1]
        return tensor

    handles = [module.register_forward_pre_hook(enter(index)) for index, module in enumerate(modules)]
    buffers = [(b, b.detach().clone()) for b in root.buffers()]
    devices = sorted({p.device.index for p in params if p.device.type == "cuda" and p.device.index is not None})
    forward: list[list[float]] = []
    backward: list[float] = []
    activations: list[int] = []
    try:
        with torch.random.fork_rng(devices=devices):
            for repeat in range(warmup + repeats):
                entered.clear()
                seen.clear()
                current[0] = 0
                saved[:] = [0] * len(modules)
                start = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    result = run()
                end = time.perf_counter()
                if len(entered) != len(modules):
                    raise ValueError(
                        f"the model's forward entered {len(entered)} of the {len(modules)} candidate blocks "
                        f"{list(candidates)}: every candidate must run exactly once per forward to be profiled"
                    )
                outputs = [t for t in _tensors(result) if t.requires_grad and t.is_floating_point()]
                if outputs and params:
                    loss = torch.stack([t.float().sum() for t in outputs]).sum()
                    torch.autograd.grad(loss, params, allow_unused=True)
                done = time.perf_counter()
                if repeat >= warmup:
                    edges = [start, *entered[1:], end]
                    forward.append([(b - a) * 1e3 for a, b in zip(edges, edges[1:])])
                    backward.append((done - end) * 1e3)
                    activations = list(saved)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    fwd = [statistics.median(run_times[i] for run_times in forward) for i in range(len(modules))]
    bwd_total = statistics.median(backward)
    fwd_total = sum(fwd) or 1.0
    spreads = [_interquartile([sum(run_times) for run_times in forward])] * len(modules)
    costs = block_costs(root, candidates)
    return [
        dataclasses.replace(
            cost,
            forward_ms=fwd[i],
            backward_ms=bwd_total * fwd[i] / fwd_total,
            activation_bytes=activations[i],
            time_spread_ms=spreads[i] * fwd[i] / fwd_total,
        )
        for i, cost in enumerate(costs)
    ]


def _interquartile(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return quartiles[2] - quartiles[0]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping) and isinstance(value.get("loss"), torch.Tensor):
        return [value["loss"]]  # a training step's result, or Hugging Face's ModelOutput with a loss
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []
