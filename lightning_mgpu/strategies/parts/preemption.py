"""Preemption: SIGTERM (and SLURM's requeue signal) stops every rank at the next step boundary.

Schedulers preempt a job with ``SIGTERM`` (SLURM, Kubernetes, ``kill -TERM -PGID``: often to
every process at once, sometimes to one) or warn it with ``--signal=USR1@90``. Lightning 2.6
broadcasts from *inside* its SIGTERM handler: a rank that gets the signal alone, or while the
others are in another collective, waits there until the collective timeout (30 minutes by
default); SIGTERM to rank 0 ended the fit with status 0, no checkpoint, training unfinished.

What our strategies do instead, on every rank:

1. **A flag, nothing else, in the handler.** ``setup`` routes the handlers Lightning registers for
   ``SIGTERM`` and SLURM's requeue signal to :meth:`Preemption.notify`
   (``_compat.lightning.route_preemption_signals``); a signal Lightning does not handle (SLURM's
   requeue signal without ``auto_requeue``) gets our own handler from ``on_train_start`` on. A
   Python handler runs only when the main thread runs Python: while it is blocked in a collective,
   the hang watch's thread (:mod:`lightning_mgpu.watch.signals`) sees the signal at once and calls
   :meth:`Preemption.notify` for it; if the rank then cannot reach its step boundary (no progress
   for the watch's preemption grace), the watch reports where every rank is and ends the job with
   the signal's status instead of waiting for the collective timeout.
2. **Agreement at the step boundary.** After every optimizer step (in ``on_train_batch_end``,
   outside gradient-accumulation windows, through the strategy's fit callback of
   :mod:`.reliability`, which runs after every other callback) the ranks all-reduce the flag with ``MAX``: one scalar
   collective per step, on gloo (a side gloo group under NCCL, so that no CUDA synchronisation is
   added). Every rank sees the same answer, so every rank stops at the same step.
3. **The last completed step is saved.** With a ``ModelCheckpoint``: to its directory under its
   "last" name (``last.ckpt``), which ``fit(ckpt_path="last")`` resumes from. Under SLURM with
   ``auto_requeue``: Lightning's ``hpc_ckpt_N.ckpt`` in ``default_root_dir``, which the requeued
   job resumes from by itself; on the requeue signal rank 0 also runs ``scontrol requeue``, as
   Lightning does. Without a checkpoint callback nothing is saved (the message says so).
4. **A prompt exit naming the signal.** Every rank raises :class:`Preempted`, a ``SystemExit`` with
   status 128 + the signal's number (143 for SIGTERM, as a shell reports a process it killed),
   after printing what happened. Under Lightning's own launcher the launching process (rank 0)
   waits for the ranks it started to stop (its child watcher, which would kill it on seeing a
   non-zero child status, is disarmed first) and exits with the same status.

A signal that arrives when no step boundary is left (after the last step, during the final
validation) is delivered again at teardown to the handler that was there before the fit (by
default: the process ends), once the fit is done with it: deferred, never swallowed. When the fit
is failing anyway (e.g. torchrun's SIGTERM to the ranks that survive a lost one), the error ends
it: delivering the signal then would kill the process before its error is printed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mgpu._compat.lightning import route_preemption_signals
from lightning_mgpu.strategies.parts import failures as _failures
from lightning_mgpu.watch.report import signal_name

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Preempted", "Preemption", "signal_name"]

_NOTE = _failures._NOTE_MARK


class Preempted(SystemExit):
    """Raised on every rank after a preemption signal: the exit status is 128 + the signal's number.

    A ``SystemExit``, like Lightning's own ``SIGTERMException``: an ``except Exception`` around
    ``fit`` does not swallow it, and the process ends with that status unless caught on purpose.
    """

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


class Preemption:
    """One strategy's preemption handling, for one fit at a time (see the module docstring)."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        """The signal this rank received (the largest number if several), or None."""
        self.stopped_by: Optional[int] = None
        """The signal the ranks agreed to stop on, once they did."""
        self._rank = 0
        self._world_size = 1
        self._signals: dict[int, bool] = {}  # signal -> requeue the job on it
        self._before_fit: dict[int, Any] = {}  # the handlers in place before the fit
        self._installed: dict[int, Any] = {}  # signals we handle directly -> the handler we replaced
        self._routed: set[int] = set()
        self._undo_routing: Optional[Any] = None
        self._group: Optional[dist.ProcessGroup] = None
        self._trainer: Optional["pl.Trainer"] = None
        self._host: Any = None

    # ------------------------------------------------------------------ the handler

    @property
    def signals(self) -> tuple[int, ...]:
        """The signals that preempt this fit (SIGTERM, and SLURM's requeue signal where there is one)."""
        return tuple(self._signals)

    def notify(self, signum: int) -> None:
        """The signal handler's whole work: remember the signal (and say so, async-signal-safely). Called twice for
        one signal when the main thread was blocked (the hang watch's thread first, the handler later): said once."""
        if self.received == signum:
            return
        self.received = signum if self.received is None else max(self.received, signum)
        note = f"{_NOTE} rank {self._rank}: received {signal_name(signum)}; stopping at the next step boundary\n"
        try:
            os.write(2, note.encode())  # not print(): the handler may interrupt a print on this thread
        except OSError:
            pass

    def _handler(self, signum: int, frame: Any) -> None:
        self.notify(signum)

    # ------------------------------------------------------------------ lifecycle (called by the strategy)

    def attach(self, trainer: "pl.Trainer", strategy: Any) -> None:
        """From ``strategy.setup``, on every rank, before Lightning registers its signal handlers."""
        self.received = self.stopped_by = None
        self._trainer, self._host = trainer, strategy
        self._rank, self._world_size = strategy.global_rank, strategy.world_size
        environment = strategy.cluster_environment
        self._signals = {signal.SIGTERM: False}
        if isinstance(environment, SLURMEnvironment) and environment.requeue_signal is not None:
            self._signals[int(environment.requeue_signal)] = bool(environment.auto_requeue)
        self._before_fit = {signum: signal.getsignal(signum) for signum in self._signals}
        self._undo_routing = route_preemption_signals(trainer, self.notify)
        self._routed = set()  # the signals Lightning's own handlers now route to notify()
        if self._undo_routing is not None:
            self._routed.add(int(signal.SIGTERM))
            if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
                self._routed.add(int(environment.requeue_signal))
        self._group = self._agreement_group(strategy)

    def _agreement_group(self, strategy: Any) -> Optional[dist.ProcessGroup]:
        """The default group on gloo; a gloo side group otherwise (no CUDA sync for a host flag)."""
        if self._world_size == 1 or not dist.is_initialized() or strategy.resolved_backend() == "gloo":
            return None
        try:
            group: dist.ProcessGroup = dist.new_group(backend="gloo")
            return group
        except (RuntimeError, ValueError):  # no gloo in this build: the flag goes through the default group
            return None

    def on_train_start(self) -> None:
        """After Lightning registered its handlers: our own for the signals it does not route to us."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in self._signals:
            if signum not in self._routed and signum not in self._installed:
                self._installed[signum] = signal.signal(signum, self._handler)

    def at_step_boundary(self, trainer: "pl.Trainer") -> None:
        """After an optimizer step (its ``on_train_batch_end``), on every rank: agree, and stop if any rank was signalled."""
        signum = self._agree()
        if signum:
            self._stop(trainer, signum)

    def _agree(self) -> int:
        local = self.received or 0
        if self._world_size == 1 or not dist.is_initialized():
            return local
        flag = torch.tensor([local], dtype=torch.int32)
        if self._group is None and self._host.resolved_backend() != "gloo":
            flag = flag.to(self._host.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def detach(self) -> None:
        """From ``strategy.teardown``: restore what was there, and deliver a signal the fit did not act on."""
        for signum, previous in self._installed.items():
            signal.signal(signum, previous)
        self._installed = {}
        if self._undo_routing is not None:
            self._undo_routing()
            self._undo_routing = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None
        pending, self.received = self.received, None
        failing = self._trainer is not None and self._trainer.interrupted  # teardown after an exception
        self._trainer, self._host = None, None
        if pending is None or self.stopped_by is not None:
            return
        if failing:
            # The fit is ending with an error, and so is the process unless the caller catches it: a
            # signal delivered now would end it before the error is printed (e.g. torchrun's SIGTERM to
            # the ranks that survive a lost one).
            print(
                f"{_NOTE} rank {self._rank}: {signal_name(pending)} came while the fit was failing; the error "
                "below ends it.",
                file=sys.stderr,
                flush=True,
            )
            return
        previous = self._before_fit.get(pending)
        previous = signal.SIG_DFL if previous is None else previous  # None: not set from Python, the default
        if _delivers_again(previous, routed=pending in self._routed):
            # No step boundary was left to stop at: give the signal to the handler that was there
            # before the fit (by default the process ends), now that the fit is done with it.
            print(
                f"{_NOTE} rank {self._rank}: {signal_name(pending)} came when no step boundary was left to stop at; "
                "delivering it again now that the fit has ended.",
                file=sys.stderr,
                flush=True,
            )
            signal.signal(pending, previous)
            signal.raise_signal(pending)

    # ------------------------------------------------------------------ stopping

    def _stop(self, trainer: "pl.Trainer", signum: int) -> None:
        strategy = self._host
        self.stopped_by = signum
        # Under Lightning's launcher this process started the other ranks of its node: its child
        # watcher kills it when it sees a child exit non-zero, as these are about to. Disarm it and
        # wait for them at exit instead (they stop by themselves, right after this).
        children = _failures.launched_children(strategy.launcher, self._rank)
        procs = getattr(strategy.launcher, "procs", None)
        if children and isinstance(procs, list):
            procs.clear()  # the watcher reads this very list: an empty one is a finished one
            _failures.reap_children_at_exit(children)
        requeue = self._signals.get(signum, False)  # SLURM's requeue signal, with auto_requeue
        path = self._checkpoint_path(trainer, hpc=any(self._signals.values()))  # SLURM with auto_requeue: hpc_ckpt
        if path is not None:
            trainer.save_checkpoint(path, weights_only=False)  # every rank: a strategy may gather state (PowerSGD)
        requeued = _requeue_slurm_job() if requeue and self._rank == 0 else None
        who = "this rank" if self.received == signum else "another rank"
        saved = (
            f"checkpoint of step {trainer.global_step} saved to {path} (resume: fit(..., ckpt_path=...) with it"
            + (", or ckpt_path='last')" if os.path.basename(path).startswith("last") else ")")
            if path is not None
            else "no checkpoint saved (the Trainer has no ModelCheckpoint)"
        )
        message = (
            f"{_NOTE} rank {self._rank}: preempted by {signal_name(signum)} (received by {who}); every rank stopped "
            f"after global step {trainer.global_step}; {saved}; "
            + (f"{requeued}; " if requeued else "")
            + f"exiting with status {128 + signum} (128 + {signal_name(signum)}) at {time.time():.3f}."
        )
        print(message, file=sys.stderr, flush=True)
        raise Preempted(signum, message)

    def _checkpoint_path(self, trainer: "pl.Trainer", *, hpc: bool) -> Optional[str]:
        """Where the preemption checkpoint goes (the same on every rank: rank 0 decides)."""
        path: Optional[str] = None
        if self._rank == 0:
            if hpc:
                path = _next_hpc_checkpoint(str(trainer.default_root_dir))
            else:
                callback = trainer.checkpoint_callback
                if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                    metrics = {**trainer.callback_metrics}
                    metrics.update(epoch=torch.tensor(trainer.current_epoch), step=torch.tensor(trainer.global_step))
                    path = callback.format_checkpoint_name(metrics, filename=callback.CHECKPOINT_NAME_LAST)
        if self._world_size > 1:
            path = self._host.broadcast(path, src=0)
        return path


def _delivers_again(previous: Any, *, routed: bool) -> bool:
    """Whether a signal the fit did not act on must go to ``previous``, the handler from before the fit:
    not when it ignores the signal, nor when Lightning's own handler already called it (it calls the
    handler it found, unless that is the default action)."""
    if previous == signal.SIG_IGN:
        return False
    return not (routed and callable(previous))


def _next_hpc_checkpoint(directory: str) -> str:
    """Lightning's SLURM checkpoint name, ``hpc_ckpt_N.ckpt`` with N one above the largest there."""
    numbers = [0]
    if os.path.isdir(directory):
        numbers += [
            int(m.group(1)) for name in os.listdir(directory) if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", name))
        ]
    return os.path.join(directory, f"hpc_ckpt_{max(numbers) + 1}.ckpt")


def _requeue_slurm_job() -> str:
    """``scontrol requeue`` this SLURM job (an array task included), as Lightning does; what happened, in words."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = (
        f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    )
    if not re.fullmatch(r"[0-9_]+", job):
        return f"not requeued (no usable SLURM job id: {job!r})"
    try:
        completed = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"requeueing SLURM job {job} failed ({error})"
    if completed.returncode != 0:
        return f"requeueing SLURM job {job} failed (scontrol exit {completed.returncode}: {completed.stderr.strip()[:200]})"
    return f"SLURM job {job} requeued"
