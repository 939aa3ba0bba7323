"""The phases the Lightning hooks report, and the hang_timeout argument of every public class that takes it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_mgpu import DistributedDoctor, HybridParallelStrategy, TunedDDPStrategy
from lightning_mgpu.watch import DEFAULT_HANG_TIMEOUT_S
from lightning_mgpu.watch.hooks import PhaseHooks, log_dir_of, stage_of
from lightning_mgpu.watch.watcher import the_watch


def trainer(**fields: Any) -> Any:
    defaults = {
        "current_epoch": 1,
        "global_step": 7,
        "num_training_batches": 6,
        "num_val_batches": [200],
        "num_test_batches": [5],
        "num_predict_batches": [float("inf")],
    }
    return SimpleNamespace(**{**defaults, **fields})


def test_a_training_step_goes_through_its_phases() -> None:
    hooks, beat, t = PhaseHooks(), the_watch().heartbeat, trainer()
    beat.reset(stage="fit")
    seen = []
    for hook, args in (
        ("on_train_epoch_start", ()),
        ("on_train_batch_start", (None, 3)),
        ("on_before_backward", (None,)),
        ("on_after_backward", ()),
        ("on_train_batch_end", (None, None, 3)),
        ("on_train_epoch_end", ()),
    ):
        progress = beat.progress
        getattr(hooks, hook)(t, None, *args)
        assert beat.progress > progress, hook
        seen.append(beat.phase)
    assert seen == ["data_fetch", "forward", "backward", "optimizer", "data_fetch", "train_epoch_end"]
    assert (beat.epoch, beat.step, beat.batch, beat.batches, beat.backwards, beat.batches_done) == (1, 7, 3, 6, 1, 1)


def test_validation_inside_fit_gives_the_training_position_back() -> None:
    hooks, beat, t = PhaseHooks(), the_watch().heartbeat, trainer()
    beat.reset(stage="fit")
    hooks.on_train_batch_start(t, None, None, 3)
    hooks.on_validation_start(t, None)
    hooks.on_validation_batch_start(t, None, None, 57)
    assert (beat.phase, beat.batch, beat.batches) == ("validation", 57, 200)
    hooks.on_validation_end(t, None)
    assert (beat.phase, beat.batch, beat.batches) == ("data_fetch", 3, 6)


def test_evaluation_loops_and_checkpoints() -> None:
    hooks, beat, t = PhaseHooks(), the_watch().heartbeat, trainer()
    beat.reset(stage="test")
    hooks.on_test_batch_start(t, None, None, 2)
    assert (beat.phase, beat.batch, beat.batches) == ("test", 2, 5)
    hooks.on_predict_batch_start(t, None, None, 4)
    assert (beat.phase, beat.batch, beat.batches) == ("predict", 4, None)  # an infinite loader: no count
    hooks.on_save_checkpoint(t, None, {})
    assert beat.phase == "checkpoint_save"


def test_the_log_directory_and_stage_without_a_collective() -> None:
    assert (
        log_dir_of(SimpleNamespace(loggers=[SimpleNamespace(log_dir="/logs/v3")], default_root_dir="/r")) == "/logs/v3"
    )
    wandb_like = SimpleNamespace(log_dir=None, save_dir="/wandb")
    assert log_dir_of(SimpleNamespace(loggers=[wandb_like], default_root_dir="/r")) == "/wandb"
    assert log_dir_of(SimpleNamespace(loggers=[], default_root_dir="/r")) == "/r"
    assert stage_of(SimpleNamespace(state=SimpleNamespace(fn=SimpleNamespace(value="fit")))) == "fit"
    assert stage_of(SimpleNamespace()) is None


@pytest.mark.parametrize("make", [TunedDDPStrategy, HybridParallelStrategy, DistributedDoctor])
def test_hang_timeout_is_on_by_default_none_turns_it_off_and_nonsense_is_refused(make: Any) -> None:
    assert make().hang_timeout == DEFAULT_HANG_TIMEOUT_S
    assert make(hang_timeout=None).hang_timeout is None
    assert make(hang_timeout=20).hang_timeout == 20.0
    for wrong in (0, 0.5, -3, "5", True, float("nan")):
        with pytest.raises(ValueError, match="hang_timeout"):
            make(hang_timeout=wrong)
