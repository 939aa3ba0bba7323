"""What the watch reads of the main thread: its stack from another thread, the user's line in it, and what counts as progress."""

from __future__ import annotations

import os
import threading
import time

import lightning
import torch

from lightning_mgpu.watch.sampling import (
    Frame,
    Progress,
    ThreadMeters,
    c10d_call,
    caller_frame,
    main_stack,
    signature,
    user_frame,
)

TORCH = os.path.dirname(torch.__file__)
LIGHTNING = os.path.dirname(lightning.__file__)


def test_the_main_threads_stack_is_read_from_another_thread_while_it_waits() -> None:
    seen: list[list[Frame]] = []
    ready = threading.Event()

    def look() -> None:
        ready.wait()
        seen.append(main_stack())

    thread = threading.Thread(target=look)
    thread.start()
    ready.set()
    thread.join()  # the main thread blocks here while the other thread reads its stack
    frames = seen[0]
    assert frames[-1].function in ("join", "_wait_for_tstate_lock")  # innermost: threading's wait
    mine = user_frame(frames)
    assert mine is not None and mine.file == __file__
    assert mine.function == "test_the_main_threads_stack_is_read_from_another_thread_while_it_waits"
    assert "thread.join()" in mine.code


def test_the_users_line_and_the_caller_of_a_collective() -> None:
    frames = [
        Frame("/project/train.py", 90, "main"),
        Frame(os.path.join(LIGHTNING, "pytorch", "trainer", "trainer.py"), 584, "fit"),
        Frame("/project/model.py", 40, "training_step"),
        Frame(os.path.join(LIGHTNING, "pytorch", "strategies", "ddp.py"), 303, "barrier"),
        Frame(os.path.join(TORCH, "distributed", "c10d_logger.py"), 83, "wrapper"),
        Frame(os.path.join(TORCH, "distributed", "distributed_c10d.py"), 5356, "barrier"),
    ]
    assert user_frame(frames) == frames[2]
    assert caller_frame(frames) == frames[3]  # Lightning's barrier() called torch's
    assert c10d_call(frames) == "barrier"
    assert c10d_call(frames[:3]) is None
    assert user_frame(frames[1:2]) is None


def test_progress_is_a_counter_a_new_stack_cpu_outside_a_collective_or_io() -> None:
    progress = Progress(cpu_share=0.05, io_bytes=1 << 20)
    sample = {"counter": 1, "stack": 11, "cpu_s": 1.0, "io": 0, "in_collective": False}
    assert progress.sample(now=0.0, **sample) == 0.0
    assert progress.sample(now=5.0, **sample) == 5.0  # nothing moved
    assert progress.sample(now=6.0, **{**sample, "counter": 2}) == 0.0
    sample["counter"] = 2
    assert progress.sample(now=8.0, **{**sample, "cpu_s": 1.2}) == 0.0  # 0.2 s of CPU in 2 s: working
    sample["cpu_s"] = 1.2
    assert progress.sample(now=10.0, **{**sample, "cpu_s": 1.25}) == 2.0  # 0.05 s in 2 s: below 5%: idle
    sample["cpu_s"] = 1.25
    assert progress.sample(now=12.0, **{**sample, "cpu_s": 2.0, "in_collective": True}) == 4.0  # spinning in one
    sample["cpu_s"] = 2.0
    assert progress.sample(now=14.0, **{**sample, "io": 2 << 20}) == 0.0  # a checkpoint written


def test_a_poll_loop_is_progress_once_then_idle() -> None:
    """A loop cycling through the same stacks (waiting on a queue, polling a store) stops counting after one cycle."""
    progress = Progress()
    base = {"counter": 1, "cpu_s": 0.0, "io": 0, "in_collective": False}
    idle = [progress.sample(stack=(11, 12)[t % 2], now=float(t), **base) for t in range(30)]
    assert idle[:3] == [0.0, 0.0, 1.0]  # the second stack is new once
    assert idle[-1] == 28.0


def test_the_main_threads_cpu_time_is_its_own() -> None:
    meters = ThreadMeters()
    before = meters.cpu_s()
    other = threading.Thread(target=lambda: sum(i * i for i in range(500_000)))
    other.start()
    other.join()
    idle_main = meters.cpu_s() - before
    started = time.thread_time()
    sum(i * i for i in range(500_000))
    worked = time.thread_time() - started
    assert meters.cpu_s() - before >= 0.8 * worked > idle_main
    assert meters.io_bytes() >= 0


def test_signature_changes_with_the_stack() -> None:
    a = [Frame("/x.py", 1, "f"), Frame("/x.py", 2, "g")]
    assert signature(a) == signature(list(a)) != signature(a[:1]) != signature([Frame("/x.py", 3, "g")])
