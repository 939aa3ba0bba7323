"""Private CPython names, each behind a function of ours with a guard (see ``_compat``).

Append new shims at the end as self-contained blocks: a ``guarded(...)`` declaration,
then the public function that uses it.
"""

from __future__ import annotations

from lightning_mgpu._compat import guarded  # noqa: F401


# ---------------------------------------------------------------------------------------
# The hang watch (lightning_mgpu/watch): another thread's Python stack, read while that thread is blocked
# ---------------------------------------------------------------------------------------
import sys as _sys
from types import FrameType as _FrameType

_CURRENT_FRAMES = guarded(
    "sys",
    "_current_frames",
    required=True,
    why="the hang watch reads the main thread's stack from its own thread while the main thread is blocked "
    "(documented by CPython, underscored as a debugging aid; faulthandler only prints)",
)


def thread_frame(ident: int) -> "_FrameType | None":
    """The innermost frame of the thread ``ident`` (``threading.get_ident()`` numbering), or None if it ended."""
    return _sys._current_frames().get(ident)


import os as _os

_EXIT = guarded(
    "os",
    "_exit",
    required=True,
    why="a hung rank ends its process at once: its main thread is blocked in C++ (a collective) and cannot be "
    "unwound by sys.exit from the watch's thread",
)


def exit_now(code: int) -> None:
    """End this process at once with status ``code`` (no cleanup: flush what must be said first)."""
    _os._exit(code)
