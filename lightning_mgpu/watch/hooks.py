"""The phases, fed from Lightning's callback hooks: a mixin with the hooks' names, for a ``Callback`` of the caller's.

Lightning is not imported here (this unit sits below the callbacks and strategies): the strategy's
fit callback (``strategies/parts/reliability.py``) and the doctor's (``callbacks/doctor``) are
``class X(PhaseHooks, Callback)``. Each hook is a few attribute writes on this process's heartbeat.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from lightning_mgpu._compat.torch import default_group_store
from lightning_mgpu.watch.heartbeat import Heartbeat
from lightning_mgpu.watch.report import send_to_loggers
from lightning_mgpu.watch.watcher import the_watch

__all__ = ["PhaseHooks", "local_ranks", "log_dir_of", "stage_of", "watch_trainer"]


def _count(value: Any) -> Optional[int]:
    """A loop's number of batches, or None (unknown, infinite)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if math.isfinite(number) else None


def _of(counts: Any, index: int) -> Optional[int]:
    try:
        return _count(counts[index])
    except (TypeError, IndexError, KeyError):
        return None


def log_dir_of(trainer: Any) -> Optional[str]:
    """Where this rank's first logger writes (its ``log_dir``, else its ``save_dir``), else the Trainer's
    ``default_root_dir``: ``trainer.log_dir`` without its broadcast (a collective, not to be called from a thread)."""
    loggers = list(getattr(trainer, "loggers", None) or [])
    if loggers:
        directory = getattr(loggers[0], "log_dir", None) or getattr(loggers[0], "save_dir", None)
        if directory:
            return str(directory)
    root = getattr(trainer, "default_root_dir", None)
    return None if root is None else str(root)


def local_ranks(trainer: Any) -> range:
    """The ranks of this machine if ranks are numbered node by node (Lightning's and torchrun's way)."""
    per_node = max(1, int(trainer.world_size) // max(1, int(trainer.num_nodes)))
    first = int(trainer.node_rank) * per_node
    return range(first, first + per_node)


def stage_of(trainer: Any) -> Optional[str]:
    """``fit``, ``validate``, ``test`` or ``predict``: the Trainer call running."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return None if fn is None else str(getattr(fn, "value", fn))


def watch_trainer(
    trainer: Any,
    *,
    owner: str,
    timeout: float,
    signals: tuple[int, ...] = (),
    on_signal: Optional[Callable[[int], None]] = None,
) -> bool:
    """Start (or join) this rank's hang watch for ``trainer``'s call starting, its reports also sent to the
    Trainer's loggers; False when nothing was started (one rank, no store)."""

    def to_loggers(report: dict[str, Any]) -> None:
        send_to_loggers(trainer.loggers, report)

    return the_watch().start(
        owner=owner,
        store=default_group_store(),
        rank=trainer.global_rank,
        world_size=trainer.world_size,
        timeout=timeout,
        stage=stage_of(trainer),
        log_dir=log_dir_of(trainer),
        signals=signals,
        on_signal=on_signal,
        on_report=to_loggers,
        neighbours=local_ranks(trainer),
    )


class PhaseHooks:
    """Callback hooks that tell the watch what the main thread is doing (see the module docstring)."""

    _saved_position: Optional[tuple[Optional[int], Optional[int]]] = None

    @property
    def heartbeat(self) -> Heartbeat:
        return the_watch().heartbeat

    # ------------------------------------------------------------------ training

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        beat = self.heartbeat
        beat.epoch = trainer.current_epoch
        beat.enter_phase("data_fetch")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        beat = self.heartbeat
        beat.step = trainer.global_step
        beat.enter_phase("forward", batch=batch_idx, batches=_count(trainer.num_training_batches))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self.heartbeat.backward_started()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self.heartbeat.enter_phase("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.heartbeat.batch_finished(step=trainer.global_step)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.heartbeat.enter_phase("train_epoch_end")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.heartbeat.enter_phase("train_end")

    # ------------------------------------------------------------------ evaluation loops

    def _loop_start(self, phase: str) -> None:
        beat = self.heartbeat
        if beat.stage == "fit" and phase == "validation":
            self._saved_position = (beat.batch, beat.batches)
        beat.enter_phase(phase, batch=0, batches=None)

    def _loop_end(self) -> None:
        beat = self.heartbeat
        saved = self._saved_position
        if beat.stage == "fit" and saved is not None:
            self._saved_position = None
            beat.enter_phase("data_fetch", batch=saved[0], batches=saved[1])

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start("validation")

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        self.heartbeat.enter_phase("data_fetch")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start("validation")

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.heartbeat.enter_phase("validation", batch=batch_idx, batches=_of(trainer.num_val_batches, dataloader_idx))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._loop_end()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start("test")

    def on_test_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.heartbeat.enter_phase("test", batch=batch_idx, batches=_of(trainer.num_test_batches, dataloader_idx))

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start("predict")

    def on_predict_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.heartbeat.enter_phase("predict", batch=batch_idx, batches=_of(trainer.num_predict_batches, dataloader_idx))

    # ------------------------------------------------------------------ checkpoints

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.heartbeat.enter_phase("checkpoint_save")
