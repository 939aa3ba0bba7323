"""The model's ``DistributedDataParallel`` wrapper: built, re-built with another bucket size, its
communication-hook chain, what its reducer holds, and the rule for a static graph's first backward.

* :class:`DDPModel` builds the wrapper from the keyword arguments it is given (the bucket size is
  always an argument, never read back from strategy state), holds the hook chain of
  :mod:`lightning_mgpu.comm.hook_chain` (the strategy registers it on every backend; Lightning
  registers hooks on CUDA only), and replaces the wrapper between optimizer steps
  (:meth:`DDPModel.rebuild`: no weight broadcast, ``init_sync=False``; the old reducer detached
  from autograd, the hooks registered on the wrapper itself carried over, the old buckets freed at
  once). ``bucket_cap_mb="auto"`` re-wraps with each size it measures, ``CommProfiler``'s windows to
  take their timing hook out and back.
* **A static graph's first backward synchronises.** With ``static_graph=True`` DDP learns the graph
  during a wrapper's first backward and refuses (an internal assert in its reducer) a first backward
  under ``no_sync``: stock Lightning crashes on the first step of any fit with
  ``accumulate_grad_batches > 1``. :meth:`DDPModel.no_sync` lets that backward synchronise: its
  micro-batch is averaged at once, the window's later ones are added locally and averaged at its last
  backward, which gives the same average (one all-reduce more, once per wrapper). In that window the
  loss is not prescaled (:class:`~lightning_mgpu.comm.compression.PrescaledAllreduce` only sums, and
  would count the part averaged early once per rank): its last all-reduce divides what each rank holds.
* :func:`read_bucket_layout`: the buckets DDP built, read from its logging data.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu._compat.torch import carry_module_hooks, ddp_rebuilt_buckets, detach_reducer
from lightning_mgpu.comm.hook_chain import HookChain


@dataclass(frozen=True)
class BucketInfo:
    """One gradient bucket as DDP built it (after its rebuild on the first iteration)."""

    index: int
    """Position in launch order: bucket 0 holds the gradients that are ready first."""
    bytes: int
    """Size of the bucket's flat gradient buffer in bytes."""
    num_params: int
    param_names: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class DDPModel:
    """One strategy's DDP wrapper machinery (see the module docstring); the chain outlives fits, its
    wrappers belong to one fit (:meth:`HookChain.clear`)."""

    def __init__(self) -> None:
        self.hooks = HookChain()
        self._synced: Optional[weakref.ref[DistributedDataParallel]] = None  # a backward synchronised it
        self._forcing_sync = False  # inside no_sync(), synchronising a static graph's first backward
        self._early_sync_window = False  # this accumulation window synchronised before its last backward

    # ------------------------------------------------------------------ building

    @staticmethod
    def build(
        module: Module, *, ddp_kwargs: dict[str, Any], device_ids: Optional[list[int]]
    ) -> DistributedDataParallel:
        """``module`` in a new ``DistributedDataParallel`` with these options."""
        if device_ids is None:
            return DistributedDataParallel(module=module, device_ids=None, **ddp_kwargs)
        with torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]  # see torch's notes on CUDA streams and DDP
            return DistributedDataParallel(module=module, device_ids=device_ids, **ddp_kwargs)

    @staticmethod
    def rebuild(old: DistributedDataParallel, build: Callable[[], DistributedDataParallel]) -> DistributedDataParallel:
        """A new DDP wrapper from ``build()`` in place of ``old``; ``old`` is left unusable."""
        detach_reducer(old)  # the old reducer must not see the next backward
        new = build()
        carry_module_hooks(old, new)
        # The old wrapper sits in reference cycles (frames kept by its constructor), freed only
        # by a full gc.collect() (~0.25 s in a Lightning process). Its reducer (the gradient
        # buckets: as much memory as the gradients) is not in them: dropping the wrapper's
        # references frees it now.
        for name in ("logger", "reducer"):
            if name in old.__dict__:
                delattr(old, name)
        return new

    # ------------------------------------------------------------------ backward

    def prescale(self, loss: torch.Tensor) -> None:
        """Before a backward: the 1/n on the loss when the reduction is the prescaled all-reduce."""
        if not self._early_sync_window and self.hooks.prescaler is not None:
            self.hooks.prescaler.prescale(loss)

    def after_backward(self, model: Any) -> None:
        """After a backward: remember a wrapper whose gradients a backward synchronised."""
        if isinstance(model, DistributedDataParallel) and model.require_backward_grad_sync:
            self._synced = weakref.ref(model)
            if not self._forcing_sync:
                self._early_sync_window = False  # the window's last backward: the next one starts afresh

    @contextmanager
    def no_sync(self, model: Any) -> Iterator[None]:
        """DDP's ``no_sync`` for a backward inside an accumulation window, except a static graph's first."""
        if not isinstance(model, DistributedDataParallel):
            yield None
            return
        first = self._synced is None or self._synced() is not model
        if model.static_graph and first:
            self._forcing_sync = self._early_sync_window = True
            try:
                yield None
            finally:
                self._forcing_sync = False
            return
        with model.no_sync():
            yield None


def reducer_named_params(model: DistributedDataParallel) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) in the order DDP's reducer indexes them."""
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor]] = []
    for module_name, module in model.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if param.requires_grad and full not in ignored and id(param) not in seen:
                seen.add(id(param))
                named.append((full, param))
    return named


def read_bucket_layout(model: object) -> Optional[list[BucketInfo]]:
    """Gradient buckets as DDP built them, in launch order; None until DDP recorded them.

    DDP rebuilds its buckets once, at the start of the second training step, from the order
    in which gradients became ready during the first; it records the rebuilt layout in its
    logging data during the third step. This reads that record (without allocating any
    gradient-sized buffer).
    """
    if not isinstance(model, DistributedDataParallel):
        return None
    rebuilt = ddp_rebuilt_buckets(model)
    if rebuilt is None:
        return None
    sizes, indices = rebuilt
    names = [name for name, _ in reducer_named_params(model)]
    return [
        BucketInfo(index=b, bytes=size, num_params=len(idx), param_names=tuple(names[i] for i in idx))
        for b, (size, idx) in enumerate(zip(sizes, indices, strict=True))
    ]
