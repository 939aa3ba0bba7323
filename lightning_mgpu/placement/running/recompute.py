"""Activation checkpointing in the pipeline: which micro-batches recompute their stage forwards, and what cannot be.

``checkpoint="never"`` keeps every micro-batch's activations until its backward;
``"always"`` keeps only the inputs of each recomputed *unit* and runs the unit's forward again
in the stage's backward; ``"except_last"`` recomputes every micro-batch of a step but the last,
whose backward comes first (GPipe's choice). A unit is a module of the model (by default the
split-point modules and the model's repeated blocks that hold no split point,
:func:`~lightning_mgpu.placement.planning.split_points.recompute_units`; for an
``nn.Sequential`` split with its loss outside, each stage's layers as one unit). While the
engine lives, a unit's ``forward`` is an instance attribute (removed by :meth:`Recompute.close`;
the class, hooks and ``state_dict`` stay as they are): in a recomputing micro-batch's training
forward it runs through non-reentrant ``torch.utils.checkpoint`` (random state kept, autocast
as in the forward), elsewhere as itself. The recomputation runs as the same micro-batch and
stage, so the ``nn.Linear`` fast path and shared parameters take the same path as in the
forward: the same kernels on the same values, so the same gradients.

Refused, with the reason: random layers (dropout) recomputed over several CPU stages (they
share the CPU's generator, so a recomputed mask would differ from the forward's:
:func:`check_recompute_randomness`, before anything runs), and a unit that writes its own input
in place (at its forward; a unit whose first layer is in place, e.g. ``nn.ReLU(inplace=True)``,
gets a copy instead). An input changed in place after the unit's forward is refused by torch
at the recomputation (its version counter), before any wrong gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from lightning_mgpu._compat.torch import tensor_version
from lightning_mgpu.placement.running.handover import PipelineModelError, current_run, current_stage, running
from lightning_mgpu.placement.running.microbatch import map_tensors

__all__ = ["CHECKPOINT_MODES", "Recompute", "check_recompute_randomness", "recomputes", "starts_in_place"]

CHECKPOINT_MODES = ("never", "except_last", "always")

_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def recomputes(checkpoint: str, microbatch: int, num_microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` of ``num_microbatches`` runs its stage forwards again in backward."""
    return checkpoint == "always" or (checkpoint == "except_last" and microbatch < num_microbatches - 1)


def starts_in_place(module: nn.Module) -> bool:
    """Whether the first leaf module ``module`` runs is an in-place one (``nn.ReLU(inplace=True)``)."""
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))


def check_recompute_randomness(modules: Sequence[nn.Module], checkpoint: str, devices: Sequence[torch.device]) -> None:
    """Refuse recomputing random layers (dropout with ``p > 0``) in ``modules`` when several stages share the CPU's
    generator: recomputation replays a forward with the random state saved before it, but the other CPU stages draw
    from the same generator in between, so the recomputed masks, hence the gradients, would be wrong."""
    cpu_stages = sum(torch.device(device).type == "cpu" for device in devices)
    if checkpoint == "never" or cpu_stages < 2:
        return
    if any(isinstance(m, _RANDOM_LAYERS) and m.p > 0 for module in modules for m in module.modules()):
        raise ValueError(
            f"checkpoint={checkpoint!r} with dropout in a model split over {cpu_stages} CPU stages: the stages share "
            "the CPU's random generator, so recomputed dropout masks would differ from the forward's and the gradients "
            "would be wrong. Use checkpoint='never', or put the stages on GPUs (one generator each)."
        )


class Recompute:
    """The recomputed units of one engine (``owner``): see the module docstring."""

    def __init__(self, root: nn.Module, units: Sequence[str], *, owner: object) -> None:
        self.owner = owner
        self.units = [(name, root.get_submodule(name)) for name in units]
        for name, module in self.units:
            module.forward = self._forward(name, module)  # an instance attribute: close() removes it

    def _forward(self, name: str, module: nn.Module) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            micro = current_run()
            if micro is None or micro.owner is not self.owner or not micro.recompute or not torch.is_grad_enabled():
                return type(module).forward(module, *args, **kwargs)
            return self._checkpointed(name, module, micro, current_stage(), args, kwargs)

        return forward

    def _checkpointed(
        self, name: str, module: nn.Module, micro: Any, stage: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        inputs: list[torch.Tensor] = []
        map_tensors((args, kwargs), inputs.append)
        versions = [tensor_version(t) for t in inputs]
        copy = starts_in_place(module)

        def run(*run_args: Any, **run_kwargs: Any) -> Any:
            if copy:  # the in-place first layer writes a copy: recomputing reads the input as it was
                run_args, run_kwargs = map_tensors((run_args, run_kwargs), torch.Tensor.clone)
            with running(micro, stage):  # in backward: the forward's micro-batch and stage again
                return type(module).forward(module, *run_args, **run_kwargs)

        out = activation_checkpoint(run, *args, use_reentrant=False, **kwargs)
        if versions != [tensor_version(t) for t in inputs]:
            raise PipelineModelError(
                f"{name!r} changes its input in place: its forward cannot be run again in backward (activation "
                "checkpointing) on the input it was given. Make it work on a copy, or use checkpoint='never'."
            )
        return out

    def close(self) -> None:
        """Give the units their class's ``forward`` back."""
        for _, module in self.units:
            module.__dict__.pop("forward", None)
        self.units = []
