"""The watch itself: one per process, a thread that samples the main thread, publishes its state, judges, and ends a hung job.

Lifecycle (one :class:`HangWatch` per process, :func:`the_watch`): :meth:`~HangWatch.start` at the
start of a run (a strategy's ``setup``, the doctor's), :meth:`~HangWatch.finish` at its teardown.
Between the two the watch is *watching*; after, it keeps *listening* (its rank may be the one that
ran out of batches and now waits at a barrier after ``fit``: it must still hear that the others
declared a hang, and leave with them) until the default process group is destroyed or the process
exits (an ``atexit`` handler stops the thread while Python is still whole).

Every tick (``interval`` seconds, 1 s for any ``hang_timeout`` of 10 s or more) the thread

1. acts on a preemption signal that came (:mod:`.signals`): the main thread may be blocked in a
   collective where its own handler cannot run; the strategy's ``on_signal`` is told at once, and from
   then on the timeout is ``PREEMPTION_GRACE_S`` (a rank that can still reach its step boundary stops
   there, saved, as usual; one that cannot ends the job at once rather than at the scheduler's kill);
2. samples the main thread (:class:`~.sampling.Progress`: seconds without progress) and publishes
   its :class:`~.state.RankState` to the store (:mod:`.channel`);
3. if a rank declared a hang, concludes (below);
4. while watching, once its own rank has idled a while, reads every rank's state, judges
   (:func:`~.verdict.judge`) and, on a hang, declares it.

While watching, it also looks (by pid) for the ranks on its machine: one whose process ended in the
middle of the run is reported at once (which rank, where it was last), before Lightning's launcher, which
kills its rank 0 within 5 s of seeing a child die, could take the report with it; the job then ends by
the failed collective (gloo) or, where that never comes (NCCL), by the hang verdict.

Concluding, on every rank: publish the final state with the main thread's stack; the reporter (rank 0,
or the first to claim it when rank 0 does not within ``CLAIM_WAIT_S``) gathers those, diagnoses
(:mod:`.diagnosis`), prints the one report, writes ``hang_report.json`` to the log directory, hands
the report to ``on_report`` (the loggers), says its own exit line and marks the report done; the others
wait for that, say theirs and leave. No rank exits before every rank has left, and a rank started by
another rank (Lightning's launcher starts the other local ranks from local rank 0) exits after its
parent (each wait bounded by ``LEAVE_WAIT_S``): the launcher SIGKILLs every process of the job within
5 s of a child's non-zero exit, which would cut a rank off before its line or turn its parent's status
into -9. Then every rank ends its process (``os._exit``: the main thread is blocked in C++ and cannot
be unwound) with status :data:`HANG_EXIT_CODE`, or 128 + the signal's number after a preemption signal.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TextIO

import torch.distributed as dist

from lightning_mgpu._compat.python import exit_now
from lightning_mgpu.comm.distributed import PEER_LOST, process_gone, this_process
from lightning_mgpu.watch import collectives
from lightning_mgpu.watch.channel import Channel
from lightning_mgpu.watch.diagnosis import diagnose
from lightning_mgpu.watch.heartbeat import Heartbeat
from lightning_mgpu.watch.report import MARK, build, signal_name, write
from lightning_mgpu.watch.sampling import (
    Frame,
    Progress,
    ThreadMeters,
    c10d_call,
    caller_frame,
    is_library,
    main_stack,
    signature,
    user_frame,
)
from lightning_mgpu.watch.signals import SignalListener
from lightning_mgpu.watch.state import RankState
from lightning_mgpu.watch.verdict import Verdict, judge

__all__ = ["HANG_EXIT_CODE", "HangWatch", "Run", "Sample", "the_watch"]

HANG_EXIT_CODE = 124
"""Every rank's exit status after a hang (as ``timeout(1)``'s when its command timed out)."""
PREEMPTION_GRACE_S = 10.0
CLAIM_WAIT_S = 5.0
FINALS_WAIT_S = 5.0
DONE_WAIT_S = 20.0
LOGGERS_WAIT_S = 10.0
LEAVE_WAIT_S = 3.0

_STORE_ERRORS = (RuntimeError, ValueError, OSError, dist.DistError)


@dataclass
class Sample:
    """One look at the main thread."""

    frames: list[Frame]
    cpu_s: float
    io: int


@dataclass
class Run:
    """What the watch needs to know about the run it watches (given at :meth:`HangWatch.start`)."""

    rank: int
    world_size: int
    timeout: float
    log_dir: Optional[str] = None
    signals: tuple[int, ...] = ()
    """Preemption signals (the strategy's): acted on the moment they arrive."""
    on_signal: Optional[Callable[[int], None]] = None
    on_report: Optional[Callable[[dict[str, Any]], None]] = None
    """Called on the reporting rank with the report (e.g. to write it to the loggers); must not raise."""
    owners: set[str] = field(default_factory=set)
    neighbours: tuple[int, ...] = ()
    """Ranks that may run on this machine (their processes are looked for; a wrong guess is harmless)."""


def _interval(timeout: float) -> float:
    return min(1.0, max(0.05, timeout / 10))


class HangWatch:
    """One process's hang watch (see the module docstring). ``exit``, ``clock``, ``sleep``, ``sampler``,
    ``output``: stand-ins for tests; ``threaded=False``: no thread, the test calls :meth:`tick`."""

    def __init__(
        self,
        *,
        exit: Callable[[int], Any] = exit_now,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        sampler: Optional[Callable[[], Sample]] = None,
        output: Optional[TextIO] = None,
        threaded: bool = True,
    ) -> None:
        self.heartbeat = Heartbeat()
        self._threaded = threaded
        self._exit, self._clock, self._sleep = exit, clock, sleep
        self._sampler = sampler
        self._output = output
        self._meters: Optional[ThreadMeters] = None
        self._run: Optional[Run] = None
        self._watching = False
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._signals = SignalListener()
        self._channel: Optional[Channel] = None
        self._main_channel: Optional[Channel] = None
        self._progress = Progress()
        self._beat = 0
        self._hook_site: Optional[tuple[tuple[Any, ...], Frame, float]] = None
        self._seen: dict[int, tuple[int, float]] = {}
        self._next_read = 0.0
        self._signal: Optional[int] = None
        self._store_failures = 0
        self._concluding = False
        self._neighbour_pids: dict[int, int] = {}
        self._left_reported = False
        self._left_printed = False
        self._left_lock = (
            threading.Lock()
        )  # the watch thread (a neighbour gone) and the main thread (a failed collective)
        self._here = this_process().rsplit(" ", 1)[0]
        self.concluded: Optional[int] = None
        """The exit status this watch ended its process with (for tests whose ``exit`` returns)."""

    # ------------------------------------------------------------------ lifecycle (main thread)

    @property
    def watching(self) -> bool:
        return self._watching

    @property
    def beats(self) -> int:
        """States this watch has published (its thread's ticks, and the main thread's rare ones)."""
        return self._beat

    @property
    def ticking(self) -> bool:
        """Whether the watch thread runs (it goes on after a run while the process group lives: see :meth:`finish`)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def timeout(self) -> Optional[float]:
        return self._run.timeout if self._run is not None and self._watching else None

    def start(
        self,
        *,
        owner: str,
        store: Optional[dist.Store],
        rank: int,
        world_size: int,
        timeout: float,
        stage: Optional[str],
        log_dir: Optional[str] = None,
        signals: tuple[int, ...] = (),
        on_signal: Optional[Callable[[int], None]] = None,
        on_report: Optional[Callable[[dict[str, Any]], None]] = None,
        neighbours: Sequence[int] = (),
    ) -> bool:
        """Watch the run that starts now on this rank; False (nothing started) without a store or a second rank.

        A second owner in the same run (the doctor beside our strategy) joins the first: the smaller
        timeout holds, the first owner's signals and report hook stay."""
        if world_size < 2 or store is None:
            return False
        with self._lock:
            run = self._run
            if self._watching and run is not None:
                run.owners.add(owner)
                run.timeout = min(run.timeout, timeout)
                run.signals = run.signals or signals
                run.on_signal = run.on_signal or on_signal
                run.on_report = run.on_report or on_report
                run.log_dir = run.log_dir or log_dir
                if signals:
                    self._signals.start()
                return True
            try:
                channel = Channel.open(store, own_client=True)
                main_channel = Channel.open(store, own_client=False)
            except _STORE_ERRORS:
                return False
            self._run = Run(
                rank, world_size, timeout, log_dir, signals, on_signal, on_report, {owner}, tuple(neighbours)
            )
            self._channel, self._main_channel = channel, main_channel
            self.heartbeat.reset(stage=stage)
            self._progress = Progress(now=self._clock())
            self._seen, self._signal, self._store_failures, self._hook_site = {}, None, 0, None
            self._neighbour_pids, self._left_reported, self._left_printed = {}, False, False
            self._watching = True
        collectives.install(self.heartbeat)
        if signals:
            self._signals.start()
        if self._meters is None and self._sampler is None:
            self._meters = ThreadMeters()
        self._ensure_thread()
        return True

    def finish(self, owner: str) -> None:
        """The run of ``owner`` ends on this rank: stop watching it (when its last owner leaves) and keep listening."""
        with self._lock:
            run = self._run
            if run is None or not self._watching:
                return
            run.owners.discard(owner)
            if run.owners:
                return
            self._watching = False
            self.heartbeat.enter_phase("after_run")
        collectives.uninstall()
        self._signals.stop()
        self._publish_now()

    def stop(self) -> None:
        """End the thread (at exit, or when a test is done with the watch)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        self._thread = None
        with self._lock:
            self._watching = False
            self._run = None
        collectives.uninstall()
        self._signals.stop()

    def _ensure_thread(self) -> None:
        if not self._threaded or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="lightning_mgpu hang watch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ failures (main thread)

    def note_failure(self, error: BaseException) -> None:
        """This rank's run is failing with ``error``: say so to the others now (the process may be gone by the next tick)."""
        if self._concluding:  # the hang's report is out or on its way; this is the others leaving
            return
        first = (str(error).strip().splitlines() or [""])[0][:200]
        self.heartbeat.failure = f"{type(error).__name__}: {first}" if first else type(error).__name__
        self.heartbeat.enter_phase("failed")
        self._publish_now()

    def report_failure(self, error: BaseException) -> Optional[str]:
        """After a collective failed because a peer left: the report naming the ranks that left and where they were,
        printed by the first rank to get here (the text is returned on every rank; None when no rank is seen gone)."""
        run, channel = self._run, self._main_channel
        if run is None or channel is None or not self._watching or self._concluding:
            return None  # concluding: the collective failed because the others are leaving after the hang's report
        try:
            return self._report_left(run, channel, self._state(self._sample(), idle=0.0, run=run))
        except Exception as error:  # noqa: BLE001  (called while the run fails: its own error must stay the one raised)
            self._say(f"{MARK} the report of the ranks that left failed: {type(error).__name__}: {error}")
            return None

    def _report_left(self, run: Run, channel: Channel, mine: RankState) -> Optional[str]:
        """The ranks that left the run (process gone, or failed on their own), where each was: reported once per job."""
        try:
            if channel.declared() is not None:  # a hang was declared: the ranks leave because of it
                return None
            beats = channel.beats(run.world_size)
        except _STORE_ERRORS:
            return None
        states = self._states_from(beats, run, now=None)
        states[run.rank] = mine
        lost = [
            s.rank
            for s in states.values()
            if s.rank != run.rank and (s.gone or (s.failure and not any(m in s.failure for m in PEER_LOST)))
        ]
        if not lost:
            return None
        report = self._build_report(
            run, states, Verdict(False, [], lost, [], run.timeout), exit_code=None, failure=True
        )
        with self._left_lock:  # once per job, and once per rank: its watch thread may have seen the death first
            try:
                first = not self._left_printed and channel.claim("failure/reporter", run.rank) == run.rank
            except _STORE_ERRORS:
                first = not self._left_printed
            if first:
                self._left_printed = True
                self._deliver(run, report)
        text: str = report["text"]
        return text

    def _neighbour_left(self, run: Run, channel: Channel) -> bool:
        """Whether a rank on this machine ended its process in the middle of the run (looked up by pid: cheap, every
        tick). Under Lightning's launcher rank 0 is its ranks' parent, and Lightning kills it within 5 s of seeing a
        child die: this sees the death within a tick, so the report comes first."""
        for rank in run.neighbours:
            pid = self._neighbour_pids.get(rank)
            if rank == run.rank or pid == 0:
                continue
            if pid is None:
                state = self._beat_of(channel, rank)
                if state is not None:  # 0: on another machine (or pid namespace), not ours to look for
                    self._neighbour_pids[rank] = state.pid if state.host == self._here else 0
                continue
            if process_gone(pid):
                last = self._beat_of(channel, rank)
                if last is not None and last.watching and last.phase not in ("after_run", "teardown"):
                    return True
                self._neighbour_pids[rank] = 0  # it finished its run: gone is no news
        return False

    @staticmethod
    def _beat_of(channel: Channel, rank: int) -> Optional[RankState]:
        key = f"beat/{rank}"
        if not channel.store.check([key]):
            return None
        return RankState.from_dict(json.loads(channel.store.get(key)))

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            run = self._run
            interval = _interval(run.timeout if run is not None else 10.0)
            if self._signals.listening:
                signums = self._signals.wait(interval)
            else:
                self._stop.wait(interval)
                signums = []
            if self._stop.is_set():
                return
            try:
                if not self.tick(signums):
                    return
            except Exception as error:  # the watch must never take the run down with it
                self._say(f"{MARK} the hang watch stopped: {type(error).__name__}: {error}")
                return

    def tick(self, signums: Optional[list[int]] = None) -> bool:
        """One round of the thread's work (see the module docstring); False when the thread should end."""
        run = self._run
        channel = self._channel
        if run is None or channel is None:
            return False
        now = self._clock()
        for signum in signums or []:
            if signum in run.signals:
                self._signal = signum
                if run.on_signal is not None:
                    try:
                        run.on_signal(signum)
                    except Exception:  # noqa: BLE001  (the handler's own business)
                        pass
        sample = self._sample()
        beat = self.heartbeat
        in_collective = beat.collective is not None or c10d_call(sample.frames) is not None
        idle = self._progress.sample(
            counter=beat.progress,
            stack=signature(sample.frames),
            cpu_s=sample.cpu_s,
            io=sample.io,
            in_collective=in_collective,
            now=now,
        )
        state = self._state(sample, idle, run, now=now)
        try:
            channel.publish(run.rank, state.as_dict())
            declaration = channel.declared()
            self._store_failures = 0
        except _STORE_ERRORS:
            self._store_failures += 1
            if not self._watching:
                return self._store_failures < 3  # the run is over and the store gone: nothing left to hear
            if idle >= run.timeout and self._store_failures * _interval(run.timeout) >= self._silent_limit(run):
                self._conclude_alone(run, state)
                return False
            return True
        if declaration is not None:
            self._conclude(run, channel, declaration, state)
            return False
        if not self._watching:
            return dist.is_available() and dist.is_initialized()
        try:  # a store that fails now and then costs this tick's reading, never the watch
            left = not self._left_reported and self._neighbour_left(run, channel)
        except _STORE_ERRORS:
            left = False
        if left:
            self._left_reported = True
            self._report_left(run, channel, state)
        timeout = min(run.timeout, PREEMPTION_GRACE_S) if self._signal is not None else run.timeout
        if idle >= min(timeout / 2, 5.0) and now >= self._next_read:
            self._next_read = now + max(_interval(timeout), min(timeout / 10, 5.0))
            try:
                beats = channel.beats(run.world_size)
            except _STORE_ERRORS:
                return True
            states = self._states_from(beats, run, now=now)
            states[run.rank] = state
            verdict = judge(list(states.values()), timeout=timeout, silent_limit=self._silent_limit(run))
            if verdict.hang:
                self._say(f"{MARK} rank {run.rank}: declaring a hang at {time.time():.3f}")
                declaration = channel.declare(
                    {"by": run.rank, "signal": self._signal, "verdict": verdict.as_dict(), "timeout_s": timeout}
                )
                self._conclude(run, channel, declaration, state)
                return False
        return True

    # ------------------------------------------------------------------ reading states

    def _silent_limit(self, run: Run) -> float:
        return max(10.0, 5 * _interval(run.timeout))

    def _sample(self) -> Sample:
        if self._sampler is not None:
            return self._sampler()
        meters = self._meters or ThreadMeters()
        return Sample(main_stack(), meters.cpu_s(), meters.io_bytes())

    def _state(self, sample: Sample, idle: float, run: Run, now: Optional[float] = None) -> RankState:
        """This rank's state now, with the main thread's stack (published without it); ``now``: a tick's
        reading, whose rank may be placed at the step it just ran (see below)."""
        self._beat += 1
        frames = sample.frames
        site = user_frame(frames)
        in_hook = False
        if site is not None:
            outer = frames[: frames.index(site)]
            in_hook = any("lightning" in f.file and is_library(f.file) for f in outer)
        snapshot = self.heartbeat.snapshot()
        c10d = c10d_call(frames)
        # A tick that reads a rank still making progress between two of the user's steps (in Lightning's loop,
        # waiting in nothing) places it at the step it ran moments ago in this phase, not at the line that
        # started the run. Anything else (stuck, waiting, another phase, a step long past) is placed where it is.
        phase = (snapshot["stage"], snapshot["phase"], snapshot["epoch"])
        recent = min(5.0, run.timeout / 4)
        if in_hook and site is not None and now is not None:
            self._hook_site = (phase, site, now)
        elif (
            now is not None
            and self._hook_site is not None
            and self._hook_site[0] == phase
            and now - self._hook_site[2] < recent
            and idle < recent
            and snapshot["collective"] is None
            and c10d is None
            and snapshot["phase"] != "backward"  # waiting in DDP's gradient all-reduce
        ):
            site, in_hook = self._hook_site[1], True
        return RankState(
            rank=run.rank,
            host=self._here,
            pid=os.getpid(),
            watching=self._watching,
            c10d=c10d,
            idle_s=round(idle, 1),
            site=site,
            in_hook=in_hook,
            caller=caller_frame(frames),
            signal=self._signal,
            beat=self._beat,
            log_dir=run.log_dir,
            stack=frames,
            **snapshot,  # stage, phase, epoch, ..., the collective it is in, failure
        )

    def _states_from(
        self, beats: list[Optional[dict[str, Any]]], run: Run, *, now: Optional[float]
    ) -> dict[int, RankState]:
        """Every rank's published state, with what this reader adds: silent seconds (``now`` given) and gone processes."""
        states: dict[int, RankState] = {}
        for rank, data in enumerate(beats):
            if data is None:
                states[rank] = RankState(rank=rank, missing=True)
                continue
            state = RankState.from_dict(data)
            if now is not None:
                seen = self._seen.get(rank)
                if seen is None or seen[0] != state.beat:
                    self._seen[rank] = (state.beat, now)
                else:
                    state.silent_s = round(now - seen[1], 1)
            if rank != run.rank and state.host == self._here and state.pid and process_gone(state.pid):
                state.gone = True
            states[rank] = state
        return states

    def _publish_now(self) -> None:
        run, channel = self._run, self._main_channel
        if run is None or channel is None:
            return
        try:
            state = self._state(self._sample(), idle=0.0, run=run)
            channel.publish(run.rank, state.as_dict())
        except _STORE_ERRORS:
            pass

    # ------------------------------------------------------------------ ending the job

    def _conclude(self, run: Run, channel: Channel, declaration: dict[str, Any], state: RankState) -> None:
        """A hang was declared: every rank's part (see the module docstring), then the process ends.

        No rank exits before every rank has said its exit line (or a few seconds have passed): under Lightning's
        launcher the first child to exit non-zero has the parent SIGKILL every other process of the job (its
        child-process observer), and a rank killed before its line leaves the job's output one rank short."""
        self._concluding = True
        signum = declaration.get("signal")
        code = 128 + int(signum) if signum else HANG_EXIT_CODE
        reporter: Optional[int] = None
        said = False
        parent: Optional[int] = None
        try:
            channel.put_final(run.rank, state.as_dict(with_stack=True))
            parent = self._parent_rank(run, channel, state)
            reporter = channel.claim("reporter", 0) if run.rank == 0 else None
            deadline = self._clock() + CLAIM_WAIT_S
            while reporter is None:
                reporter = channel.claimed("reporter")
                if reporter is None and self._clock() >= deadline:
                    reporter = channel.claim("reporter", run.rank)
                elif reporter is None:
                    self._sleep(0.1)
            if reporter == run.rank:
                others = self._report(run, channel, declaration, state, code)
                self._say(self._last_words(run, reporter, signum, code))
                said = True
                channel.mark_done()
                # This process may serve the store: the others read "done" through it, say their lines, then leave.
                self._wait_for(lambda: channel.left() >= others, LEAVE_WAIT_S, 0.05)
            else:
                self._wait_for(channel.done, DONE_WAIT_S, 0.1)
                self._say(self._last_words(run, reporter, signum, code))
                said = True
                channel.leave()
                leavers = len(_live_ranks(run, declaration)) - 1  # every rank but the reporter leaves
                self._wait_for(lambda: channel.left() >= leavers, LEAVE_WAIT_S, 0.05)
        except _STORE_ERRORS as error:
            self._say(f"{MARK} rank {run.rank}: the store failed while the hang was reported ({error})")
        if not said:
            self._say(self._last_words(run, reporter, signum, code))
        if parent is not None:
            # The rank that started this process (Lightning's launcher: local rank 0) goes first: its child-process
            # observer SIGKILLs it, and every other rank, within 5 s of a child's non-zero exit, whose status would
            # then be -9, not this one.
            self._wait_for(lambda: os.getppid() != parent, LEAVE_WAIT_S, 0.05)
        self._end(code)

    def _wait_for(self, ready: Callable[[], bool], seconds: float, step: float) -> None:
        """Sleep ``step`` at a time until ``ready()`` or ``seconds`` have passed."""
        deadline = self._clock() + seconds
        while not ready() and self._clock() < deadline:
            self._sleep(step)

    def _parent_rank(self, run: Run, channel: Channel, state: RankState) -> Optional[int]:
        """The pid of the rank of this job that started this process (Lightning's launcher starts the other local
        ranks from local rank 0), or None (torchrun's agent, srun, a user's shell)."""
        parent = os.getppid()
        for rank, beat in enumerate(channel.beats(run.world_size)):
            if rank != run.rank and beat and beat.get("pid") == parent and beat.get("host") == state.host:
                return parent
        return None

    def _last_words(self, run: Run, reporter: Optional[int], signum: Any, code: int) -> str:
        by = f"rank {reporter}'s report" if reporter is not None and reporter != run.rank else "the report"
        why = f"after {signal_name(int(signum))}, " if signum else ""
        return f"{MARK} rank {run.rank}: the job hangs ({why}see {by} above); exiting with status {code} at {time.time():.3f}."

    def _report(self, run: Run, channel: Channel, declaration: dict[str, Any], state: RankState, code: int) -> int:
        """Gather, diagnose, print, write, hand over; the number of other ranks expected to leave."""
        decided = declaration.get("verdict") or {}
        verdict = Verdict(
            True,
            list(decided.get("blocked", [])),
            list(decided.get("dead", [])),
            list(decided.get("unresponsive", [])),
            float(decided.get("timeout_s", run.timeout)),
        )
        expected = _live_ranks(run, declaration)
        deadline = self._clock() + FINALS_WAIT_S
        finals = channel.finals(expected)
        while len(finals) < len(expected) and self._clock() < deadline:
            self._sleep(0.1)
            finals = channel.finals(expected)
        states = self._states_from(channel.beats(run.world_size), run, now=None)
        for rank, data in finals.items():
            states[rank] = RankState.from_dict(data)
        states[run.rank] = state
        for rank in verdict.dead:
            states[rank].gone = True
        for rank in verdict.unresponsive:
            states[rank].silent_s = max(states[rank].silent_s, self._silent_limit(run))
        signum = declaration.get("signal")
        report = self._build_report(run, states, verdict, exit_code=code, signum=int(signum) if signum else None)
        self._deliver(run, report)
        return len([rank for rank in expected if rank != run.rank])

    @staticmethod
    def _build_report(run: Run, states: dict[int, RankState], verdict: Verdict, **how: Any) -> dict[str, Any]:
        """The report of ``verdict`` over every rank's state, as this rank writes it (``how``: :func:`build`'s
        exit_code, signum, failure)."""
        ranks = list(states.values())
        return build(
            ranks,
            verdict,
            diagnose(ranks, verdict),
            reporter=run.rank,
            hang_timeout=run.timeout,
            log_dir=run.log_dir,
            **how,
        )

    def _conclude_alone(self, run: Run, state: RankState) -> None:
        """No store to meet the others through: say what this rank knows, and end it."""
        where = state.waiting_in or state.doing
        frame = state.site or state.caller
        at = f" at {frame.where()} in {frame.function}" if frame is not None else ""
        self._say(
            f"{MARK} HANG: rank {run.rank} has made no progress for {state.idle_s:.0f} s (hang_timeout="
            f"{run.timeout:g} s): {where}{at}; and the rendezvous store no longer answers: the process that served it "
            f"(rank 0 under Lightning's launcher, torchrun's agent) has probably died. Exiting with status "
            f"{HANG_EXIT_CODE}."
        )
        self._end(HANG_EXIT_CODE)

    def _deliver(self, run: Run, report: dict[str, Any]) -> None:
        """``report`` out: its text said, its JSON written to the log directory, then ``on_report(report)`` (the
        loggers), in a thread of its own: a logger that blocks cannot keep the job alive."""
        self._say(report["text"])
        write(report, run.log_dir)
        hook = run.on_report
        if hook is None:
            return

        def hand_over() -> None:
            try:
                hook(report)
            except Exception as error:  # noqa: BLE001  (a logger's failure must not stop the report)
                self._say(f"{MARK} the hang report could not go to the loggers: {type(error).__name__}: {error}")

        thread = threading.Thread(target=hand_over, name="lightning_mgpu hang report", daemon=True)
        thread.start()
        thread.join(timeout=LOGGERS_WAIT_S)

    def _say(self, text: str) -> None:
        """One message, whole, on this process's standard error (or the stream the watch was given).

        Below Python's ``sys.stderr``: its buffer is flushed first (order kept), then the bytes go to file
        descriptor 2 with ``os.write``, every byte, retried while the descriptor would block. What the exit
        status alone cannot tell (which rank reported, where each was) must not depend on a Python stream the
        main thread may be closing, replacing or writing a traceback to while this thread says it, nor on a
        descriptor another process of the job left non-blocking."""
        if self._output is not None:
            try:
                self._output.write(text + "\n")
                self._output.flush()
            except (OSError, ValueError):
                pass
            return
        try:
            sys.stderr.flush()
        except Exception:  # noqa: BLE001  (closed, replaced by None, locked up: the bytes below still go)
            pass
        write_whole(2, (text + "\n").encode(errors="replace"))

    def _end(self, code: int) -> None:
        self.concluded = code
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self._exit(code)


def _live_ranks(run: Run, declaration: dict[str, Any]) -> list[int]:
    """The ranks the declaration does not name dead or unresponsive: those that take part in ending the job."""
    decided = declaration.get("verdict") or {}
    gone = set(decided.get("dead", [])) | set(decided.get("unresponsive", []))
    return [rank for rank in range(run.world_size) if rank not in gone]


def write_whole(fd: int, data: bytes, *, patience_s: float = 2.0) -> bool:
    """Every byte of ``data`` to ``fd`` (partial writes continued; a descriptor that would block is waited for up
    to ``patience_s`` in all); False if it could not be done (the descriptor closed, or blocked throughout)."""
    view = memoryview(data)
    deadline = time.monotonic() + patience_s
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            select.select([], [fd], [], 0.05)
            continue
        except OSError:
            return False
        view = view[written:]
    return True


_WATCH: Optional[HangWatch] = None


def the_watch() -> HangWatch:
    """This process's watch (made on first use; stopped at exit)."""
    global _WATCH
    if _WATCH is None:
        _WATCH = HangWatch()
        atexit.register(_WATCH.stop)
    return _WATCH
