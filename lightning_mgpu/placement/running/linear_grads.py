"""The pipeline's ``nn.Linear`` fast path: weight gradients added in place into the step's sums, or deferred.

Through autograd, every micro-batch's backward of an ``nn.Linear`` allocates a fresh
weight-sized gradient that the stage then adds into its running sum: one more pass over
the weight per micro-batch. With zero-bubble's split backward it is worse: the weight
pass is a second ``torch.autograd.grad`` call from the layer's node. Here, while a
:class:`~lightning_mgpu.placement.running.engine.Pipeline` runs, a plain ``nn.Linear`` of the
model computes in its backward only the gradient of its input (what the previous layer
waits for) and hands the weight's part to the engine: ``grad_out^T @ input`` goes
straight into the stage's running sum with ``addmm_`` (the arithmetic an ``nn.Linear``
backward does, without the temporary), at once, or, in a zero-bubble ``B``, when the
stage runs that micro-batch's ``W`` (the layer's input and output gradient are kept
until then, as Qi et al.'s zero-bubble implementation keeps them).

Which layers: exactly ``nn.Linear`` (not a subclass), trainable weight, each of its
parameters registered by that one module only (a tied or shared weight, e.g. GPT-2's output
layer, goes through autograd as before), and not run with a copy of a parameter held by
another stage. During the engine's life those modules' class is ``_StagedLinear``, an
``nn.Linear`` subclass whose forward is ``nn.Linear``'s except inside a pipelined step's
training forward, with grad enabled, no autocast, and input and weight of one dtype and
device; :meth:`LinearWeightGrads.close` gives them their class back. Their
``state_dict``, hooks and ``isinstance`` checks are unchanged.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from lightning_mgpu.placement.running.handover import MicroRun, current_run, current_stage

__all__ = ["LinearWeightGrads"]

_SWAPPED: Counter[int] = Counter()  # id(module) -> how many engines use its fast path
_SWAP_LOCK = threading.Lock()


class _Slot(NamedTuple):
    """Where one layer's weight (and bias) gradient goes: the indices of the engine's parameters."""

    weight: int
    bias: Optional[int]


class _Target(NamedTuple):
    """One forward call of a fast-path layer: its engine, micro-batch, stage and slot."""

    grads: LinearWeightGrads
    micro: MicroRun
    stage: int
    slot: _Slot


class LinearWeightGrads:
    """The fast path of a :class:`~lightning_mgpu.placement.running.engine.Pipeline` (module docstring).

    ``params``: the engine's trainable parameters (indices are positions here); ``sums[j]``:
    stage ``j``'s running sums by parameter index (the engine's own dicts); ``exclude``: ids of
    parameters that must go through autograd (those run with a copy on another stage)."""

    def __init__(
        self,
        root: nn.Module,
        params: Sequence[nn.Parameter],
        sums: Sequence[dict[int, torch.Tensor]],
        *,
        exclude: frozenset[int] = frozenset(),
    ) -> None:
        self.sums = sums
        index = {id(p): n for n, p in enumerate(params)}
        registrations: Counter[int] = Counter(
            id(p) for _, m in root.named_modules(remove_duplicate=False) for p in m.parameters(recurse=False)
        )
        self.slots: dict[int, _Slot] = {}
        self._layers: list[nn.Module] = []
        for module in root.modules():
            # _StagedLinear: another engine on the same model uses it too (the class stays until both are closed)
            if type(module) not in (nn.Linear, _StagedLinear) or not module.weight.requires_grad:
                continue
            own = [p for p in (module.weight, module.bias) if p is not None]
            if any(registrations[id(p)] != 1 or id(p) in exclude or id(p) not in index for p in own if p.requires_grad):
                continue
            bias = module.bias if module.bias is not None and module.bias.requires_grad else None
            self.slots[id(module)] = _Slot(index[id(module.weight)], None if bias is None else index[id(bias)])
            self._layers.append(module)
        self.accumulated = frozenset(n for slot in self.slots.values() for n in slot if n is not None)
        """Indices of the parameters whose gradients this path computes (autograd hands back None for them)."""
        with _SWAP_LOCK:
            for module in self._layers:
                _SWAPPED[id(module)] += 1
                module.__class__ = _StagedLinear

    def target(self, module: nn.Module, micro: MicroRun, x: torch.Tensor) -> Optional[_Target]:
        slot = self.slots.get(id(module))
        weight = module.weight
        if (
            slot is None
            or x.dtype != weight.dtype
            or x.device != weight.device
            or torch.is_autocast_enabled(x.device.type)
        ):
            return None
        return _Target(self, micro, current_stage(), slot)

    def add(self, target: _Target, grad_out: torch.Tensor, x: torch.Tensor) -> None:
        """One micro-batch's weight (and bias) gradient of one layer, into its stage's sums: now, or at that stage's ``W``
        when the stage is running a split backward (``micro.splitting == stage``)."""
        micro, stage = target.micro, target.stage
        if micro.splitting == stage:
            micro.linear_deferred.setdefault(stage, []).append((target.slot, grad_out, x))
        else:
            self._accumulate(stage, target.slot, grad_out, x)

    def run_deferred(self, micro: MicroRun, stage: int) -> None:
        """Stage ``stage``'s deferred weight gradients of ``micro`` (its ``W``), in the order its ``B`` met them."""
        for slot, grad_out, x in micro.linear_deferred.pop(stage, ()):
            self._accumulate(stage, slot, grad_out, x)

    @torch.no_grad()
    def _accumulate(self, stage: int, slot: _Slot, grad_out: torch.Tensor, x: torch.Tensor) -> None:
        # no_grad: zero-bubble's W runs in a thread with grad mode on, and x (a cut leaf) requires grad: recorded,
        # each addmm_ would chain the step's running sum to every micro-batch's activations until the step ends
        sums = self.sums[stage]
        rows_out = grad_out.reshape(-1, grad_out.shape[-1])
        rows_in = x.reshape(-1, x.shape[-1])
        held = sums.get(slot.weight)
        if held is None:
            sums[slot.weight] = rows_out.t().mm(rows_in)
        else:
            held.addmm_(rows_out.t(), rows_in)
        if slot.bias is not None:
            bias_grad = rows_out.sum(0)
            held = sums.get(slot.bias)
            if held is None:
                sums[slot.bias] = bias_grad
            else:
                held.add_(bias_grad)

    def close(self) -> None:
        """Give the layers their class back (once no other engine uses them)."""
        with _SWAP_LOCK:
            for module in self._layers:
                _SWAPPED[id(module)] -= 1
                if _SWAPPED[id(module)] <= 0:
                    del _SWAPPED[id(module)]
                    module.__class__ = nn.Linear
        self._layers = []
        self.slots = {}


class _StagedLinear(nn.Linear):
    """``nn.Linear`` whose forward, inside a pipelined step that owns it, takes the fast path (module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        micro = current_run()
        if micro is not None and torch.is_grad_enabled():
            grads = getattr(micro.owner, "linear_grads", None)
            target = grads.target(self, micro, input) if isinstance(grads, LinearWeightGrads) else None
            if target is not None:
                out: torch.Tensor = _LinearFunction.apply(input, self.weight, self.bias, target)  # type: ignore[no-untyped-call]  # untyped in torch
                return out
        return nn.functional.linear(input, self.weight, self.bias)


class _LinearFunction(torch.autograd.Function):
    """``F.linear`` whose backward returns only the input's gradient and gives the weight's to the engine."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: _Target
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.target = target
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        target: _Target = ctx.target
        target.grads.add(target, grad_out, x)
        return grad_x, None, None, None
