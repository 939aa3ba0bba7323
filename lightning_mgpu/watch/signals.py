"""Signals seen the moment they arrive, even while the main thread is blocked in C++ (a collective).

A Python signal handler runs only when the main thread next executes Python: blocked in gloo's or
NCCL's wait, it never does, and a SIGTERM (a preemption) waits for the collective's timeout.
CPython's own C-level handler, which runs at once on whichever thread the kernel picks, also writes
the signal's number to the *wakeup fd* (``signal.set_wakeup_fd``) when one is set. So the watch sets
one, the write end of a socket pair, and its thread waits on the read end (its sleep between ticks
is that wait): it sees the signal within microseconds and acts for the blocked main thread.

Only signals with a Python handler are written there (our strategies install one for SIGTERM and
SLURM's requeue signal). A wakeup fd set before (asyncio's) is kept: every byte read is passed on to
it, and it is put back when the listener stops. Blocking the signals in the main thread and
``sigwait``-ing in the watch thread would not do: threads started earlier (gloo's, a DataLoader's)
would still take them, and every process started afterwards (DataLoader workers) would inherit
the blocked mask and ignore SIGTERM.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
from typing import Optional

__all__ = ["SignalListener"]


class SignalListener:
    """The wakeup fd and the wait on it (see the module docstring). Start and stop from the main thread."""

    def __init__(self) -> None:
        self._read: Optional[socket.socket] = None
        self._write: Optional[socket.socket] = None
        self._previous = -1

    @property
    def listening(self) -> bool:
        return self._read is not None

    def start(self) -> bool:
        """Set the wakeup fd (False, nothing changed, when not called from the main thread)."""
        if self._read is not None:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)
        try:
            self._previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            read.close()
            write.close()
            return False
        self._read, self._write = read, write
        return True

    def wait(self, timeout: float) -> list[int]:
        """Sleep up to ``timeout`` seconds, less if a signal comes; the signals that came (numbers, in order)."""
        read = self._read
        if read is None:
            return []
        try:
            ready, _, _ = select.select([read], [], [], timeout)
            if not ready:
                return []
            data = read.recv(512)
        except (OSError, ValueError):  # closed by stop() meanwhile
            return []
        if self._previous != -1:
            try:
                os.write(self._previous, data)
            except OSError:
                pass
        return list(data)

    def stop(self) -> None:
        """Put the wakeup fd that was there back (from the main thread), unless someone replaced ours since."""
        read, write = self._read, self._write
        if read is None or write is None:
            return
        if threading.current_thread() is not threading.main_thread():
            return  # closing now would leave the wakeup fd pointing at a number the next open() may reuse
        try:
            current = signal.set_wakeup_fd(self._previous)
            if current != write.fileno():  # not ours any more: leave theirs
                signal.set_wakeup_fd(current)
        except (ValueError, OSError):
            pass
        self._read = self._write = None
        self._previous = -1
        read.close()
        write.close()
