"""A parameter shared by stages on different devices (tied embeddings): one parameter, a copy where it is used.

GPT-2's output layer is its token embedding (``lm_head.weight is transformer.wte.weight``):
with the embedding in the first stage and the output layer in the last, the parameter lives
on the first stage's device (where its module is defined first,
:func:`~lightning_mgpu.placement.planning.split_points.stage_of_modules`) and the output layer runs on
another device. :class:`SharedParameterCopies` runs every such module with a
**differentiable copy** of the parameter on its own stage's device (``param.to(device,
copy=True)``, made in a forward pre-hook). The module is not changed: the copy is put in the
parameter's place in every torch call the forward makes, by a :class:`~torch.overrides.TorchFunctionMode`
entered in the pre-hook and left in a forward hook that runs even when the forward raises. A
mode is the calling thread's alone, so a block that two stages call at the same time (two
micro-batch threads) sees the copy in one and the parameter in the other; replacing the
module's attribute instead would show one thread's copy to the other. The copy's backward sends its gradient to the one parameter,
so the pipeline sums both stages' parts as it does on one device; the optimizer and
DDP see one parameter, the ``state_dict`` is unchanged. A forward that reads the parameter
outside the module that holds it (``F.linear(x, self.wte.weight)``) is not covered: give the
sharing module its own attribute (``self.lm_head.weight = self.wte.weight``), as GPT-2 does.
Nor is a forward that hands the parameter to code torch does not see (a C++ extension called
without going through a torch function).

:func:`foreign_uses` lists the (module, parameter name, stage) that need a copy. On devices
of one kind (CPU stages) nothing does; ``always=True`` copies anyway, which is how the tests
exercise the GPU path on a CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_mgpu.placement.running.handover import current_run, current_stage
from lightning_mgpu.placement.planning.split_points import stage_of_modules

__all__ = ["SharedParameterCopies", "foreign_uses", "holders"]


def foreign_uses(
    root: nn.Module, split_points: Sequence[str], devices: Sequence[torch.device], *, always: bool = False
) -> list[tuple[str, str, int]]:
    """``(module name, parameter name, stage)`` for every use of a parameter by a module of a stage other than the
    one that holds it, where the two stages' devices differ (with ``always``: wherever they are). A parameter is
    held by the stage of the first module, in definition order, that registers it (:func:`place_modules`
    puts it there)."""
    uses: list[tuple[str, str, int]] = []
    holder = holders(root, split_points)
    stages = stage_of_modules(root, split_points)
    for name, module in root.named_modules(remove_duplicate=False):
        stage = stages.get(name, 0)
        for pname, param in module.named_parameters(recurse=False, remove_duplicate=False):
            held = holder[id(param)]
            if held != stage and (always or devices[held] != devices[stage]):
                uses.append((name, pname, stage))
    return uses


def holders(root: nn.Module, split_points: Sequence[str]) -> dict[int, int]:
    """``id(parameter)`` -> the stage that holds it: that of the first module, in definition order, registering it."""
    stages = stage_of_modules(root, split_points)
    holder: dict[int, int] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holder.setdefault(id(param), stages.get(name, 0))
    return holder


class _InPlaceOf(TorchFunctionMode):
    """While entered (in one thread): every torch function, tensor method and tensor property given one of the
    parameters gets its copy instead."""

    def __init__(self, copies: Mapping[int, torch.Tensor]) -> None:
        super().__init__()
        self.copies = copies  # id(parameter) -> its copy

    def _swap(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.copies.get(id(value), value)
        if type(value) in (list, tuple):  # torch.cat([...]); not a subclass such as torch.Size
            return type(value)(self._swap(item) for item in value)
        if type(value) is dict:
            return {key: self._swap(item) for key, item in value.items()}
        return value

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None,
    ) -> Any:
        return func(*self._swap(tuple(args)), **self._swap(dict(kwargs or {})))


class SharedParameterCopies:
    """Hooks that run a module whose parameter another stage holds with a differentiable copy on the calling
    stage's device.

    The calling stage is the one the calling micro-batch runs, so a block called by two stages gets the right
    device each time; outside a pipelined step (validation) a module runs on its own stage. With stages on one
    device and no ``always`` nothing is hooked. Otherwise every module that registers parameters gets a pair
    of hooks (a module called from another stage than its own cannot be told in advance), which return at once
    when the call comes from the stage that holds its parameters."""

    def __init__(
        self, root: nn.Module, split_points: Sequence[str], devices: Sequence[torch.device], *, always: bool = False
    ) -> None:
        self.devices = list(devices)
        self.always = always
        self.uses = foreign_uses(root, split_points, devices, always=always)
        holder = holders(root, split_points)
        stages = stage_of_modules(root, split_points)
        self._local = threading.local()
        self._handles = []
        if not always and len(set(self.devices)) == 1:
            return
        hooked: set[int] = set()
        for name, module in root.named_modules(remove_duplicate=False):
            own = [(pname, holder[id(param)]) for pname, param in module.named_parameters(recurse=False)]
            if not own or id(module) in hooked:
                continue
            hooked.add(id(module))
            self._handles.append(module.register_forward_pre_hook(self._enter(own, stages.get(name, 0))))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _stack(self) -> list[Any]:
        stack: list[Any] = getattr(self._local, "stack", None) or []
        self._local.stack = stack
        return stack

    def _enter(self, own: list[tuple[str, int]], home: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            stage = current_stage() if current_run() is not None else home
            stage = stage if 0 <= stage < len(self.devices) else home
            device = self.devices[stage]
            copies = {}
            for name, held in own:
                if held != stage and (self.always or self.devices[held] != device):
                    param = getattr(module, name)
                    copies[id(param)] = param.to(device, copy=True)
            mode = _InPlaceOf(copies) if copies else None
            if mode is not None:
                mode.__enter__()  # type: ignore[no-untyped-call]  # torch leaves TorchFunctionMode.__enter__ untyped
            self._stack().append(mode)

        return hook

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        stack = self._stack()
        mode = stack.pop() if stack else None
        if mode is not None:
            mode.__exit__(None, None, None)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
