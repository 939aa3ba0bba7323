"""The watch's protocol, two ranks in one process over one store: declare, report once, every rank exits; and the waits
it must not end (a slow step), the signal that shortens it, a rank past its run, a rank that left.

Each rank's watch runs without its thread (``tick()`` by hand) on a made-up clock, its main thread played by a
sampler that returns a stack: nothing here sleeps or starts a process."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path
from typing import Any, Iterator

import lightning
import pytest
import torch
import torch.distributed as dist

from lightning_mgpu.watch.channel import Channel
from lightning_mgpu.watch.sampling import Frame
from lightning_mgpu.watch.watcher import FINALS_WAIT_S, HANG_EXIT_CODE, LEAVE_WAIT_S, HangWatch, Sample

TORCH = os.path.dirname(torch.__file__)
TRAIN = "/project/train.py"
NO_SUCH_PID = 2**22 + 12345
BARRIER_STACK = [
    Frame(TRAIN, 90, "main"),
    Frame("/venv/site-packages/lightning/pytorch/trainer/trainer.py", 584, "fit"),
    Frame(TRAIN, 40, "training_step"),
    Frame(os.path.join(TORCH, "distributed", "distributed_c10d.py"), 5356, "barrier"),
]
BACKWARD_STACK = [Frame(TRAIN, 90, "main"), Frame(os.path.join(TORCH, "autograd", "graph.py"), 979, "backward")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Rank:
    """One rank's watch and the main thread it watches (a stack, CPU seconds that move when it works)."""

    def __init__(self, rank: int, store: dist.Store, clock: Clock, log_dir: Path, **start: Any) -> None:
        self.rank, self.clock = rank, clock
        self.frames: list[Frame] = BACKWARD_STACK
        self.cpu = 0.0
        self.working = False
        self.exits: list[int] = []
        self.output = io.StringIO()
        self.watch = HangWatch(
            exit=self.exits.append,
            clock=clock,
            sleep=clock.sleep,
            sampler=self.sample,
            output=self.output,
            threaded=False,
        )
        started = self.watch.start(
            owner="test",
            store=store,
            rank=rank,
            world_size=2,
            timeout=20.0,
            stage="fit",
            log_dir=str(log_dir),
            **start,
        )
        assert started

    def sample(self) -> Sample:
        if self.working:
            self.cpu += 0.5
        return Sample(self.frames, self.cpu, 0)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[tuple[Rank, Rank, Clock]]:
    store, clock = dist.HashStore(), Clock()
    pair = Rank(0, store, clock, tmp_path), Rank(1, store, clock, tmp_path)
    try:
        yield pair[0], pair[1], clock
    finally:
        for rank in pair:
            rank.watch.stop()


def run(ranks: tuple[Rank, ...], clock: Clock, seconds: float) -> None:
    """Tick every rank's watch once a (made-up) second, until every one has ended its process or time is up."""
    end = clock.now + seconds
    while clock.now < end and not all(r.exits for r in ranks):
        for rank in ranks:
            if not rank.exits:
                rank.watch.tick()
        clock.now += 1.0


def barrier_on_0(rank0: Rank, rank1: Rank) -> None:
    rank0.frames = BARRIER_STACK
    rank0.watch.heartbeat.enter_phase("forward", batch=2, batches=6)
    rank0.watch.heartbeat.entered("barrier", 2)
    rank1.watch.heartbeat.enter_phase("forward", batch=2, batches=6)
    rank1.watch.heartbeat.backward_started()


def test_a_hang_is_declared_reported_once_and_every_rank_exits(ranks: tuple[Rank, Rank, Clock], tmp_path: Path) -> None:
    rank0, rank1, clock = ranks
    barrier_on_0(rank0, rank1)
    started = clock.now
    run((rank0, rank1), clock, 60)
    assert rank0.exits == rank1.exits == [HANG_EXIT_CODE]
    # declared ~20 s in; then the reporter's bounded waits for the other rank, which (ticked after it) comes late
    assert 20 <= clock.now - started <= 20 + FINALS_WAIT_S + LEAVE_WAIT_S + 3
    reports = [r.output.getvalue() for r in (rank0, rank1)]
    assert sum(text.count("HANG: no progress for 20 s") for text in reports) == 1
    assert "HANG" in reports[0]  # rank 0 reports
    assert "exiting with status 124" in reports[1] and "see rank 0's report above" in reports[1]
    saved = json.loads((tmp_path / "hang_report.json").read_text())
    assert saved["diagnosis"]["cause"] == "collective-mismatch" and saved["diagnosis"]["culprits"] == [0]
    by_rank = {r["rank"]: r for r in saved["ranks"]}
    assert by_rank[0]["site"]["line"] == 40 and by_rank[0]["collective"]["kind"] == "barrier"
    assert by_rank[0]["stack"][-1]["function"] == "barrier" and by_rank[1]["phase"] == "backward"


def test_a_rank_that_works_however_long_keeps_the_job_alive(ranks: tuple[Rank, Rank, Clock]) -> None:
    rank0, rank1, clock = ranks
    rank0.working = True  # a slow step: 3 times the timeout, using CPU all along
    rank0.watch.heartbeat.enter_phase("forward", batch=2, batches=6)
    rank1.watch.heartbeat.backward_started()
    run((rank0, rank1), clock, 60)
    assert rank0.exits == rank1.exits == []
    rank0.working = False  # then it stops working: now it is a hang
    run((rank0, rank1), clock, 40)
    assert rank0.exits == rank1.exits == [HANG_EXIT_CODE]


def test_a_preemption_signal_shortens_the_wait_and_sets_the_exit_status(tmp_path: Path) -> None:
    store, clock = dist.HashStore(), Clock()
    signalled: list[int] = []
    rank0 = Rank(0, store, clock, tmp_path, signals=(signal.SIGUSR1,), on_signal=signalled.append)
    rank1 = Rank(1, store, clock, tmp_path)
    try:
        barrier_on_0(rank0, rank1)
        rank0.watch.tick([signal.SIGUSR1, signal.SIGINT])  # SIGINT is not a preemption signal here
        assert signalled == [signal.SIGUSR1]
        started = clock.now
        run((rank0, rank1), clock, 60)
        assert rank0.exits == rank1.exits == [128 + signal.SIGUSR1]
        # declared after the preemption grace (10 s), not hang_timeout (20 s): then the same bounded waits as above
        assert clock.now - started < 20 + FINALS_WAIT_S
        assert "after SIGUSR1" in rank0.output.getvalue()
    finally:
        rank0.watch.stop()
        rank1.watch.stop()


def test_a_rank_past_its_run_still_leaves_with_the_others(ranks: tuple[Rank, Rank, Clock], tmp_path: Path) -> None:
    """Uneven batches: rank 1 is out of batches, its run over, waiting after it; rank 0 waits in training."""
    rank0, rank1, clock = ranks
    rank0.frames = BARRIER_STACK
    rank0.watch.heartbeat.enter_phase("data_fetch", batch=2, batches=6)
    rank0.watch.heartbeat.entered("broadcast", 2)
    rank1.watch.finish("test")
    assert not rank1.watch.watching
    run((rank0, rank1), clock, 60)
    assert rank0.exits == rank1.exits == [HANG_EXIT_CODE]
    saved = json.loads((tmp_path / "hang_report.json").read_text())
    assert saved["diagnosis"]["cause"] == "uneven-batches" and saved["diagnosis"]["culprits"] == [1]


def test_a_rank_that_left_is_named_after_the_collective_fails(ranks: tuple[Rank, Rank, Clock], tmp_path: Path) -> None:
    rank0, rank1, clock = ranks
    rank1.frames = [Frame(TRAIN, 90, "main"), Frame(TRAIN, 81, "training_step")]
    rank1.watch.tick()  # its last beat: where it was
    channel: Channel = rank0.watch._main_channel  # type: ignore[assignment]
    beat = json.loads(channel.store.get("beat/1"))
    channel.publish(1, {**beat, "pid": NO_SUCH_PID})  # its process has ended since
    text = rank0.watch.report_failure(RuntimeError("Connection closed by peer"))
    assert text is not None and "A RANK LEFT THE JOB" in text
    assert f"rank 1: its process (pid {NO_SUCH_PID} on" in text and "/project/train.py:81" in text
    assert rank0.output.getvalue().count("A RANK LEFT THE JOB") == 1
    assert rank1.watch.report_failure(RuntimeError("Connection closed by peer")) is None  # rank 0 is alive: no one left
    assert rank0.exits == []


def test_a_neighbour_that_dies_mid_run_is_reported_within_a_tick(tmp_path: Path) -> None:
    """Before a parent's child watcher (Lightning kills rank 0 within 5 s of a dead child) can take the report away."""
    store, clock = dist.HashStore(), Clock()
    rank0 = Rank(0, store, clock, tmp_path, neighbours=(0, 1))
    rank1 = Rank(1, store, clock, tmp_path)
    try:
        rank1.frames = [Frame(TRAIN, 90, "main"), Frame(TRAIN, 81, "training_step")]
        rank1.watch.tick()
        rank0.watch.tick()  # learns rank 1's pid (alive: this very process)
        assert "A RANK LEFT THE JOB" not in rank0.output.getvalue()
        channel: Channel = rank0.watch._main_channel  # type: ignore[assignment]
        channel.publish(1, {**json.loads(channel.store.get("beat/1")), "pid": NO_SUCH_PID})
        rank0.watch._neighbour_pids[1] = NO_SUCH_PID  # as if it had read that pid from the start
        rank0.watch.tick()
        text = rank0.output.getvalue()
        assert text.count("A RANK LEFT THE JOB (seen by rank 0)") == 1 and "/project/train.py:81" in text
        rank0.watch.tick()
        assert rank0.output.getvalue().count("A RANK LEFT THE JOB") == 1 and rank0.exits == []  # once, no exit
        # Then its collective fails (the dead rank's connections closed): the same news, not printed again.
        assert rank0.watch.report_failure(RuntimeError("Connection closed by peer")) is not None
        assert rank0.output.getvalue().count("A RANK LEFT THE JOB") == 1
    finally:
        rank0.watch.stop()
        rank1.watch.stop()


def test_a_neighbour_that_finished_its_run_is_no_news(tmp_path: Path) -> None:
    store, clock = dist.HashStore(), Clock()
    rank0 = Rank(0, store, clock, tmp_path, neighbours=(0, 1))
    rank1 = Rank(1, store, clock, tmp_path)
    try:
        rank1.watch.finish("test")  # its last beat: past the end of its run
        channel: Channel = rank0.watch._main_channel  # type: ignore[assignment]
        channel.publish(1, {**json.loads(channel.store.get("beat/1")), "pid": NO_SUCH_PID})
        rank0.watch._neighbour_pids[1] = NO_SUCH_PID
        rank0.watch.tick()
        assert "A RANK LEFT" not in rank0.output.getvalue()
    finally:
        rank0.watch.stop()
        rank1.watch.stop()


def test_a_store_that_fails_between_publishing_and_reading_costs_a_tick_not_the_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, clock = dist.HashStore(), Clock()
    rank0 = Rank(0, store, clock, tmp_path, neighbours=(0, 1))
    rank1 = Rank(1, store, clock, tmp_path)
    try:
        rank1.watch.tick()
        rank0.watch._neighbour_pids[1] = NO_SUCH_PID  # gone: its beat is read next
        clock.now += 30.0  # idle long enough to read every rank's state too

        def failing(*args: Any) -> Any:
            raise dist.DistStoreError("the store went away for a moment")

        monkeypatch.setattr(HangWatch, "_beat_of", staticmethod(failing))
        monkeypatch.setattr(Channel, "beats", failing)
        assert rank0.watch.tick() is True
        assert rank0.exits == [] and "stopped" not in rank0.output.getvalue()
    finally:
        rank0.watch.stop()
        rank1.watch.stop()


def test_what_the_watch_says_reaches_the_descriptor_whole_even_past_pythons_stream_and_a_full_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watch's last words (which rank reported, its own exit line) go to descriptor 2 below ``sys.stderr``:
    a stream closed under it (the main thread ending) loses nothing, and a pipe left non-blocking and full (a
    reader that is slow) is waited for, not given up on at the first EAGAIN."""
    import sys
    import threading
    import time

    from lightning_mgpu.watch.watcher import HangWatch, write_whole

    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        filler = b"x" * 65536  # fill the pipe: the next write would block
        while write_whole(write, filler[:4096], patience_s=0.0):
            pass
        line = ("[lightning_mgpu] rank 0: the job hangs; exiting with status 124 at 1.0." * 100).encode()
        drained: list[bytes] = []

        def drain() -> None:  # a slow reader: starts after the writer found the pipe full
            time.sleep(0.2)
            while True:
                chunk = os.read(read, 65536)
                drained.append(chunk)
                if chunk.endswith(b"1.0."):
                    return

        reader = threading.Thread(target=drain)
        reader.start()
        assert write_whole(write, line, patience_s=5.0)
        reader.join(timeout=10)
        assert b"".join(drained).endswith(line)
    finally:
        os.close(read)
        os.close(write)

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)  # Python's stream is gone; descriptor 2 is not
    said: list[tuple[int, bytes]] = []
    monkeypatch.setattr("lightning_mgpu.watch.watcher.write_whole", lambda fd, data: said.append((fd, data)) or True)
    HangWatch()._say("[lightning_mgpu] rank 1: the job hangs; exiting with status 124 at 2.0.")
    assert said == [(2, b"[lightning_mgpu] rank 1: the job hangs; exiting with status 124 at 2.0.\n")]


def hang_in_real_time(watch: HangWatch, store: dist.Store, rank: int, world_size: int, log_dir: Path) -> None:
    """``watch`` (unthreaded) on ``rank`` of ``world_size``, ticked every 50 ms of real time until it ends its
    "process": a main thread in a barrier for good, declared hung after 1 s."""
    import time

    watch.start(
        owner="test", store=store, rank=rank, world_size=world_size, timeout=1.0, stage="fit", log_dir=str(log_dir)
    )
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and watch.tick():
            time.sleep(0.05)
    finally:
        watch.stop()


def in_threads(one: Any, ranks: int) -> None:
    """``one(rank)`` for every rank, each in a thread of its own, all at once."""
    import threading

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)


def test_no_rank_exits_before_every_rank_has_said_its_exit_line(tmp_path: Path) -> None:
    """Under Lightning's launcher the first child to exit non-zero has the parent SIGKILL every other process (its
    child-process observer): a rank that had not said its exit line yet left the output one rank short (seen in
    the 4-rank scenarios under load). Three ranks, the watches in threads of their own, one of them slow to see
    the report done: every exit line is out before the first exit."""
    import threading
    import time

    store = dist.HashStore()
    events: list[tuple[float, int, str]] = []
    lock = threading.Lock()

    class Said(io.StringIO):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

        def write(self, text: str) -> int:
            with lock:
                events.append((time.monotonic(), self.rank, "said" if "exiting with status" in text else "other"))
            return len(text)

    def one(rank: int) -> None:
        slow = 6.0 if rank == 2 else 1.0  # rank 2's waits last longer: it sees the report done after rank 1 does

        def leave(code: int) -> None:
            with lock:
                events.append((time.monotonic(), rank, "exit"))

        watch = HangWatch(
            exit=leave,
            clock=time.monotonic,
            sleep=lambda s: time.sleep(s * slow),
            sampler=lambda: Sample(BARRIER_STACK, 0.0, 0),
            output=Said(rank),
            threaded=False,
        )
        hang_in_real_time(watch, store, rank, 3, tmp_path)

    in_threads(one, 3)
    said = {rank: t for t, rank, what in events if what == "said"}
    exits = {rank: t for t, rank, what in events if what == "exit"}
    assert sorted(said) == sorted(exits) == [0, 1, 2], events
    assert max(said.values()) < min(exits.values()), sorted(events)


def test_a_rank_started_by_another_rank_exits_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's launcher starts rank 1 from rank 0, and SIGKILLs rank 0 within 5 s of rank 1's non-zero exit: rank
    0's status was then -9, not the hang's 124 (seen under load). Rank 1 (here a thread whose parent is "rank 0's
    pid") waits for its parent to be gone; rank 0 does not wait for anyone's parent."""
    import threading
    import time

    store = dist.HashStore()
    events: list[tuple[int, str]] = []
    parent_gone = threading.Event()
    real_getppid = os.getppid
    rank_of_thread: dict[int, int] = {}

    def getppid() -> int:  # rank 1's parent is this process (rank 0's published pid) until rank 0 has exited
        if rank_of_thread.get(threading.get_ident()) == 1:
            return 1 if parent_gone.is_set() else os.getpid()
        return real_getppid()

    monkeypatch.setattr(os, "getppid", getppid)

    def one(rank: int) -> None:
        rank_of_thread[threading.get_ident()] = rank

        def leave(code: int) -> None:
            events.append((rank, "exit"))
            if rank == 0:
                time.sleep(0.3)  # the parent's process takes a moment to go
                parent_gone.set()

        watch = HangWatch(
            exit=leave,
            clock=time.monotonic,
            sleep=time.sleep,
            sampler=lambda: Sample(BARRIER_STACK, 0.0, 0),
            output=io.StringIO(),
            threaded=False,
        )
        hang_in_real_time(watch, store, rank, 2, tmp_path)

    in_threads(one, 2)
    assert events == [(0, "exit"), (1, "exit")]


def test_a_rank_read_between_two_of_its_steps_is_placed_at_the_step_it_last_ran(tmp_path: Path) -> None:
    """Rank 1 validates on its own (rank 0 waits): a tick that finds its main thread in Lightning's loop between two
    validation steps still places it at its ``validation_step``, not at the ``trainer.fit`` line. A rank waiting in
    a collective, one making no progress, one whose step is long past, one in another phase or a new run is placed
    where it is."""
    store, clock = dist.HashStore(), Clock()
    rank = Rank(1, store, clock, tmp_path)
    loop = Frame(
        os.path.join(os.path.dirname(lightning.__file__), "pytorch", "loops", "evaluation_loop.py"), 140, "run"
    )
    step, between = (
        [Frame(TRAIN, 90, "main"), loop, Frame(TRAIN, 60, "validation_step")],
        [Frame(TRAIN, 90, "main"), loop],
    )
    beat = rank.watch.heartbeat
    at_step, at_fit = (60, "validation_step", True), (90, "main", False)

    def site_after(frames: list[Frame], *, seconds: float = 1.0, working: bool = True) -> tuple[int, str, bool]:
        rank.frames, rank.working = frames, working
        clock.now += seconds
        rank.watch.tick()
        published = Channel.open(store, own_client=False).beats(2)[1]
        assert published is not None
        return published["site"]["line"], published["site"]["function"], published["in_hook"]

    try:
        beat.enter_phase("validation", batch=0, batches=200)
        assert site_after(step) == at_step
        assert site_after(between) == at_step
        beat.entered("barrier", 2)
        assert site_after(between) == at_fit  # waiting in a collective
        beat.left()
        assert site_after(step) == at_step and site_after(between) == at_step
        assert site_after(between, seconds=6.0) == at_fit  # its step is long past (the timeout's quarter: 5 s)
        assert site_after(step) == at_step
        for _ in range(8):  # no progress: idle grows past 5 s
            placed = site_after(between, working=False)
        assert placed == at_fit
        assert site_after(step) == at_step
        beat.enter_phase("data_fetch", batch=1, batches=6)
        assert site_after(between) == at_fit  # another phase
        beat.enter_phase("validation", batch=0, batches=200)
        assert site_after(step) == at_step
        rank.watch.finish("test")
        assert rank.watch.start(owner="test", store=store, rank=1, world_size=2, timeout=20.0, stage="fit")
        beat.enter_phase("validation", batch=0, batches=200)
        assert site_after(between) == at_fit  # a new run: nothing carried over
    finally:
        rank.watch.stop()
