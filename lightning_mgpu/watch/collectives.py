"""Which collective the main thread is in: ``torch.distributed``'s collective functions, wrapped while a run is watched.

Each wrapper notes the collective's kind and sequence number in the rank's
:class:`~lightning_mgpu.watch.heartbeat.Heartbeat` on the way in and clears it on the way out
(two attribute writes and a clock read): a rank blocked in one says which, and how long it has
waited. Where it was called from is not taken here (walking the stack on every call would cost):
the watch thread reads the main thread's stack when it needs the call site.

* Only calls made by the main thread count (a pipeline's stage threads, a DataLoader's pin-memory
  thread are not what blocks a step); a call made inside another tracked call (a collective built
  on others) counts once.
* The wrappers replace the attributes of the ``torch.distributed`` module, which Lightning and user
  code call through (``torch.distributed.barrier()``, ``dist.all_reduce(...)``). A name imported
  before the run (``from torch.distributed import barrier``) is not seen; the stack still shows it.
  DDP's gradient all-reduce is C++ (not a Python call): a rank blocked in it is in ``backward``.
* :func:`install` never wraps twice, :func:`uninstall` puts the originals back unless something else
  wrapped them since (then ours stay, passing every call straight through).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_mgpu.watch.heartbeat import Heartbeat

__all__ = ["TRACKED", "install", "installed", "uninstall"]

TRACKED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
)
"""The ``torch.distributed`` functions tracked (the blocking ones; an ``async_op=True`` call is in and out at once)."""

_MARK = "__lightning_mgpu_watch__"
_active: Optional[Heartbeat] = None
_main = threading.main_thread().ident
_originals: dict[str, Callable[..., Any]] = {}


def _tracked(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        beat = _active
        if beat is None or beat.collective is not None or threading.get_ident() != _main:
            return original(*args, **kwargs)
        beat.entered(kind, _group_size(kwargs.get("group")))
        try:
            return original(*args, **kwargs)
        finally:
            beat.left()

    setattr(tracked, _MARK, original)
    return tracked


def _group_size(group: Any) -> int:
    try:
        return int(dist.get_world_size(group))
    except (RuntimeError, ValueError, TypeError):
        return 0


def install(heartbeat: Heartbeat) -> None:
    """Track the main thread's collectives in ``heartbeat`` from now on (the main thread of this process)."""
    global _active, _main
    _main = threading.main_thread().ident
    for name in TRACKED:
        current = getattr(dist, name, None)
        if current is None:
            continue
        if not hasattr(current, _MARK):
            _originals[name] = current
            setattr(dist, name, _tracked(name, current))
    _active = heartbeat


def installed() -> bool:
    return _active is not None


def uninstall() -> None:
    """Stop tracking; the originals go back where nothing else replaced our wrappers since."""
    global _active
    _active = None
    for name, original in list(_originals.items()):
        current = getattr(dist, name, None)
        if current is not None and getattr(current, _MARK, None) is original:
            setattr(dist, name, original)
            del _originals[name]
