"""What the watch thread reads of the main thread: its Python stack, the user's line in it, its CPU time and I/O.

* :func:`main_stack`: the main thread's frames, outermost first (read from another thread: the
  main thread may be blocked in C++, its frames are there all the same).
* :func:`user_frame`: the innermost frame of the *user's* code: not torch, Lightning, torchmetrics,
  this package, the standard library or another installed package. For a rank blocked in ``barrier()`` that is the line of the
  LightningModule that called it; for a rank stuck in its dataset, the line of ``__getitem__``.
* :func:`caller_frame`: the innermost frame outside torch: who called the collective (the user's
  line, or e.g. Lightning's SIGTERM check before each batch).
* :func:`c10d_call`: the ``torch.distributed`` function the stack is inside, if any (kind of a
  collective entered through a name the wrappers do not see).
* :class:`ThreadMeters`: the main thread's CPU time and bytes read and written (``/proc``).
* :class:`Progress`: turns those samples into seconds without progress (see its docstring).
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from lightning_mgpu._compat.python import thread_frame

__all__ = [
    "shown",
    "Frame",
    "Progress",
    "ThreadMeters",
    "c10d_call",
    "caller_frame",
    "main_stack",
    "signature",
    "user_frame",
]

MAX_FRAMES = 200


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def code(self) -> str:
        """The source line, stripped ("" when the file cannot be read)."""
        return linecache.getline(self.file, self.line).strip()

    def where(self) -> str:
        """``file:line``, the file relative to the working directory when inside it."""
        return f"{shown(self.file)}:{self.line}"

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function, "code": self.code}

    @classmethod
    def from_dict(cls, data: Any) -> Optional["Frame"]:
        if not isinstance(data, dict):
            return None
        return cls(str(data.get("file", "?")), int(data.get("line", 0)), str(data.get("function", "?")))


def shown(path: str) -> str:
    """A file as a report shows it: relative to the working directory when inside it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith(os.pardir) else relative


def _package_dir(name: str) -> Optional[str]:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return str(Path(path).parent) + os.sep if path else None


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = {_package_dir(name) for name in ("torch", "lightning", "lightning_fabric", "pytorch_lightning")}
    dirs |= {_package_dir(name) for name in ("torchmetrics", "lightning_mgpu", "lightning_utilities")}
    # Installed packages are libraries too (a user's own code is rarely installed but in place: pip install -e).
    paths = sysconfig.get_paths()
    dirs |= {str(Path(paths[key])) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    return tuple(sorted(d for d in dirs if d))


_TORCH: Optional[str] = None
_C10D = os.sep + os.path.join("torch", "distributed") + os.sep
_WATCH = str(Path(__file__).parent) + os.sep


def is_library(file: str) -> bool:
    return file.startswith("<") or file.startswith(_library_dirs())


def main_stack(ident: Optional[int] = None) -> list[Frame]:
    """The frames of thread ``ident`` (default: the main thread), outermost first; [] if it has ended."""
    frame: Optional[FrameType] = thread_frame(threading.main_thread().ident if ident is None else ident)  # type: ignore[arg-type]
    frames: list[Frame] = []
    while frame is not None and len(frames) < MAX_FRAMES:
        frames.append(Frame(frame.f_code.co_filename, frame.f_lineno or 0, frame.f_code.co_name))
        frame = frame.f_back
    frames.reverse()
    return frames


def signature(frames: list[Frame]) -> int:
    """A number that changes when the stack does (the code position of every frame)."""
    return hash(tuple((f.file, f.line, f.function) for f in frames))


def user_frame(frames: list[Frame]) -> Optional[Frame]:
    """The innermost frame of the user's code (see the module docstring)."""
    return next((f for f in reversed(frames) if not is_library(f.file)), None)


def caller_frame(frames: list[Frame]) -> Optional[Frame]:
    """The innermost frame outside torch (and this watch's wrappers): who called into it (the user, Lightning,
    this package)."""
    global _TORCH
    if _TORCH is None:
        _TORCH = _package_dir("torch") or (os.sep + "torch" + os.sep)
    return next((f for f in reversed(frames) if not f.file.startswith((_TORCH, "<", _WATCH))), None)


def c10d_call(frames: list[Frame]) -> Optional[str]:
    """The outermost ``torch.distributed`` function on the stack (the one its caller called), if any."""
    for frame in frames:
        if _C10D in frame.file and frame.file.endswith("distributed_c10d.py"):
            return frame.function
    return None


class ThreadMeters:
    """CPU seconds and bytes read + written (any file or socket) of one thread: the main thread by default."""

    def __init__(self, thread: Optional[threading.Thread] = None) -> None:
        thread = thread or threading.main_thread()
        self._clock: Optional[int] = None
        try:
            self._clock = time.pthread_getcpuclockid(thread.ident)  # type: ignore[arg-type]
        except (AttributeError, OSError, TypeError):  # not on this platform
            pass
        self._io = Path(f"/proc/self/task/{thread.native_id}/io")

    def cpu_s(self) -> float:
        if self._clock is None:
            return 0.0
        try:
            return time.clock_gettime(self._clock)
        except OSError:  # the thread has ended
            return 0.0

    def io_bytes(self) -> int:
        try:
            text = self._io.read_text()
        except OSError:
            return 0
        total = 0
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name in ("rchar", "wchar"):
                total += int(value)
        return total


class Progress:
    """Seconds since the main thread last made progress, from samples taken by the watch thread.

    Progress is any of:

    * the heartbeat's counter moved (a phase, a batch, a collective left);
    * a stack not seen since the last progress (a poll loop cycles through the same few stacks:
      after one cycle it is no longer progress);
    * CPU time: at least ``cpu_share`` of the time since the last sample, *outside* a collective
      (a thread waiting in gloo uses none; a thread spinning on a device while waiting would);
    * at least ``io_bytes`` bytes read or written (a checkpoint written, data read).
    """

    def __init__(self, *, cpu_share: float = 0.05, io_bytes: int = 1 << 20, now: float = 0.0) -> None:
        self.cpu_share, self.io_bytes = cpu_share, io_bytes
        self.last_progress = now
        self._last: Optional[tuple[int, float, int, float]] = None  # counter, cpu, io, time
        self._stacks: set[int] = set()

    def sample(self, *, counter: int, stack: int, cpu_s: float, io: int, in_collective: bool, now: float) -> float:
        """Take one sample; return the seconds without progress."""
        last = self._last
        self._last = (counter, cpu_s, io, now)
        if last is None:
            self.last_progress, self._stacks = now, {stack}
            return 0.0
        counter0, cpu0, io0, then = last
        elapsed = max(now - then, 1e-6)
        strong = (
            counter != counter0
            or (not in_collective and cpu_s - cpu0 >= self.cpu_share * elapsed)
            or io - io0 >= self.io_bytes
        )
        if strong:
            self.last_progress, self._stacks = now, {stack}
        elif stack not in self._stacks:
            self.last_progress = now
            if len(self._stacks) < 1000:
                self._stacks.add(stack)
        return now - self.last_progress
