"""``HookedDDPStrategy``: DDP whose communication hook is a composed chain that callbacks can join.

The base of our DDP strategies. It wraps the model in ``DistributedDataParallel`` itself (so
that a wrapper can be replaced between steps), registers the hook chain of
:mod:`lightning_mgpu.comm.hook_chain` on every backend (Lightning registers hooks on CUDA
only), implements the :class:`~lightning_mgpu.comm.hook_chain.CommHookHost` protocol that
``CommProfiler`` uses, and re-wraps the model when a pausable wrapper leaves or rejoins DDP.
Subclasses say whether a compression hook will be set (:attr:`compression_hook_pending`),
whether the steps are being measured (:attr:`tuning_active`), and which keyword arguments
DDP gets (:attr:`ddp_kwargs`).
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mgpu._compat.lightning import in_accumulation_window
from lightning_mgpu.comm import powersgd_memory
from lightning_mgpu.comm.hook_chain import CommHookWrapper, HookChain
from lightning_mgpu.strategies.ddp_layout import reducer_named_params
from lightning_mgpu.strategies.ddp_options import SUPPORTS_INIT_SYNC
from lightning_mgpu.strategies.managed_ddp import ManagedDDPStrategy
from lightning_mgpu.strategies.rewrap import replace_ddp_wrapper


class HookedDDPStrategy(ManagedDDPStrategy):
    """Lightning's DDP with a composed communication hook on every backend (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hooks = HookChain()
        self._synced_wrapper: Optional[weakref.ref[DistributedDataParallel]] = None
        """The DDP wrapper whose gradients a backward has synchronised (see :meth:`block_backward_sync`)."""
        self._forcing_sync = False  # inside block_backward_sync, synchronising a static graph's first backward
        self._early_sync_window = False  # this accumulation window synchronised before its last backward

    # ------------------------------------------------------------------ what subclasses decide

    @property
    def compression_hook_pending(self) -> bool:
        """True when a compression hook will be set when DDP is configured (a Python hook in any case)."""
        return False

    @property
    def tuning_active(self) -> bool:
        """True while the steps are being measured (the hook must not change then)."""
        return False

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments given to ``DistributedDataParallel``."""
        return self.user_ddp_kwargs

    def on_new_powersgd_keeper(self, keeper: powersgd_memory.PowerSGDLayoutKeeper) -> None:
        """Called when the chain makes a new PowerSGD memory keeper (e.g. to restore a checkpoint's)."""

    @property
    def powersgd_keeper(self) -> Optional[powersgd_memory.PowerSGDLayoutKeeper]:
        """With ``compression="powersgd"``: the keeper of PowerSGD's memory (None before DDP is set up)."""
        return self._hooks.powersgd_keeper

    @property
    def prescaler(self) -> Any:
        """The prescaled all-reduce in use (a wrapper asked for a Python hook and nothing else did), or None."""
        return self._hooks.prescaler

    # ------------------------------------------------------------------ the DDP wrapper

    def wrap_model(self, model: Module, **extra: Any) -> DistributedDataParallel:
        """``model`` in a new ``DistributedDataParallel`` with this strategy's options (and ``extra``)."""
        device_ids = self.determine_ddp_device_ids()
        kwargs = {**self.ddp_kwargs, **extra}
        if device_ids is None:
            return DistributedDataParallel(module=model, device_ids=None, **kwargs)
        with torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]  # see torch's notes on CUDA streams and DDP
            return DistributedDataParallel(module=model, device_ids=device_ids, **kwargs)

    # ------------------------------------------------------------------ the communication hook (CommHookHost)

    def add_comm_hook_wrapper(self, wrapper: CommHookWrapper, *, pausable: bool = False) -> None:
        """Wrap the communication hook DDP will use (the compression hook, or plain
        all-reduce) with ``wrapper(hook) -> hook``; e.g. ``CommProfiler`` times buckets so.

        DDP accepts one hook, registered when the model is wrapped: call this before
        ``fit`` reaches ``strategy.setup`` (a callback's ``setup`` hook is early enough).
        A ``pausable`` wrapper is one that :meth:`set_comm_hook_wrappers` may switch off
        between steps: DDP then runs the hook it wraps, as if it were not there.
        """
        if isinstance(self.model, DistributedDataParallel):
            raise RuntimeError(
                "add_comm_hook_wrapper() was called after DDP registered its communication hook; "
                "call it from a callback's setup() hook, before training starts."
            )
        self._hooks.add(wrapper, pausable=pausable)

    @property
    def has_own_comm_hook(self) -> bool:
        """True when DDP runs a Python communication hook whatever the pausable wrappers
        (compression, ``ddp_comm_hook``, ``ddp_comm_wrapper``, a wrapper that is not pausable);
        False when without them it would use its built-in C++ all-reduce."""
        if self.compression_hook_pending:  # its hook is set when DDP is configured
            return True
        return self._hooks.needs_python_hook(base_hook=self.comm_hook, user_wrapper=self.comm_wrapper)

    @property
    def comm_hook_wrappers_on(self) -> bool:
        """Whether the pausable wrappers (:meth:`add_comm_hook_wrapper`) are switched on."""
        return self._hooks.wrappers_on

    def set_comm_hook_wrappers(self, on: bool) -> bool:
        """Switch the pausable wrappers added by :meth:`add_comm_hook_wrapper` on or off, between
        optimizer steps; e.g. ``CommProfiler`` profiles a window of steps so.

        DDP cannot unregister a hook. With a Python hook in any case (:attr:`has_own_comm_hook`)
        the wrappers stay registered behind a gate that calls the hook they wrap while they are
        off. Otherwise the model is re-wrapped in a new DDP (no weight broadcast), which runs
        DDP's built-in C++ all-reduce while the wrappers are off and the timed hook when they
        are on. Like any new DDP wrapper, the new one uses its initial bucket layout for one step
        and rebuilds it at the start of the next. Returns whether the wrappers are now ``on`` as
        asked; False (nothing changed) while ``bucket_cap_mb="auto"`` is still measuring, so that
        every candidate is timed with the same hook, and when this torch's DDP cannot be built
        without broadcasting the weights again (no ``init_sync``).
        """
        if on == self._hooks.wrappers_on:
            return True
        if self.tuning_active:
            return False
        rewrap = (
            self._hooks.has_pausable and not self.has_own_comm_hook and isinstance(self.model, DistributedDataParallel)
        )
        if rewrap and not SUPPORTS_INIT_SYNC:
            return False
        self._hooks.wrappers_on = on
        if rewrap:
            self._rewrap_ddp()
        return True

    def register_comm_hooks(self) -> None:
        """Register the hook chain on the DDP wrapper (Lightning does so on CUDA only; DDP supports every backend)."""
        model = self.model
        assert isinstance(model, DistributedDataParallel)
        built = self._hooks.build(
            hook=self.comm_hook,
            state=self.comm_state,
            user_wrapper=self.comm_wrapper,
            world_size=self.world_size,
            backend=self.resolved_backend(),
            named_parameters=lambda: reducer_named_params(model),
            on_new_powersgd_keeper=self.on_new_powersgd_keeper,
            python_hook_anyway=self.has_own_comm_hook,
        )
        if built is not None:
            hook, state = built
            model.register_comm_hook(state=state, hook=hook)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if not self._early_sync_window:
            # A window that synchronised early holds averaged gradients already: the prescaled all-reduce,
            # which only sums, would count them once per rank. Its buckets are divided as DDP's own are.
            self._hooks.prescale(closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        model = self.model
        if isinstance(model, DistributedDataParallel) and model.require_backward_grad_sync:
            self._synced_wrapper = weakref.ref(model)
            if not self._forcing_sync:
                self._early_sync_window = False  # the window's last backward: the next one starts afresh

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """``no_sync`` for the backwards of a gradient-accumulation window, except a static graph's first.

        With ``static_graph=True`` DDP learns the graph during a wrapper's first backward and refuses
        (an internal assert in its reducer) a first backward under ``no_sync``: stock Lightning crashes
        on the first step of any fit with ``accumulate_grad_batches > 1``. Here that backward
        synchronises instead: the micro-batch's gradients are averaged at once, the window's later
        ones are added locally and averaged at its last backward, which gives the same average (one
        all-reduce more, once per wrapper: at the start of a fit and after a re-wrap). In that window
        the loss is not prescaled (see :class:`~lightning_mgpu.comm.compression.PrescaledAllreduce`):
        its last all-reduce divides what each rank holds, the part averaged early included.
        """
        model = self.model
        first = self._synced_wrapper is None or self._synced_wrapper() is not model
        if isinstance(model, DistributedDataParallel) and model.static_graph and first:
            self._forcing_sync = self._early_sync_window = True
            try:
                yield None
            finally:
                self._forcing_sync = False
            return
        with super().block_backward_sync():
            yield None

    def _rewrap_ddp(self) -> None:
        """Replace the DDP wrapper by a new one built from the current settings, hooks carried over."""
        module = self.lightning_module
        assert module is not None
        if in_accumulation_window(module.trainer):  # callers re-wrap after an optimizer step; never risk it
            raise RuntimeError(
                f"{type(self).__name__}: refusing to re-wrap the model inside a gradient-accumulation window "
                f"(global step {module.trainer.global_step}); please report this."
            )
        old = self.model
        assert isinstance(old, DistributedDataParallel)
        if self._hooks.powersgd_keeper is None and powersgd_memory.reset_bucket_memory(self.comm_state):
            warnings.warn(
                "bucket_cap_mb='auto' re-wrapped the model: the PowerSGD memory of this hook is kept per bucket "
                "number and cannot be remapped (batch_tensors_with_same_shape=True or batched_powerSGD_hook), so "
                "its error feedback and warm start were reset.",
                stacklevel=2,
            )
        # Parameters are already equal on every rank: no broadcast of the weights again.
        extra = {"init_sync": False} if SUPPORTS_INIT_SYNC else {}
        self.model = replace_ddp_wrapper(old, lambda: self.wrap_model(module, **extra))
        self.register_comm_hooks()
