"""A stage's parameter gradients summed over a step's micro-batches and accumulated once (what DDP's reducer needs).

Each micro-batch's backward (``torch.autograd.grad``) hands back that micro-batch's
parameter gradients; :class:`StageGradients` sums them and, at the end of the step,
accumulates the sums into ``.grad`` with **one** ``torch.autograd.backward`` on the
parameters, so every gradient accumulator (and DDP's hook on it) fires exactly once.

The ``nn.Linear`` fast path: summing costs a fresh weight-sized tensor and one more pass
per micro-batch. A stage's plain ``nn.Linear`` layers (exactly that class, no hooks on
them, directly in the stage or in plain ``nn.Sequential`` s inside it) avoid both: their
forward goes through :class:`_AccumulatingLinear`, whose backward adds
``grad_out^T @ input`` straight into the step's running sum (``addmm_``, the same
arithmetic an ``nn.Linear`` backward does) and hands autograd no weight gradient at all.
Under autocast, with global module hooks, or with inputs of another dtype or device than
the weight, those layers run as themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_mgpu._compat.torch import global_module_hooks_registered, module_has_hooks

__all__ = ["StageGradients"]


class StageGradients:
    """The gradient sums of one stage's trainable parameters over a step's micro-batches.

    Used from the stage's worker thread only: :meth:`forward_fn` while forwards run,
    :meth:`start`, :meth:`add` and :meth:`accumulate` during the stage's backward.
    """

    def __init__(self, stage: nn.Module) -> None:
        self.stage = stage
        self.params: list[nn.Parameter] = [p for p in stage.parameters() if p.requires_grad]
        self._sums: list[Optional[torch.Tensor]] = [None] * len(self.params)
        # {id(parameter): running sum} filled by the nn.Linear fast path's backward
        self._linear_sums: dict[int, _GradSum] = {}

    def forward_fn(self, *, autocast_on: bool) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """The stage's forward with its plain ``nn.Linear`` layers accumulating their own
        weight gradients (module docstring), or None where the stage must run as itself:
        not an ``nn.Sequential``, hooks that calling the layers directly would skip,
        autocast on, or no such layer."""
        stage = self.stage
        if (
            type(stage) is not nn.Sequential
            or module_has_hooks(stage)
            or global_module_hooks_registered()
            or autocast_on
        ):
            return None
        layers = [(layer, _accumulates(layer)) for layer in _flat_layers(stage)]
        if not any(fast for _, fast in layers):
            return None
        sums = self._linear_sums

        def run(x: torch.Tensor) -> torch.Tensor:
            for layer, fast in layers:
                if fast and x.dtype == layer.weight.dtype and x.device == layer.weight.device:
                    bias = layer.bias if layer.bias is not None and layer.bias.requires_grad else None
                    weight_sum = sums.setdefault(id(layer.weight), _GradSum())
                    bias_sum = sums.setdefault(id(bias), _GradSum()) if bias is not None else None
                    x = _AccumulatingLinear.apply(x, layer.weight, layer.bias, weight_sum, bias_sum)  # type: ignore[no-untyped-call]  # untyped in torch
                else:
                    x = layer(x)
            return x

        return run

    def start(self) -> None:
        """Begin a step's backward: nothing left over from one that failed half-way."""
        self._sums = [None] * len(self.params)
        for running in self._linear_sums.values():
            running.value = None

    def add(self, grads: Sequence[Optional[torch.Tensor]], grad_in: Optional[torch.Tensor]) -> None:
        """Add one micro-batch's gradients (one per parameter, None where unused); ``grad_in`` is what
        that backward sent upstream."""
        sums = self._sums
        for p, g in enumerate(grads):
            if g is None:
                continue
            if sums[p] is None:
                # autograd may hand back one tensor as both the input's and a parameter's
                # gradient (x + p): never accumulate into what was sent upstream.
                aliased = grad_in is not None and g.data_ptr() == grad_in.data_ptr()
                sums[p] = g.clone() if aliased else g
            else:
                sums[p].add_(g)  # type: ignore[union-attr]

    def accumulate(self) -> None:
        """Accumulate the step's sums into ``.grad``: one accumulation per parameter, so DDP's reducer hooks fire once, here."""
        sums = self._sums
        for p, param in enumerate(self.params):
            running = self._linear_sums.get(id(param))
            if running is None or running.value is None:
                continue
            own, running.value = running.value, None
            sums[p] = own if sums[p] is None else sums[p].add_(own)  # type: ignore[union-attr]
        ready = [(p, g) for p, g in zip(self.params, sums) if g is not None]
        self._sums = [None] * len(self.params)
        if ready:
            torch.autograd.backward([p for p, _ in ready], [g for _, g in ready])


class _GradSum:
    """One parameter's gradient summed over a step's micro-batches (None before the first)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Optional[torch.Tensor] = None


class _AccumulatingLinear(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight (and bias) gradient into running sums
    instead of returning it: no weight-sized tensor per micro-batch, no extra pass."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        weight_sum: _GradSum,
        bias_sum: Optional[_GradSum],
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sums = (weight_sum, bias_sum)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        weight_sum, bias_sum = ctx.sums
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        rows_out = grad_out.reshape(-1, grad_out.shape[-1])
        rows_in = x.reshape(-1, x.shape[-1])
        if weight_sum.value is None:
            weight_sum.value = rows_out.t().matmul(rows_in)
        else:
            weight_sum.value.addmm_(rows_out.t(), rows_in)
        if bias_sum is not None:
            bias_grad = rows_out.sum(0)
            bias_sum.value = bias_grad if bias_sum.value is None else bias_sum.value.add_(bias_grad)
        return grad_x, None, None, None, None


def _flat_layers(module: nn.Module) -> Iterator[nn.Module]:
    """The layers a plain ``nn.Sequential`` runs, nested plain ``nn.Sequential`` s opened up."""
    if type(module) is nn.Sequential and not module_has_hooks(module):
        for child in module:
            yield from _flat_layers(child)
    else:
        yield module


def _accumulates(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear and layer.weight.requires_grad and not module_has_hooks(layer)
