"""The contract every callback of the package keeps: construct -> fit -> fit again -> checkpoint round trip.

The callbacks are found in ``lightning_mgpu.callbacks.__all__``, so a new one is held to the
contract the day it is exported; it only needs an entry in ``CONTRACTS`` saying which
settings suit a 6-step fit and what it produces. Everything runs in this process: one CPU
device under ``ddp_tuned`` (a one-rank gloo process group, so the communication hook chain
is really there), a tiny model, files under ``tmp_path`` only.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu.callbacks
from lightning_mgpu import CommProfiler, DistributedDoctor
from tests.scripts.models import MLPRegressor
from tests.conftest import destroy_default_group

STEPS = 6  # per fit; the resumed fit goes on to 2 * STEPS

CALLBACKS = sorted(
    (
        exported
        for exported in (getattr(lightning_mgpu.callbacks, name) for name in lightning_mgpu.callbacks.__all__)
        if inspect.isclass(exported) and issubclass(exported, L.Callback)
    ),
    key=lambda cls: cls.__name__,
)


@dataclass(frozen=True)
class Contract:
    """What one callback needs for a short fit, and what it must produce."""

    settings: dict[str, Any]
    """Constructor arguments for a ``STEPS``-step fit (the defaults are meant for long runs)."""
    outcome: Callable[[Any, L.Trainer], Any]
    """What the callback produced in the fit that just ended (plain data, compared with ``==``)."""
    fresh: Any
    """``outcome`` after a fit from scratch: the first, and the second with the same instance."""
    resumed: Any
    """``outcome`` after a fit resumed from the second one's checkpoint and run to ``2 * STEPS``."""


def _profiler_outcome(profiler: CommProfiler, trainer: L.Trainer) -> Any:
    assert profiler.summary is not None, "no profile after the fit"
    logged = sorted(key for key in trainer.logged_metrics if key.startswith("comm/"))
    return {
        "steps": profiler.summary["steps"],
        "measures_comm": profiler.summary["measures_comm"],
        "bytes_per_step": profiler.summary["bytes_per_step"],
        "logs comm/step_ms": "comm/step_ms" in logged,
        "state": profiler.state_dict(),
    }


def _doctor_outcome(doctor: DistributedDoctor, trainer: L.Trainer) -> Any:
    state = doctor.state_dict()
    return {"rules": [f.rule for f in doctor.findings], "batches_seen": state["batches_seen"]}


GRADIENT_BYTES = 4 * (32 * 16 + 16 + 16 * 16 + 16 + 16 * 1 + 1)  # the model below, float32

CONTRACTS: dict[type[L.Callback], Contract] = {
    CommProfiler: Contract(
        settings={"warmup_steps": 1, "every_n_steps": 2, "profile_every": None, "timeline_steps": 0},
        outcome=_profiler_outcome,
        # DDP's first two steps (initial bucket layout, then its rebuild) are never profiled
        fresh={
            "steps": STEPS - 2,
            "measures_comm": True,
            "bytes_per_step": GRADIENT_BYTES,
            "logs comm/step_ms": True,
            "state": {"sync_steps_seen": STEPS, "schedule_origin": 0},
        },
        resumed={
            "steps": STEPS - 2,  # a new DDP wrapper: its first two steps again
            "measures_comm": True,
            "bytes_per_step": GRADIENT_BYTES,
            "logs comm/step_ms": True,
            "state": {"sync_steps_seen": 2 * STEPS, "schedule_origin": 0},  # counted on from the checkpoint
        },
    ),
    DistributedDoctor: Contract(
        settings={"check_every_n_batches": 2},
        outcome=_doctor_outcome,
        fresh={"rules": ["dataparallel-wrapped"], "batches_seen": STEPS},
        resumed={"rules": ["dataparallel-wrapped"], "batches_seen": 2 * STEPS},
    ),
}


class TinyModel(MLPRegressor):
    """32 -> 16 -> 16 -> 1; the net inside ``nn.DataParallel`` (a pass-through on CPU), a mistake
    the doctor reports on any number of ranks, so that every fit has a finding to produce."""

    def __init__(self) -> None:
        super().__init__(width=16, depth=1, lr=0.05)
        self.net = nn.DataParallel(self.net)  # type: ignore[assignment]


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS, 32, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8)


def _fit(callback: L.Callback, root: Path, *, max_steps: int, ckpt_path: Optional[Path] = None) -> L.Trainer:
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="ddp_tuned",
        max_steps=max_steps,
        callbacks=[callback],
        default_root_dir=root,
        logger=CSVLogger(root, name="logs"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModel(), _loader(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def one_rank_process_group() -> Iterator[None]:
    """Lightning's DDP on one device writes its launcher's variables into ``os.environ`` and leaves
    the process group up: both are undone, so that the tests after this one see a clean process."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        destroy_default_group()  # freed on the main thread: tests/conftest.py
    os.environ.clear()
    os.environ.update(environ)


def test_every_exported_callback_has_a_contract() -> None:
    assert CALLBACKS, "lightning_mgpu.callbacks.__all__ exports no callback"
    missing = [cls.__name__ for cls in CALLBACKS if cls not in CONTRACTS]
    assert not missing, (
        f"no entry in CONTRACTS for {missing}: add the settings that make it work in a {STEPS}-step fit "
        "and the outcome it produces, so that it is held to construct -> fit -> fit again -> checkpoint round trip"
    )


@pytest.mark.usefixtures("no_gpu_visible")  # asserts CPU behaviour, also on a GPU machine
@pytest.mark.timeout(120)
@pytest.mark.parametrize("callback_class", CALLBACKS, ids=lambda cls: cls.__name__)
def test_callback_contract(
    callback_class: type[L.Callback], tmp_path: Path, one_rank_process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    contract = CONTRACTS.get(callback_class)
    if contract is None:
        pytest.fail(
            f"{callback_class.__name__} has no entry in CONTRACTS (see test_every_exported_callback_has_a_contract)"
        )

    # construct: the defaults alone work (a LightningCLI YAML may give no init_args)
    assert isinstance(callback_class(), L.Callback)
    callback = callback_class(**contract.settings)

    # fit
    trainer = _fit(callback, tmp_path / "first", max_steps=STEPS)
    assert trainer.global_step == STEPS
    assert contract.outcome(callback, trainer) == contract.fresh

    # fit again: the same instance under a new Trainer starts afresh and produces it all again
    trainer = _fit(callback, tmp_path / "second", max_steps=STEPS)
    assert trainer.global_step == STEPS
    assert contract.outcome(callback, trainer) == contract.fresh

    # checkpoint round trip: the saved state is the callback's, in plain types (weights_only loads it) ...
    checkpoint = tmp_path / "second.ckpt"
    trainer.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=True)["callbacks"][callback.state_key]
    assert saved == callback.state_dict()

    # ... a new instance resuming from it loads exactly that state ...
    resumed = callback_class(**contract.settings)
    loaded: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (given, state right after loading)
    original_load = resumed.load_state_dict

    def load_and_record(state_dict: dict[str, Any]) -> None:
        original_load(state_dict)
        loaded.append((state_dict, resumed.state_dict()))

    monkeypatch.setattr(resumed, "load_state_dict", load_and_record)
    trainer = _fit(resumed, tmp_path / "resumed", max_steps=2 * STEPS, ckpt_path=checkpoint)
    assert [given for given, _ in loaded] == [saved]
    assert [after for _, after in loaded] == [saved]

    # ... and goes on from where the checkpoint left off
    assert trainer.global_step == 2 * STEPS
    assert contract.outcome(resumed, trainer) == contract.resumed


@pytest.mark.timeout(120)
def test_an_unusable_profiler_export_dir_fails_the_fit_before_the_first_step(
    tmp_path: Path, one_rank_process_group: None
) -> None:
    """It used to fail in on_train_end, after training, skipping the code after fit."""
    not_a_dir = tmp_path / "profile.json"
    not_a_dir.write_text("{}")
    steps: list[int] = []

    class Counting(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            steps.append(1)

    profiler = CommProfiler(export_dir=not_a_dir)
    with pytest.raises(ValueError, match=r"export_dir=.*profile\.json.* is not a directory"):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy="ddp_tuned",
            max_steps=2,
            callbacks=[profiler, Counting()],
            default_root_dir=tmp_path,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip  (the Trainer's settings, kept together)
        trainer.fit(TinyModel(), _loader())
    assert steps == []
