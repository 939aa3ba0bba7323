"""What makes a fit of ours end well, in one place: every strategy of the package calls this one object
from the same Lightning hooks, so each mechanism works the same way under ``ddp_tuned`` and ``hybrid``.

* **Preemption** (:mod:`.preemption`): SIGTERM and SLURM's requeue signal stop every rank at the
  next step boundary, with the last completed step saved and an exit status naming the signal. The
  boundary is the end of an optimizer step's ``on_train_batch_end``, after every other callback (so a
  ``ModelCheckpoint`` has saved that step): a strategy has no hook there, so :meth:`Reliability.setup`
  appends one callback of its own, :class:`FitBoundaries`, last to the Trainer's callbacks for the
  fit (it says so in ``trainer.callbacks``, by its name) and removes it at teardown. A checkpoint
  saved there is one Lightning resumes exactly; any earlier hook (the next batch's start) would save
  a half-started batch.
* **Checkpoints that are whole or absent** (:mod:`.checkpoint_io`): the default writer is atomic; a
  ``TorchCheckpointIO`` of the user's stays the strategy's ``checkpoint_io`` and is given a temporary
  path renamed over the checkpoint's; a damaged file is named on load; nothing is unpickled unless
  asked to.
* **Failures that say what happened** (:mod:`.failures`): DDP's error for reentrant activation
  checkpointing translated into its fixes; a failed collective explained by naming the lost ranks;
  no child rank left running after the launching process fails.
* **Hangs that end in seconds, saying where** (:mod:`lightning_mgpu.watch`): with ``hang_timeout``
  set, every rank's watch starts at ``setup`` (any Trainer call: fit, validate, test, predict) and
  stops at teardown. The same fit callback (:class:`WatchedFitBoundaries` then) feeds it the phases,
  a checkpoint save says so here, and a preemption signal that arrives while the main thread is
  blocked in a collective reaches :class:`.preemption.Preemption` through the watch's thread. On a
  hang one rank prints the report, writes ``hang_report.json`` to the log directory and the
  loggers, and every rank exits non-zero; after a collective failed because a rank left, the
  report names it and where it was.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback

from lightning_mgpu._compat.lightning import PathLike, in_accumulation_window
from lightning_mgpu.comm.distributed import lost_peer
from lightning_mgpu.strategies.parts import failures
from lightning_mgpu.strategies.parts.checkpoint_io import (
    AtomicCheckpointIO,
    atomic_rename_target,
    load_naming_damage,
    names_damaged_files,
    replace_atomically,
)
from lightning_mgpu.strategies.parts.preemption import Preemption
from lightning_mgpu.watch.hooks import PhaseHooks, watch_trainer
from lightning_mgpu.watch.watcher import the_watch

if TYPE_CHECKING:
    import lightning.pytorch as pl


class FitBoundaries(Callback):
    """The strategy's own callback for one Trainer call (see the module docstring): runs the reliability mechanisms
    at the boundaries a strategy has no hook for. Last in ``trainer.callbacks`` while the call runs."""

    def __init__(self, reliability: "Reliability") -> None:
        self.reliability = reliability

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not in_accumulation_window(trainer):
            self.reliability.preemption.at_step_boundary(trainer)


class WatchedFitBoundaries(PhaseHooks, FitBoundaries):
    """:class:`FitBoundaries` that also tells the hang watch each phase (the one used while the watch runs)."""

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        PhaseHooks.on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx)
        FitBoundaries.on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx)


class Reliability:
    """One strategy's preemption handling, checkpoint writing, failure notes and hang watch (see the module docstring).

    Args:
        hang_timeout: seconds without progress before the watch reports a hang and ends the job (None: no watch).
    """

    def __init__(self, *, hang_timeout: Optional[float] = None) -> None:
        self.preemption = Preemption()
        self.hang_timeout = hang_timeout
        self._boundaries: Optional[FitBoundaries] = None
        self._trainer: Optional["pl.Trainer"] = None
        self._watching = False

    # ------------------------------------------------------------------ the fit's lifecycle

    def setup(self, trainer: "pl.Trainer", strategy: Any) -> None:
        """From ``strategy.setup`` (before Lightning registers its signal handlers)."""
        from lightning.pytorch.trainer.states import TrainerFn

        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.preemption.attach(trainer, strategy)
        if self.hang_timeout is not None and strategy.world_size > 1:
            self._watching = watch_trainer(
                trainer,
                owner="strategy",
                timeout=self.hang_timeout,
                signals=self.preemption.signals if fitting else (),
                on_signal=self.preemption.notify if fitting else None,
            )
        if fitting or self._watching:
            boundaries = WatchedFitBoundaries if self._watching else FitBoundaries
            self._trainer, self._boundaries = trainer, boundaries(self)
            _callbacks(trainer).append(self._boundaries)

    def on_train_start(self) -> None:
        self.preemption.on_train_start()

    def teardown(self) -> None:
        """Last: the fit's callback removed, the watch stopped, and a signal no boundary acted on goes to the
        handler from before the fit."""
        if self._trainer is not None and self._boundaries in _callbacks(self._trainer):
            _callbacks(self._trainer).remove(self._boundaries)
        self._trainer, self._boundaries = None, None
        if self._watching:
            self._watching = False
            the_watch().finish("strategy")
        self.preemption.detach()

    # ------------------------------------------------------------------ failures

    def on_exception(self, exception: BaseException, *, launcher: Any, rank: int, timeout: Any, **facts: Any) -> None:
        """Name the lost ranks in the error (and, with the watch, where each was), explain DDP's reentrant-checkpoint
        error, and leave no child rank behind."""
        failures.explain_reentrant_failure(exception, **facts)  # raised outside our backward
        children = failures.launched_children(launcher, rank)
        note = failures.explain_collective_failure(exception, rank=rank, timeout=timeout, children=children)
        if note is not None and children:
            # Lightning's child-process watcher (it polls every 5 s) SIGKILLs this launching process
            # when it sees a dead child, possibly before the traceback is printed: say it now too.
            print(note, file=sys.stderr, flush=True)
        if self._watching:
            watch = the_watch()
            if lost_peer(exception):
                watch.report_failure(exception)
            watch.note_failure(exception)
        failures.reap_children_at_exit(children)

    # ------------------------------------------------------------------ checkpoints

    @staticmethod
    def checkpoint_io(io: CheckpointIO, *, given: bool) -> CheckpointIO:
        """The writer in force: the user's own as given, else an atomic one instead of Lightning's default."""
        return io if given or isinstance(io, AtomicCheckpointIO) else AtomicCheckpointIO()

    def save_checkpoint(
        self,
        io: CheckpointIO,
        save: Callable[[PathLike, Optional[Any]], None],
        filepath: PathLike,
        storage_options: Optional[Any],
        *,
        writes: bool,
    ) -> None:
        """``save(path, storage_options)``, through a temporary file renamed over ``filepath`` when the writer
        is a ``TorchCheckpointIO`` of the user's writing a local path (``writes``: this rank writes)."""
        if self._watching:
            the_watch().heartbeat.enter_phase("checkpoint_save")
        local = atomic_rename_target(io, filepath, storage_options) if writes else None
        if local is None:
            save(filepath, storage_options)
        else:
            replace_atomically(local, lambda temporary: save(temporary, None))

    @staticmethod
    def load_checkpoint(io: CheckpointIO, load: Callable[[], dict[str, Any]], path: PathLike) -> dict[str, Any]:
        """``load()``, a damaged file named as the default writer names it."""
        if names_damaged_files(io):
            return load_naming_damage(load, path, verify_checksums=True)
        return load()


def _callbacks(trainer: "pl.Trainer") -> list[Callback]:
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    return callbacks
