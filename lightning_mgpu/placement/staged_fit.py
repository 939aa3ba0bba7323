"""What the hybrid strategy needs around :class:`~lightning_mgpu.placement.running.engine.StagedStep` in a fit,
kept free of Lightning: model checks, module placement, and the step function with its logging.

* :func:`choose_split_points`: the split points in force, given or planned among the
  candidate blocks (``balance``: time and memory measured by :func:`block_profiler` on the
  module's ``example_input_array``, where the module is before placement), as one
  :class:`~lightning_mgpu.placement.planning.plan.PlacementPlan` that every rank shares.
* :func:`check_staged_model`: refuses, before any process starts, what the staged pipeline
  cannot run (SyncBatchNorm, activation recomputation, manual optimization; a parameter
  that stages on different devices both use, only where this torch cannot copy it).
* :func:`place_modules`: every module's own tensors on its stage's device
  (:func:`~lightning_mgpu.placement.planning.split_points.stage_of_modules`).
* :func:`run_logged`: runs a LightningModule-like object's ``training_step`` through the
  staged step; its ``self.log`` calls, made once per micro-batch in the micro-batches'
  threads, are collected and replayed once, in the calling thread, with the
  sample-weighted mean over the micro-batches (the full batch's value for per-sample means
  such as the loss).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from numbers import Number
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_mgpu._compat.torch import apply_to_own_tensors
from lightning_mgpu.placement.planning.block_profile import profile_blocks
from lightning_mgpu.placement.running.handover import current_microbatch
from lightning_mgpu.placement.running.microbatch import map_tensors, split_batch
from lightning_mgpu.placement.planning.plan import PlacementPlan, check_sizes, plan_stages
from lightning_mgpu.placement.planning.profile import LayerCost, profile_batch_size
from lightning_mgpu.placement.planning.split_points import (
    block_costs,
    check_split_points,
    points_from_sizes,
    stage_of_modules,
)
from lightning_mgpu.placement.running.engine import StagedStep

__all__ = ["block_profiler", "check_staged_model", "choose_split_points", "place_modules", "run_logged"]


def block_profiler(module: nn.Module, microbatches: int) -> Optional[Callable[[list[str]], list[LayerCost]]]:
    """``measure(candidates)`` for :func:`choose_split_points`: the candidate blocks profiled
    (:func:`~lightning_mgpu.placement.planning.block_profile.profile_blocks`) on one micro-batch of the module's
    ``example_input_array`` (at least 2 samples with BatchNorm), run through its forward where the module is now;
    None without an ``example_input_array``."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        return None
    _, sizes = split_batch(example, 1)
    rows = profile_batch_size(sizes[0], microbatches, module)
    piece = map_tensors(example, lambda t: t[:rows] if t.dim() > 0 else t)

    def run() -> Any:
        if isinstance(piece, (tuple, list)):
            return module(*piece)
        if isinstance(piece, dict):
            return module(**piece)
        return module(piece)

    def measure(candidates: list[str]) -> list[LayerCost]:
        was_training = module.training
        module.train()
        try:
            return profile_blocks(module, candidates, run)
        finally:
            module.train(was_training)

    return measure


def choose_split_points(
    module: nn.Module,
    *,
    split_points: Optional[Sequence[str]],
    candidates: Callable[[], list[str]],
    balance: Union[str, Sequence[int]],
    devices: Sequence[torch.device],
    microbatches: int,
    rank_zero: bool,
    broadcast: Callable[[Any], Any],
    warn: Callable[[str], None],
    measure: Optional[Callable[[list[str]], list[LayerCost]]] = None,
) -> tuple[list[str], PlacementPlan]:
    """The split points in force and their plan. Given ``split_points`` are checked and used as they are; else
    rank 0 plans ``len(devices)`` stages among ``candidates()`` by ``balance`` and ``broadcast`` hands its sizes to
    every rank (DDP needs the same layout everywhere). ``measure(candidates)``: their measured costs (see
    :func:`block_profiler`), for ``balance="time"``/``"memory"``; without it those fall back to parameter counts."""
    k = len(devices)
    sizes: Optional[list[int]] = None
    layers: list[LayerCost] = []
    if split_points is not None:
        points = check_split_points(module, split_points, k)
        chosen: Union[str, list[int]] = "split_points"
    else:
        names = candidates()
        if len(names) < k:
            raise ValueError(
                f"{type(module).__name__} has {len(names)} candidate split point(s) ({names}) but "
                f"devices_per_replica={k}: pass split_points=[...] naming where each stage begins"
            )
        if not isinstance(balance, str):
            sizes = check_sizes(balance, len(names), k)
            chosen = list(sizes)
        else:
            chosen = balance
            if rank_zero:
                by = balance
                if balance != "params" and measure is None:
                    warn(
                        f"HybridParallelStrategy(balance={balance!r}) needs a sample to measure the candidate blocks: "
                        "set `example_input_array` on the LightningModule (one batch of its forward's input). "
                        "Balancing them by parameter count instead."
                    )
                    by = "params"
                layers = block_costs(module, names)
                if by != "params" and measure is not None:
                    try:
                        layers = measure(names)
                    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
                        warn(
                            f"HybridParallelStrategy(balance={balance!r}): measuring the candidate blocks on "
                            f"`example_input_array` failed ({type(exc).__name__}: {exc}); balancing them by "
                            "parameter count instead."
                        )
                        by = "params"
                sizes = plan_stages(layers, devices, by, microbatches=microbatches).sizes
            sizes = list(broadcast(sizes))
        assert sizes is not None
        points = points_from_sizes(names, sizes)
    plan = PlacementPlan(
        devices=[str(d) for d in devices],
        sizes=sizes or [1] * k,
        balance=chosen,
        microbatches=microbatches,
        layers=layers if sizes is not None and layers and sum(sizes) == len(layers) else [],
    )
    return points, plan


def check_staged_model(
    module: nn.Module, split_points: Sequence[str], devices: Sequence[torch.device], *, checkpoint: str
) -> None:
    """Raise ``ValueError`` naming what the staged pipeline cannot run in ``module`` and how to fix it."""
    if checkpoint != "never":
        raise ValueError(
            f"checkpoint={checkpoint!r} is not supported with split_points or schedule='1f1b'/'zero_bubble' yet: the "
            "staged pipeline keeps every stage's activations until its backward. Use checkpoint='never' (1F1B already "
            "bounds them to K micro-batches per stage), or split an nn.Sequential (split_module) with schedule='gpipe'."
        )
    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError(
            "manual optimization (automatic_optimization = False) is not supported with split_points or schedule="
            "'1f1b'/'zero_bubble': the pipeline runs training_step once per micro-batch and computes the gradients "
            "itself. Use automatic optimization, or split an nn.Sequential (split_module) with schedule='gpipe'."
        )
    if any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise ValueError(
            "the model contains SyncBatchNorm: its collectives would run in the pipeline's micro-batch threads, in an "
            "order that differs between ranks. Use BatchNorm (per micro-batch statistics) or GroupNorm/LayerNorm."
        )


def place_modules(module: nn.Module, split_points: Sequence[str], devices: Sequence[torch.device]) -> None:
    """Move every module's own parameters and buffers to its stage's device (definition order decides the stage);
    a parameter or buffer registered by several modules (tied embeddings) goes with the first of them, and the
    others use a copy (:mod:`~lightning_mgpu.placement.running.shared_params`)."""
    stages = stage_of_modules(module, split_points)
    placed: set[int] = set()
    for name, sub in module.named_modules():
        apply_to_own_tensors(sub, _mover(devices[stages.get(name, 0)], placed))


def _mover(device: torch.device, placed: set[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def move(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) in placed:
            return tensor
        placed.add(id(tensor))
        return tensor.to(device)

    return move


def run_logged(
    staged: StagedStep, owner: Any, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``staged.run(step, *args, **kwargs)`` with ``owner.log`` collected per micro-batch and replayed once (see above)."""
    real_log = owner.log
    calls: list[tuple[int, float, str, Any, tuple[Any, ...], dict[str, Any]]] = []
    lock = threading.Lock()

    def log(name: str, value: Any, *log_args: Any, **log_kwargs: Any) -> None:
        where = current_microbatch()
        if where is None:
            real_log(name, value, *log_args, **log_kwargs)
            return
        with lock:
            calls.append((where[0], where[1], name, value, log_args, log_kwargs))

    owner.log = log
    try:
        result = staged.run(step, *args, **kwargs)
    finally:
        owner.__dict__.pop("log", None)
    order: list[str] = []
    by_name: dict[str, list[tuple[int, float, Any, tuple[Any, ...], dict[str, Any]]]] = {}
    for index, weight, name, value, log_args, log_kwargs in sorted(calls, key=lambda call: call[0]):
        if name not in by_name:
            order.append(name)
        by_name.setdefault(name, []).append((index, weight, value, log_args, log_kwargs))
    for name in order:
        entries = by_name[name]
        values = [value for _, _, value, _, _ in entries]
        _, _, _, log_args, log_kwargs = entries[0]
        if all(isinstance(value, torch.Tensor) and value.numel() == 1 for value in values):
            combined: Any = sum(w * value.detach().float().to(values[0].device) for _, w, value, _, _ in entries)
        elif all(isinstance(value, Number) and not isinstance(value, bool) for value in values):
            combined = float(sum(w * float(value) for _, w, value, _, _ in entries))
        else:
            combined = values[-1]  # e.g. a torchmetrics Metric: updated by every micro-batch, logged once
        real_log(name, combined, *log_args, **log_kwargs)
    return result
