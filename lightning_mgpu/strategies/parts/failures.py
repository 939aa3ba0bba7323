"""What a failed fit leaves behind: an error that names the lost ranks, and no rank left running.

The ranks of a job learn that one of them failed only through their next collective:

* a rank whose process ended (an exception, ``SIGKILL``, the OOM killer) closes its
  connections, and the others fail at once (gloo: ``Connection closed by peer``);
* a rank that hangs without ending (stuck in Python or I/O, or in a collective the others
  never enter) is noticed only when the collective ``timeout`` runs out
  (``TunedDDPStrategy(timeout=...)``, torch's 30 minutes by default).

With Lightning's own launcher (``python train.py``) rank 0 runs in the launching process and
starts the other ranks of the machine as its children. Two gaps of that launcher are closed
here, from the strategy's ``on_exception``:

1. the error of a surviving rank says nothing about which rank was lost. The launching
   process knows its children's exit status: its error now names them ("rank 1 (pid 4242)
   killed by SIGKILL"), and every rank's error says what a closed connection or a timeout
   means;
2. when rank 0 fails first, its children are orphaned, and one that is not inside a
   collective (stuck, or busy) runs on. When the launching process exits after a failed fit,
   it waits up to :data:`CHILD_GRACE_S` seconds for its children (they see the closed
   connections and stop with their own error), then kills the ones still running, naming them.
3. Lightning's child-process observer (it polls every 5 s) SIGKILLs the ranks it started and its own
   process once a child rank ended non-zero. The launching process may then be busy in its step, not
   yet in the collective that would fail and name the lost rank: the observer now names the ended
   ranks first (:func:`child_ends_namer`, installed by our launcher), unless this process's own fit
   failed first.

One error of DDP's own is translated into its fixes as well: "Expected to mark a variable ready
only once", which reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=True)``) raises under ``find_unused_parameters=True`` and which points users at a
private torch method. The strategy's ``backward`` raises :class:`ReentrantCheckpointError` from it
(:func:`reentrant_backward_explained`), naming the two fixes that work.
"""

from __future__ import annotations

import atexit
import gc
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from lightning_mgpu.comm.distributed import lost_peer
from lightning_mgpu.watch.report import signal_name
from lightning_mgpu.watch.watcher import HANG_EXIT_CODE

CHILD_GRACE_S = 5.0
"""Seconds the launching process waits for its children after a failed fit before killing them."""

_TIMED_OUT = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout")
_NOTE_MARK = "[lightning_mgpu]"
READY_TWICE = "Expected to mark a variable ready only once"
"""The start of DDP's error for a parameter whose gradient was reported ready twice in one backward."""
_registered: list[list[tuple[int, subprocess.Popen[Any]]]] = []
_fit_failed = threading.Event()
"""Set when this process's fit raised an error of its own: the child ranks that end after that end because of it."""
_named: set[int] = set()
"""Pids of child ranks a note of this process has named as ended (the observer's line does not repeat them)."""


def launched_children(launcher: Any, global_rank: int) -> list[tuple[int, subprocess.Popen[Any]]]:
    """(global rank, process) of the ranks this process started (Lightning's subprocess launcher)."""
    procs = getattr(launcher, "procs", None)
    if not isinstance(procs, list):
        return []
    # The launcher starts local ranks 1..n-1 of this node; this process is local rank 0.
    return [(global_rank + index + 1, proc) for index, proc in enumerate(procs) if isinstance(proc, subprocess.Popen)]


def _ended_states(ended: Sequence[tuple[int, subprocess.Popen[Any], Optional[int]]]) -> str:
    """``rank 1 (pid 4242) killed by SIGKILL, ...`` for (rank, process, exit status) entries."""
    return ", ".join(f"rank {r} (pid {p.pid}) {describe_exit(code)}" for r, p, code in ended)


def describe_exit(returncode: Optional[int]) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    return f"exited with code {returncode}"


def explain_collective_failure(
    exception: BaseException,
    *,
    rank: int,
    timeout: Optional[timedelta],
    children: list[tuple[int, subprocess.Popen[Any]]],
) -> Optional[str]:
    """Append to ``exception``'s message what a lost peer or a timeout means, and which of this
    process's children ended how. Returns the note (None when the error is neither)."""
    text = str(exception)
    if _NOTE_MARK in text:
        return None
    lost = lost_peer(exception)
    timed_out = not lost and any(marker in text for marker in _TIMED_OUT)
    if not (lost or timed_out):
        return None
    shown = "torch's default, 30 minutes" if timeout is None else str(timeout)
    if lost:
        deadline = time.monotonic() + 1.0  # a child that just closed its sockets is about to be gone
        while children and any(p.poll() is None for _, p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        note = lost_peer_note(rank, children)
    else:
        note = (
            f"{_NOTE_MARK} rank {rank}: a collective did not complete within the timeout ({shown}): a rank is stuck "
            "(in Python, I/O, or a collective the others never entered) or far slower than the others, without "
            "having exited. TunedDDPStrategy(timeout=timedelta(...)) sets how long such a hang may last."
        )
        if children:
            states = _ended_states([(r, p, p.poll()) for r, p in children])
            note += f" Ranks started by this process: {states}."
    _append(exception, note)
    return note


def lost_peer_note(rank: int, children: list[tuple[int, subprocess.Popen[Any]]]) -> str:
    """The note for a collective that failed because a peer's connection closed.

    What is known is said, and nothing more: a connection closes when its rank's process ends, and
    also a moment before (it destroys its process group on the way out, or is still printing its
    error), so a rank that closed its connection may still be running. Which rank it was is known
    only when this process started it (and saw it end)."""
    polled = [(r, p, p.poll()) for r, p in children]  # once: a child may end while this runs
    ended = [(r, p, code) for r, p, code in polled if code is not None]
    running = [(r, p) for r, p, code in polled if code is None]
    _named.update(p.pid for _, p, _ in ended)
    note = f"{_NOTE_MARK} rank {rank}: another rank closed its connection while this rank waited for it in a collective"
    if ended:
        states = _ended_states(ended)
        cause = "Its own error, printed by it, is" if len(ended) == 1 else "Their own errors, printed by them, are"
        note += f": {states}. {cause} the cause."
    else:
        note += (
            " (its process failed, was killed, or is exiting after an error); that rank's own error, printed by it, "
            "is the cause."
        )
    if running:
        states = ", ".join(f"rank {r} (pid {p.pid})" for r, p in running)
        known = "Still running" if ended else "Ranks started by this process, none ended yet"
        note += (
            f" {known}: {states}; when this process exits it waits up to {CHILD_GRACE_S:g} s for them, then kills "
            "the ones still running."
        )
    return note


def fit_failed_here() -> None:
    """This process's fit raised an error of its own: that error says what happened, and the child ranks that end
    after it end because of it."""
    _fit_failed.set()


def child_ends_namer(rank: int, children: list[tuple[int, subprocess.Popen[Any]]]) -> Callable[[], None]:
    """For one launch: what Lightning's observer calls just before it kills every process it started and itself (a
    child rank ended non-zero). It names the ended child ranks with their exit status, unless this process's fit
    failed first, a child ended by the hang watch (its report has said which rank waited where), or a failure note
    of this process has named them already."""
    _fit_failed.clear()
    _named.clear()

    def say() -> None:
        ended = [(r, p, code) for r, p in children if (code := p.poll()) not in (None, 0) and p.pid not in _named]
        if not ended or _fit_failed.is_set() or any(code == HANG_EXIT_CODE for _, _, code in ended):
            return
        states = _ended_states(ended)
        exited = sum(code > 0 for _, _, code in ended)
        if exited == 0:
            cause = "A process killed by a signal prints no error of its own"
            cause += " (the OOM killer says so in dmesg)." if any(c == -signal.SIGKILL for _, _, c in ended) else "."
        elif exited == 1:
            cause = "The error printed by the rank that exited is the cause."
        else:
            cause = "The errors printed by the ranks that exited are the cause."
        print(
            f"{_NOTE_MARK} rank {rank}: {states}. {cause} Lightning's launcher now kills the ranks it started on this "
            "node and this process (SIGKILL).",
            file=sys.stderr,
            flush=True,
        )

    return say


class ReentrantCheckpointError(RuntimeError):
    """DDP's "Expected to mark a variable ready only once", with its fixes; torch's error is its ``__cause__``."""


def reentrant_checkpoint_advice(
    *, strategy: str, find_unused_parameters: bool, static_graph: bool, static_graph_supported: bool
) -> str:
    """What DDP's "mark a variable ready only once" means here and the fixes that work, in words.

    ``strategy`` is the class name to write in the fix (``TunedDDPStrategy``); ``static_graph`` whether
    it is already on, ``static_graph_supported`` whether the strategy accepts it at all (not ``hybrid``)."""
    if find_unused_parameters:
        cause = (
            "activation checkpointing with torch.utils.checkpoint.checkpoint(..., use_reentrant=True) under "
            "find_unused_parameters=True: DDP does not see the checkpointed layers in the forward's graph, marks "
            "their parameters unused, then gets their gradients from the checkpoint's own backward"
        )
    else:
        cause = (
            "activation checkpointing with torch.utils.checkpoint.checkpoint(..., use_reentrant=True) around "
            "parameters used more than once in a step (one layer in two checkpointed segments)"
        )
    non_reentrant = (
        "non-reentrant checkpointing, checkpoint(..., use_reentrant=False) (a Hugging Face model: "
        'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}))'
    )
    if static_graph_supported and not static_graph:
        fixes = (
            f"Either fix works: (1) {strategy}(static_graph=True, ...), if the model runs the same layers at every "
            f"step; (2) {non_reentrant}."
        )
    elif static_graph:
        fixes = f"static_graph=True is on already; the fix: {non_reentrant}."
    else:
        fixes = f"{strategy} does not accept static_graph=True; the fix: {non_reentrant}."
    return (
        f"{_NOTE_MARK} DDP saw a parameter's gradient become ready twice in one backward (torch: {READY_TWICE!r}). "
        f"The usual cause: {cause}. {fixes} Other causes torch names: a parameter used outside forward, or by "
        "two forward/backward passes at once."
    )


@contextmanager
def reentrant_backward_explained(
    *, strategy: str, find_unused_parameters: bool, static_graph: bool, static_graph_supported: bool
) -> Iterator[None]:
    """Around a strategy's backward: DDP's "mark a variable ready only once" becomes a
    :class:`ReentrantCheckpointError` naming the fixes, raised from torch's error."""
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, ReentrantCheckpointError) or READY_TWICE not in str(error):
            raise
        advice = reentrant_checkpoint_advice(
            strategy=strategy,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            static_graph_supported=static_graph_supported,
        )
        raise ReentrantCheckpointError(advice) from error


def explain_reentrant_failure(exception: BaseException, **strategy_facts: Any) -> Optional[str]:
    """For ``on_exception``: DDP's raw "mark a variable ready only once" reached the strategy without
    passing its ``backward`` (``loss.backward()`` called directly): the fixes are appended to its message.
    Returns the note (None for any other error, or one already explained)."""
    text = str(exception)
    if isinstance(exception, ReentrantCheckpointError) or READY_TWICE not in text or _NOTE_MARK in text:
        return None
    note = reentrant_checkpoint_advice(**strategy_facts)
    _append(exception, note)
    return note


def reap_children_at_exit(children: list[tuple[int, subprocess.Popen[Any]]], grace_s: float = CHILD_GRACE_S) -> None:
    """At interpreter exit: drop the process group, wait ``grace_s`` for ``children``, kill the rest."""
    if not children or any(entry is children for entry in _registered):
        return
    _registered.append(children)
    atexit.register(_reap, children, grace_s)


def _reap(children: list[tuple[int, subprocess.Popen[Any]]], grace_s: float) -> None:
    # Children blocked in a collective with this rank fail (and exit, with their own error) once
    # its connections close: drop the process group and what still holds it. The traceback of the
    # exception (printed by now) holds the frames, and through them the DDP wrapper and its group.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group: the kill below still applies
            pass
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if getattr(sys, name, None) is not None:
            setattr(sys, name, None)
    gc.collect()
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for _, p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rank, proc in children:
        if proc.poll() is None:
            print(
                f"{_NOTE_MARK} rank {rank} (pid {proc.pid}) still running {grace_s:g} s after the fit failed in its "
                "launching process: killing it.",
                file=sys.stderr,
                flush=True,
            )
            proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _append(exception: BaseException, note: str) -> None:
    args = exception.args
    if args and isinstance(args[0], str):
        try:
            exception.args = (f"{args[0]}\n{note}", *args[1:])
            if note in str(exception):
                return
        except (AttributeError, TypeError):
            pass
    print(note, file=sys.stderr, flush=True)
