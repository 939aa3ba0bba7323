"""A signal seen at once by the watch's thread while the main thread is blocked in C++, where its Python handler cannot run."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Iterator

import pytest
import torch.distributed as dist

from lightning_mgpu.watch.signals import SignalListener


@pytest.fixture
def usr1_handled() -> Iterator[list[float]]:
    """SIGUSR1 with a Python handler (only signals with one reach the wakeup fd); the times it ran."""
    times: list[float] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: times.append(time.monotonic()))
    try:
        yield times
    finally:
        signal.signal(signal.SIGUSR1, previous)


def send_later(delay: float, sent: list[float]) -> None:
    def send() -> None:
        time.sleep(delay)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=send, daemon=True).start()


def test_a_signal_reaches_the_listener_while_the_main_thread_is_blocked_in_cpp(usr1_handled: list[float]) -> None:
    listener = SignalListener()
    assert listener.start()
    seen: list[tuple[list[int], float]] = []

    def watch() -> None:
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            got = listener.wait(0.05)
            if got:
                seen.append((got, time.monotonic()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    sent: list[float] = []
    send_later(0.1, sent)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        dist.HashStore().wait(["never"], timedelta(seconds=1))  # C++ waiting: no Python handler runs meanwhile
    returned = time.monotonic()
    watcher.join()
    listener.stop()
    ((signums, at),) = seen
    assert signums == [signal.SIGUSR1]
    assert at - sent[0] < 0.5 and at < returned - 0.4  # seen at once, long before the main thread came back
    assert usr1_handled and usr1_handled[0] >= returned - 0.05  # the Python handler: only once the call returned
    assert returned - started >= 0.95


def test_the_wakeup_fd_before_is_fed_and_put_back(usr1_handled: list[float]) -> None:
    theirs_read, theirs_write = socket.socketpair()
    theirs_read.setblocking(False)
    theirs_write.setblocking(False)
    before = signal.set_wakeup_fd(theirs_write.fileno())
    try:
        listener = SignalListener()
        assert listener.start()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert listener.wait(1.0) == [signal.SIGUSR1]
        assert list(theirs_read.recv(16)) == [signal.SIGUSR1]  # passed on to the fd that was there
        listener.stop()
        assert signal.set_wakeup_fd(theirs_write.fileno()) == theirs_write.fileno()  # theirs again
        assert not listener.listening and listener.wait(0.01) == []
    finally:
        signal.set_wakeup_fd(before)
        theirs_read.close()
        theirs_write.close()


def test_only_the_main_thread_can_start_it() -> None:
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(SignalListener().start()))
    thread.start()
    thread.join()
    assert results == [False]
    assert signal.set_wakeup_fd(-1) == -1  # nothing was set
