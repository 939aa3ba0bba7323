"""Replacing a model's DDP wrapper by a new one between optimizer steps, hooks and all.

Used by ``bucket_cap_mb="auto"`` (a new bucket size) and by ``CommProfiler``'s windows (DDP's
built-in all-reduce back between windows). DDP cannot change its buckets or unregister a hook,
so a new wrapper is built around the same module: no weight broadcast (``init_sync=False``;
the parameters are equal on every rank already), the old reducer detached from autograd, the
hooks registered on the wrapper module itself carried over (e.g. ``CommProfiler``'s forward
hook), and the old reducer's buckets freed at once.
"""

from __future__ import annotations

from typing import Callable

from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu._compat.torch import carry_module_hooks, detach_reducer


def replace_ddp_wrapper(
    old: DistributedDataParallel, build: Callable[[], DistributedDataParallel]
) -> DistributedDataParallel:
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
