"""``CommProfiler`` under Lightning's own ``DDPStrategy`` (``strategy="ddp"``): the timing hook registered by us.

``TunedDDPStrategy`` offers callbacks its communication hook through the
:class:`~lightning_mgpu.comm.hook_chain.CommHookHost` protocol. Stock ``DDPStrategy`` does not,
so :class:`StockDDPHookHost` implements that protocol for it, keeping what stock DDP would run:

* **No hook of the user's, or on CPU** (where Lightning registers none, even if given): DDP
  would run its built-in averaging all-reduce. We register, once the model is wrapped and
  before the first backward, :class:`~lightning_mgpu.comm.compression.PrescaledAllreduce`
  (the same average; the 1/n goes on the loss in ``on_before_backward``) with the timer around it.
* **The user's ``ddp_comm_hook`` on CUDA**: Lightning registers ``ddp_comm_wrapper(ddp_comm_hook)``
  itself. The timer joins as the outermost wrapper (``ddp_comm_wrapper`` composed), so the
  user's hook runs as given, timed.

DDP cannot unregister a hook, and stock DDP cannot be re-wrapped from outside: between profiling
windows the timer is switched off behind a gate (the plain Python all-reduce stays, ~2% of a
CPU step; ``ddp_tuned`` removes it between windows instead). ``bucket_cap_mb="auto"`` does not
exist there, so :attr:`tuning_active` is always False.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu._compat.lightning import (
    replace_stock_ddp_comm_wrapper,
    stock_ddp_comm_hook,
    stock_ddp_registers_comm_hook,
)
from lightning_mgpu.comm.compression import CommHook, PrescaledAllreduce
from lightning_mgpu.comm.hook_chain import CommHookWrapper, gated

# torch's own hooks whose bytes on the wire are a fixed share of the gradient bytes
_HALF_WIRE_HOOKS = ("fp16_compress_hook", "bf16_compress_hook")


def wire_ratio_of(hook: Optional[Callable[..., Any]]) -> Optional[float]:
    """Bytes on the wire per gradient byte for a user's hook: 0.5 for torch's fp16/bf16 hooks,
    None for PowerSGD (measured per bucket instead), 1.0 otherwise (a plain all-reduce assumed)."""
    if hook is None:
        return 1.0
    name = getattr(hook, "__name__", "")
    if name in _HALF_WIRE_HOOKS or hook in (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook):
        return 0.5
    if hook in (powerSGD_hook.powerSGD_hook, powerSGD_hook.batched_powerSGD_hook):
        return None
    return 1.0


class StockDDPHookHost:
    """The :class:`~lightning_mgpu.comm.hook_chain.CommHookHost` of a stock Lightning ``DDPStrategy``.

    Use: :meth:`add_comm_hook_wrapper` in the callback's ``setup`` (before the strategy wraps the
    model), :meth:`attach` in ``on_fit_start`` (after, before the first backward), :meth:`prescale`
    in ``on_before_backward``, :meth:`detach` at teardown.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.wrappers_on = True
        self.prescaler: Optional[PrescaledAllreduce] = None
        self._wrappers: list[tuple[CommHookWrapper, bool]] = []
        self._via_lightning = stock_ddp_registers_comm_hook(strategy)
        self._undo: Optional[Callable[[], None]] = None
        self._wire_ratio = wire_ratio_of(stock_ddp_comm_hook(strategy) if self._via_lightning else None)

    # ------------------------------------------------------------------ CommHookHost

    @property
    def wire_ratio(self) -> Optional[float]:
        return self._wire_ratio

    @property
    def tuning_active(self) -> bool:
        return False

    def add_comm_hook_wrapper(self, wrapper: CommHookWrapper, *, pausable: bool = False) -> None:
        """Wrap the hook DDP will use; before the strategy wraps the model (a callback's ``setup``)."""
        if isinstance(self.strategy.model, DistributedDataParallel):
            raise RuntimeError("add_comm_hook_wrapper() was called after DDP was set up; call it from setup().")
        self._wrappers.append((wrapper, pausable))
        if self._via_lightning and self._undo is None:
            self._undo = replace_stock_ddp_comm_wrapper(self.strategy, self._compose_after)
            if self._undo is None:  # cannot join Lightning's registration: leave the user's hook alone
                self._wrappers.clear()

    def set_comm_hook_wrappers(self, on: bool) -> bool:
        self.wrappers_on = on
        return True

    # ------------------------------------------------------------------ lifecycle

    @property
    def measures(self) -> bool:
        """Whether the wrappers will be (or are) in DDP's hook."""
        return bool(self._wrappers)

    def attach(self, model: Any) -> bool:
        """After the strategy wrapped the model: register the timed hook ourselves when Lightning does
        not (CPU, or no hook of the user's). False if DDP refused it (another hook is registered)."""
        if not self._wrappers or not isinstance(model, DistributedDataParallel):
            return False
        if self._via_lightning:
            return True  # Lightning registered ddp_comm_wrapper(ddp_comm_hook), our wrapper outermost
        self.prescaler = PrescaledAllreduce(self.strategy.world_size)
        try:
            model.register_comm_hook(state=None, hook=self._compose(self.prescaler))
        except RuntimeError:  # "register_comm_hook ... can only be called once": someone else's hook
            self.prescaler = None
            return False
        return True

    def prescale(self, loss: torch.Tensor) -> None:
        """Put the all-reduce's 1/n on the loss (called with the loss about to be backwarded)."""
        if self.prescaler is not None:
            self.prescaler.prescale(loss)

    def detach(self) -> None:
        """Give the strategy back the user's ``ddp_comm_wrapper`` (a next fit composes again)."""
        if self._undo is not None:
            self._undo()
            self._undo = None
        self._wrappers.clear()
        self.prescaler = None

    # ------------------------------------------------------------------ composition

    def _compose_after(self, user_wrapper: Optional[CommHookWrapper]) -> CommHookWrapper:
        """The wrapper Lightning applies to the user's hook: the user's own wrapper, then ours."""

        def wrap(hook: CommHook) -> CommHook:
            return self._compose(user_wrapper(hook) if user_wrapper is not None else hook)

        return wrap

    def _compose(self, hook: CommHook) -> CommHook:
        for wrapper, pausable in self._wrappers:
            hook = gated(wrapper, hook, self) if pausable else wrapper(hook)
        return hook
