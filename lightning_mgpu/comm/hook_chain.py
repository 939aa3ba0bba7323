"""The chain of functions DDP calls for each gradient bucket, and the protocol that callbacks use to join it.

DDP accepts one communication hook per wrapper. What we register is a composition, innermost
first (order matters; each step says why):

1. the reduction itself: a compression hook (fp16/bf16/PowerSGD), the user's ``ddp_comm_hook``,
   or, when only a wrapper asked for a Python hook, :class:`PrescaledAllreduce` (DDP's averaging
   all-reduce with the 1/n moved onto the loss);
2. PowerSGD's complex-parameter views (each complex gradient handed over as its real view), then
   its layout keeper (its memory follows parameters, not bucket numbers): innermost, they must
   see buckets exactly as PowerSGD does;
3. on gloo, PowerSGD finishes one bucket before the next starts (its chained all-reduces
   would otherwise interleave differently on each rank);
4. the user's ``ddp_comm_wrapper``;
5. wrappers added by callbacks (:meth:`CommHookHost.add_comm_hook_wrapper`, e.g. ``CommProfiler``'s
   timer), outermost, so they see the whole reduction; a *pausable* wrapper can be switched off
   between steps: behind a gate when a Python hook stays anyway, or by leaving DDP altogether
   (the strategy re-wraps the model) when that gives back DDP's built-in C++ all-reduce.

Callbacks depend only on :class:`CommHookHost`, never on a strategy class.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lightning_mgpu._compat.torch import powersgd_hooks_leave_cpu_buckets_alone
from lightning_mgpu.comm import powersgd_memory
from lightning_mgpu.comm.compression import CommHook, PrescaledAllreduce

CommHookWrapper = Callable[[CommHook], CommHook]


@runtime_checkable
class CommHookHost(Protocol):
    """What a strategy offers to callbacks that wrap its DDP communication hook.

    ``TunedDDPStrategy`` and ``HybridParallelStrategy`` implement it; ``CommProfiler`` uses it.
    """

    def add_comm_hook_wrapper(self, wrapper: CommHookWrapper, *, pausable: bool = False) -> None:
        """Wrap the hook DDP will use with ``wrapper(hook) -> hook``; before DDP is set up."""

    def set_comm_hook_wrappers(self, on: bool) -> bool:
        """Switch pausable wrappers on/off between optimizer steps; False if it cannot now."""

    @property
    def wire_ratio(self) -> Optional[float]:
        """Bytes on the wire per byte of gradient (1.0 plain, 0.5 fp16/bf16); None if not a fixed ratio."""

    @property
    def tuning_active(self) -> bool:
        """True while ``bucket_cap_mb="auto"`` measures candidates (steps are not ordinary then)."""


class HookChain:
    """Builds the communication hook of one strategy from its parts (see the module docstring).

    The strategy owns one chain for its lifetime; wrappers belong to one fit (:meth:`clear`).
    """

    def __init__(self) -> None:
        self.wrappers: list[tuple[CommHookWrapper, bool]] = []  # (wrapper, pausable)
        self.wrappers_on = True
        self.prescaler: Optional[PrescaledAllreduce] = None
        """Set while the reduction is our prescaled all-reduce (the loss carries the 1/n)."""
        self.powersgd_keeper: Optional[powersgd_memory.PowerSGDLayoutKeeper] = None

    def add(self, wrapper: CommHookWrapper, *, pausable: bool) -> None:
        self.wrappers.append((wrapper, pausable))

    @property
    def has_pausable(self) -> bool:
        return any(pausable for _, pausable in self.wrappers)

    def needs_python_hook(
        self, *, base_hook: Optional[Callable[..., Any]], user_wrapper: Optional[Callable[..., Any]]
    ) -> bool:
        """True when DDP runs a Python hook whatever the pausable wrappers do."""
        return base_hook is not None or user_wrapper is not None or any(not p for _, p in self.wrappers)

    def clear(self) -> None:
        """Forget the fit's wrappers (callbacks add them again in their ``setup``)."""
        self.wrappers.clear()
        self.wrappers_on = True
        self.prescaler = None

    def build(
        self,
        *,
        hook: Optional[CommHook],
        state: Any,
        user_wrapper: Optional[CommHookWrapper],
        world_size: int,
        backend: str,
        named_parameters: Callable[[], Sequence[tuple[str, torch.Tensor]]],
        on_new_powersgd_keeper: Callable[[powersgd_memory.PowerSGDLayoutKeeper], None],
        python_hook_anyway: bool,
    ) -> Optional[tuple[CommHook, Any]]:
        """The (hook, state) to register, or None for DDP's built-in all-reduce.

        ``python_hook_anyway``: a Python hook stays whatever the pausable wrappers do (then
        they are gated rather than removed). ``named_parameters`` lists DDP's parameters in
        reducer order (for PowerSGD's keeper, built lazily); ``on_new_powersgd_keeper`` lets
        the strategy restore checkpointed PowerSGD memory into a new keeper.
        """
        keep_all = self.wrappers_on or python_hook_anyway
        wrappers = [(wrapper, pausable) for wrapper, pausable in self.wrappers if keep_all or not pausable]
        self.prescaler = None
        if hook is None and user_wrapper is None and not wrappers:
            return None  # DDP's built-in C++ all-reduce: the fastest path
        if hook is None and user_wrapper is None:
            # A Python hook only because a wrapper (e.g. CommProfiler) asked for one: keep DDP's
            # averaging all-reduce, with the 1/n on the loss (see PrescaledAllreduce).
            self.prescaler = PrescaledAllreduce(world_size)
            hook, state = self.prescaler, None
        elif hook is None:
            hook, state = default_hooks.allreduce_hook, None
        assert hook is not None
        hook_is_powersgd = hook in (powerSGD_hook.powerSGD_hook, powerSGD_hook.batched_powerSGD_hook)
        if hook_is_powersgd:
            powersgd_hooks_leave_cpu_buckets_alone()  # CPU buckets where a GPU is visible: torch syncs them as CUDA
        if hook is powerSGD_hook.powerSGD_hook:
            # Innermost, the hook's per-parameter views: a complex gradient as its whole real view.
            hook = powersgd_memory.complex_as_real(hook)
            if powersgd_memory.supports(state):
                keeper = self.powersgd_keeper
                if keeper is None or keeper.state is not state:
                    keeper = self.powersgd_keeper = powersgd_memory.PowerSGDLayoutKeeper(state, named_parameters())
                    on_new_powersgd_keeper(keeper)
                hook = keeper.wrap(hook)
        if hook_is_powersgd and backend == "gloo":
            hook = powersgd_memory.one_bucket_at_a_time(hook)
        if user_wrapper is not None:
            hook = user_wrapper(hook)
        for wrapper, pausable in wrappers:
            hook = gated(wrapper, hook, self) if pausable and python_hook_anyway else wrapper(hook)
        return hook, state


def gated(wrapper: CommHookWrapper, hook: CommHook, switch: Any) -> CommHook:
    """``wrapper(hook)`` while ``switch.wrappers_on``, ``hook`` itself while it is off."""
    wrapped = wrapper(hook)

    # No annotations: DDP rejects a hook whose annotations are strings (this module's are).
    def gate(state, bucket):  # type: ignore[no-untyped-def]
        return (wrapped if switch.wrappers_on else hook)(state, bucket)

    gate.__name__ = gate.__qualname__ = getattr(wrapped, "__name__", "hook")  # DDP logs the hook's name
    return gate
