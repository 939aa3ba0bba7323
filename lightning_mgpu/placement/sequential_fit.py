"""What the hybrid strategy needs to split an ``nn.Sequential`` in a fit (the fill-drain
:class:`~lightning_mgpu.placement.pipeline.Pipeline`), kept free of Lightning.

* :func:`find_split_module`: the ``nn.Sequential`` to split (``split_module``, else the
  LightningModule's only ``nn.Sequential`` child).
* :func:`check_sequential`: refuses what the pipeline cannot run (too few layers, shared
  parameters, SyncBatchNorm, randomness under recomputation) and returns the BatchNorm
  warning when micro-batching changes its numerics.
* :func:`capture_input`: one batch of the split module's input, from the model's
  ``example_input_array`` pushed through the model (buffers and RNG restored after).
* :func:`measure_layers`: per-layer costs for the planner, measured on one micro-batch
  (:func:`~lightning_mgpu.placement.planning.profile.profile_layers`) or, without a sample,
  parameter counts only (:func:`static_costs`).
* :class:`PipelinedSequential`: the split ``nn.Sequential`` during a fit, with
  :func:`install_pipeline` / :func:`remove_pipeline` swapping its class in and out (its
  children, hence its ``state_dict``, never change).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_mgpu._compat.torch import is_batchnorm
from lightning_mgpu.placement.running.microbatch import map_tensors
from lightning_mgpu.placement.pipeline import Pipeline, check_recompute_randomness
from lightning_mgpu.placement.planning.plan import check_sizes
from lightning_mgpu.placement.planning.profile import LayerCost, profile_batch_size, profile_layers

__all__ = [
    "PipelinedSequential",
    "capture_input",
    "check_sequential",
    "device_capacity",
    "find_split_module",
    "install_pipeline",
    "measure_layers",
    "remove_pipeline",
    "static_costs",
]

_PIPELINE_ATTRIBUTE = "lightning_mgpu_pipeline"


class PipelinedSequential(nn.Sequential):
    """The split ``nn.Sequential`` during a fit: same children (same state_dict), pipelined forward."""

    lightning_mgpu_pipeline: Pipeline

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Sequential's own name
        return self.lightning_mgpu_pipeline.forward(input)


def install_pipeline(seq: nn.Sequential, pipeline: Pipeline) -> type:
    """Make ``seq`` run ``pipeline`` in its forward; returns its class, for :func:`remove_pipeline`."""
    original = type(seq)
    seq.__class__ = PipelinedSequential
    object.__setattr__(seq, _PIPELINE_ATTRIBUTE, pipeline)  # not a submodule: nn.Module.__setattr__ would register it
    return original


def remove_pipeline(seq: nn.Sequential, original: type) -> None:
    """Undo :func:`install_pipeline`."""
    seq.__class__ = original
    seq.__dict__.pop(_PIPELINE_ATTRIBUTE, None)


def find_split_module(module: nn.Module, split_module: Optional[str]) -> tuple[str, nn.Sequential]:
    """``(name, nn.Sequential)`` to split: ``split_module`` if given, else ``module``'s only ``nn.Sequential`` child."""
    if split_module is not None:
        try:
            found = module.get_submodule(split_module)
        except AttributeError:
            found = None
        if not isinstance(found, nn.Sequential):
            what = "nothing" if found is None else type(found).__name__
            raise ValueError(
                f"split_module={split_module!r}: {type(module).__name__}.{split_module} is {what}, "
                "not an nn.Sequential. Point split_module at the nn.Sequential holding the layers to split."
            )
        return split_module, found
    candidates = [(n, child) for n, child in module.named_children() if isinstance(child, nn.Sequential)]
    if len(candidates) != 1:
        names = ", ".join(n for n, _ in candidates) or "none"
        raise ValueError(
            f"HybridParallelStrategy needs to know which nn.Sequential of {type(module).__name__} to split: it has "
            f"{len(candidates)} nn.Sequential children ({names}). Pass split_module='<attribute name>'."
        )
    return candidates[0]


def check_sequential(
    module: nn.Module,
    name: str,
    seq: nn.Sequential,
    *,
    num_stages: int,
    balance: Union[str, Sequence[int]],
    microbatches: int,
    checkpoint: str,
    devices: Optional[Sequence[torch.device]],
) -> Optional[str]:
    """Raise ``ValueError`` for what the ``nn.Sequential`` pipeline cannot run; return a warning for BatchNorm
    with micro-batches or recomputation (its numerics differ from full-batch training), else None."""
    k = num_stages
    if len(seq) < k:
        raise ValueError(
            f"`{name}` has {len(seq)} layer(s) but devices_per_replica={k}: every device needs at least one layer. "
            f"Use devices_per_replica <= {len(seq)} or a deeper nn.Sequential."
        )
    if not isinstance(balance, str):
        check_sizes(balance, len(seq), k)
    inside = {id(p) for p in seq.parameters()}
    outside = [
        n
        for n, p in module.named_parameters(remove_duplicate=False)
        if id(p) in inside and not n.startswith(name + ".")
    ]
    if outside:
        raise ValueError(
            f"parameters shared between `{name}` and the rest of the model are not supported by the hybrid strategy "
            f"({', '.join(outside[:3])}): the pipeline would accumulate their gradient separately. Untie them or move "
            "the sharing module inside the split nn.Sequential, or use split_points (the staged pipeline sums a "
            "shared parameter's gradients over its stages)."
        )
    owner: dict[int, int] = {}
    for index, layer in enumerate(seq):
        for p in layer.parameters():
            if owner.setdefault(id(p), index) != index:
                raise ValueError(
                    f"layers {owner[id(p)]} and {index} of `{name}` share a parameter: the hybrid strategy may place "
                    "them on different devices and would accumulate its gradient twice. Untie them or keep the "
                    "sharing layers in one layer of the nn.Sequential (e.g. wrap them in a sub-module)."
                )
    check_recompute_randomness(list(seq), checkpoint, None if devices is None else list(devices))
    if any(isinstance(m, nn.SyncBatchNorm) for m in seq.modules()):
        raise ValueError(
            f"`{name}` contains SyncBatchNorm: its collectives would run in the pipeline's stage threads, in an order "
            "that differs between ranks. Use BatchNorm (per micro-batch statistics) or GroupNorm/LayerNorm."
        )
    if any(is_batchnorm(m) for m in seq.modules()) and (microbatches > 1 or checkpoint != "never"):
        updates = microbatches * (2 if checkpoint != "never" else 1)
        return (
            f"`{name}` contains BatchNorm with microbatches={microbatches}, checkpoint={checkpoint!r}: "
            "in training, BatchNorm normalises each micro-batch with that micro-batch's statistics (as in GPipe) "
            f"and updates its running statistics up to {updates} times per step (recomputation updates them again), "
            "so results differ from full-batch training. Use microbatches=1 and checkpoint='never', a larger "
            "batch, or GroupNorm/LayerNorm for identical numerics."
        )
    return None


class _Captured(Exception):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("captured")
        self.value = value


def capture_input(module: nn.Module, seq: nn.Sequential, device: torch.device) -> Optional[torch.Tensor]:
    """The input ``seq`` receives when ``module`` runs its ``example_input_array`` (None without one, or when the
    forward never reaches ``seq``). Nothing after ``seq`` runs; buffers (e.g. BatchNorm statistics before it) and
    the random state are restored."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        return None

    def capture(_: nn.Module, args: tuple[Any, ...]) -> None:
        raise _Captured(args[0].detach())

    handle = seq.register_forward_pre_hook(capture)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng(devices=[d for d in {device} if d.type == "cuda"]), torch.no_grad():
            example = map_tensors(example, lambda t: t.to(device))
            if isinstance(example, (tuple, list)):
                module(*example)
            elif isinstance(example, dict):
                module(**example)
            else:
                module(example)
    except _Captured as captured:
        return captured.value
    finally:
        handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return None


def measure_layers(
    seq: nn.Sequential, sample: Optional[torch.Tensor], *, microbatches: int, device: torch.device, threads: int
) -> list[LayerCost]:
    """Per-layer costs: measured on one micro-batch of ``sample`` (at least 2 rows when ``seq`` has BatchNorm,
    see :func:`~lightning_mgpu.placement.planning.profile.profile_batch_size`), else parameter counts only."""
    if sample is None:
        return static_costs(seq)
    rows = profile_batch_size(sample.shape[0], microbatches, seq)
    return profile_layers(seq, sample[:rows], device=device, threads=threads)


def static_costs(seq: nn.Sequential) -> list[LayerCost]:
    """Parameter counts only (no sample to run): enough for balance="params" or given sizes."""
    costs = []
    for index, (name, layer) in enumerate(seq.named_children()):
        costs.append(LayerCost.from_parameters(index, name, type(layer).__name__, list(layer.parameters())))
    return costs


def device_capacity(device: torch.device) -> Optional[float]:
    """A device's memory in bytes for the planner's capacity check (None: the CPU, not checked)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return None
