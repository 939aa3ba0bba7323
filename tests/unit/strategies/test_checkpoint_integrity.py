"""Checkpoints that were cut short or edited fail with one clear error (issue 17 items 5 and 6).

* Item 5: our strategies write a local checkpoint to a temporary file in its own directory,
  ``fsync`` it and ``os.replace`` it over the final name (Lightning's writer staged it in the
  system's temporary directory and moved it: across filesystems a copy, which a full disk or a
  kill leaves truncated under the final name); remote fsspec paths still work; a truncated or
  damaged file fails on load with an error that names it and says it is incomplete (before:
  ``OSError: [Errno 22] Invalid argument``, ``EOFError`` or a miniz message naming no file, or,
  for a flipped byte inside a tensor, nothing at all).
* Item 6: every field of ``checkpoint["lightning_mgpu"]`` is checked on load with the constructor's
  own checks; a bad entry is one ``ValueError`` that names the file and the key (before: a raw
  ``TypeError`` dumping parameter tensors, a bare ``ValueError``/``AttributeError``, or NaN
  accepted into PowerSGD's memory and from there into the parameters).
"""

from __future__ import annotations

import copy
import errno
import math
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import HybridParallelStrategy, TunedDDPStrategy
from lightning_mgpu.comm.powersgd_memory import PowerSGDLayoutKeeper
from lightning_mgpu.strategies.parts.checkpoint_io import IncompleteCheckpointError
from tests.conftest import destroy_default_group

# ----------------------------------------------------------------------------- item 5: atomic writes, damaged files


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 64)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, 64, generator=generator), torch.randn(16, 64, generator=generator))
        return DataLoader(data, batch_size=4)


def trainer(root: Path, strategy: TunedDDPStrategy, steps: int = 2) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _release(environ: dict[str, str]) -> None:
    """Lightning's DDP on one device leaves the process group up and its launcher's variables in
    ``os.environ``: undone, so that the tests after an in-process fit see a clean process."""
    if dist.is_available() and dist.is_initialized():
        destroy_default_group()  # freed on the main thread: tests/conftest.py
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture(autouse=True)
def _clean_process() -> Iterator[None]:
    environ = dict(os.environ)
    yield
    _release(environ)


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint written by a real fit (TunedDDPStrategy, one CPU device, Adam state included)."""
    root = tmp_path_factory.mktemp("fit")
    environ = dict(os.environ)
    trainer(root, TunedDDPStrategy()).fit(Tiny())
    _release(environ)
    path = root / "ckpt" / "epoch=0-step=2.ckpt"
    assert path.stat().st_size > 40_000
    return path


def test_checkpoints_are_written_beside_their_name_synced_and_renamed_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replaced: list[tuple[str, str]] = []
    synced: list[int] = []
    real_replace, real_fsync = os.replace, os.fsync
    monkeypatch.setattr(
        os, "replace", lambda src, dst: (replaced.append((str(src), str(dst))), real_replace(src, dst))[1]
    )
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    target = tmp_path / "ckpt" / "epoch=0-step=1.ckpt"
    TunedDDPStrategy().checkpoint_io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    assert [dst for _, dst in replaced] == [str(target)]  # the final name appears in one atomic rename...
    source = Path(replaced[0][0])
    assert source.parent == target.parent and source.name.startswith(
        ".epoch=0-step=1.ckpt."
    )  # ...from its own directory
    assert len(synced) >= 2  # the file's bytes, then the directory entry
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temporary file left
    assert torch.equal(torch.load(target, weights_only=True)["state_dict"]["w"], torch.ones(3))


def test_a_write_that_fails_midway_leaves_the_previous_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "last.ckpt"
    io = HybridParallelStrategy().checkpoint_io
    io.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}}, target)
    before = target.read_bytes()

    def disk_full(obj: Any, file: Any) -> None:
        file.write(b"PK\x03\x04" + b"x" * 5000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}}, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_remote_fsspec_paths_still_work() -> None:
    io = TunedDDPStrategy().checkpoint_io
    io.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}}, "memory://lightning_mgpu_test/a.ckpt")
    loaded = io.load_checkpoint("memory://lightning_mgpu_test/a.ckpt", weights_only=True)
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))


def test_a_users_own_checkpoint_io_is_kept() -> None:
    class Mine(TorchCheckpointIO):
        pass

    strategy = TunedDDPStrategy(checkpoint_io=Mine())
    assert type(strategy.checkpoint_io) is Mine


# A user's own TorchCheckpointIO() (issue 28 item 6: Lightning's test_accelerator_specific_checkpoint_io) stays the
# strategy's checkpoint_io, the very object; its checkpoints are still complete under their name or absent.


@pytest.mark.parametrize("strategy_class", [TunedDDPStrategy, HybridParallelStrategy])
@pytest.mark.parametrize("given", ["plugins", "constructor"])
def test_a_users_torch_checkpoint_io_is_the_strategys_own_object(strategy_class: type, given: str) -> None:
    mine = TorchCheckpointIO()
    if given == "plugins":
        strategy = strategy_class()
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=[mine], logger=False)
    else:
        strategy = strategy_class(checkpoint_io=mine)
    assert strategy.checkpoint_io is mine
    assert strategy.checkpoint_io is mine  # asked again: still not replaced


def test_a_users_torch_checkpoint_io_writes_beside_the_name_and_is_renamed_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = TorchCheckpointIO()
    strategy = TunedDDPStrategy(checkpoint_io=mine)
    written_to: list[str] = []
    real_save = TorchCheckpointIO.save_checkpoint

    def spy(self: TorchCheckpointIO, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        assert self is mine
        written_to.append(str(path))
        real_save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", spy)
    replaced: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(
        os, "replace", lambda src, dst: (replaced.append((str(src), str(dst))), real_replace(src, dst))[1]
    )
    target = tmp_path / "ckpt" / "epoch=0-step=1.ckpt"
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    assert len(written_to) == 1 and Path(written_to[0]).parent == target.parent
    assert Path(written_to[0]).name.startswith(".epoch=0-step=1.ckpt.")  # the user's object wrote a hidden temporary
    assert replaced[-1] == (written_to[0], str(target))  # renamed over the final name
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    assert torch.equal(strategy.load_checkpoint(target)["state_dict"]["w"], torch.ones(3))


def test_a_users_torch_checkpoint_io_cut_short_leaves_the_previous_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "last.ckpt"
    strategy = HybridParallelStrategy(checkpoint_io=TorchCheckpointIO())
    strategy.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}}, target)
    before = target.read_bytes()

    def disk_full(self: TorchCheckpointIO, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        Path(path).write_bytes(before[: len(before) // 3])  # a copy cut short where it was told to write
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", disk_full)
    with pytest.raises(OSError, match="No space left"):
        strategy.save_checkpoint({"state_dict": {"w": torch.ones(1000)}}, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_users_torch_checkpoint_io_names_a_truncated_file(real_checkpoint: Path, tmp_path: Path) -> None:
    cut = tmp_path / "epoch=1-step=8.ckpt"
    cut.write_bytes(real_checkpoint.read_bytes()[: 12 * 1024])
    with pytest.raises(IncompleteCheckpointError, match=re.escape(str(cut)) + " is incomplete"):
        TunedDDPStrategy(checkpoint_io=TorchCheckpointIO()).load_checkpoint(cut)


def test_a_fit_with_a_users_torch_checkpoint_io_keeps_it_and_resumes(tmp_path: Path) -> None:
    mine = TorchCheckpointIO()
    run = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=TunedDDPStrategy(),
        plugins=[mine],
        max_steps=2,
        default_root_dir=tmp_path,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    run.fit(Tiny())
    assert run.strategy.checkpoint_io is mine
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    trainer(tmp_path / "again", TunedDDPStrategy(), steps=3).fit(
        Tiny(), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    )


def test_a_checkpoint_io_that_writes_elsewhere_is_left_to_write_as_it_writes(tmp_path: Path) -> None:
    """Only a TorchCheckpointIO whose own writer is in use gets a temporary path: another one sees the real path."""

    class Sharded(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            Path(path).mkdir(parents=True)
            torch.save(checkpoint, Path(path) / "shard0.pt")

    strategy = TunedDDPStrategy(checkpoint_io=Sharded())
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "step=1.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=1.ckpt"]
    assert (tmp_path / "step=1.ckpt" / "shard0.pt").is_file()


@pytest.mark.parametrize("keep", [0, 100, 12 * 1024, 0.5, -10])
def test_a_truncated_checkpoint_fails_naming_the_file_and_saying_it_is_incomplete(
    real_checkpoint: Path, tmp_path: Path, keep: float
) -> None:
    data = real_checkpoint.read_bytes()
    cut = tmp_path / "epoch=1-step=8.ckpt"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(IncompleteCheckpointError) as caught:
        TunedDDPStrategy().load_checkpoint(cut)
    message = str(caught.value)
    assert str(cut) in message and "incomplete" in message, message


def test_a_flipped_byte_inside_a_tensor_is_caught(real_checkpoint: Path, tmp_path: Path) -> None:
    data = bytearray(real_checkpoint.read_bytes())
    with zipfile.ZipFile(real_checkpoint) as archive:
        biggest = max(archive.infolist(), key=lambda m: m.compress_size)
    data[biggest.header_offset + biggest.compress_size // 2] ^= 0xFF  # torch.load alone loads this silently
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(bytes(data))
    with pytest.raises(IncompleteCheckpointError, match=re.escape(str(damaged)) + ".*damaged.*CRC"):
        TunedDDPStrategy().load_checkpoint(damaged)


def test_resuming_a_fit_from_a_truncated_checkpoint_names_it(real_checkpoint: Path, tmp_path: Path) -> None:
    cut = tmp_path / "epoch=0-step=2.ckpt"
    cut.write_bytes(real_checkpoint.read_bytes()[: 12 * 1024])
    with pytest.raises(IncompleteCheckpointError, match=re.escape(str(cut)) + " is incomplete"):
        trainer(tmp_path, TunedDDPStrategy(), steps=4).fit(Tiny(), ckpt_path=cut)
    # and the whole file resumes
    trainer(tmp_path / "again", TunedDDPStrategy(), steps=3).fit(Tiny(), ckpt_path=real_checkpoint)


# ----------------------------------------------------------------------------- item 6: tampered entries


def valid_package() -> dict[str, Any]:
    """What a fit with bucket_cap_mb="auto", PowerSGD and 2 ranks stores (a real keeper's state)."""
    params = [("body.0.weight", torch.zeros(32, 16)), ("body.0.bias", torch.zeros(32))]
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    memory = PowerSGDLayoutKeeper(state, params).state_dict()
    memory["seed"] = 12345
    memory["q"] = {"body.0.weight": torch.randn(16 * 2)}
    error = {"body.0.weight": torch.randn(32 * 16), "body.0.bias": torch.randn(32)}
    del memory["error"]
    powersgd = {**memory, "world_size": 2, "error_per_rank": [error, copy.deepcopy(error)]}
    tuning = {"status": "done", "reason": "", "chosen_mb": 8.0, "default_mb": 25.0, "candidates": [{"size_mb": 8.0}]}
    hybrid = {"devices_per_replica": 2, "sizes": [2, 2], "microbatches": 2, "schedule": "gpipe", "split_points": None}
    return {
        "bucket_cap_mb": 8.0,
        "first_bucket_cap_mb": 1.0,
        "compression": "powersgd",
        "tuning": tuning,
        "powersgd": powersgd,
        "hybrid": hybrid,
    }


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(package: dict[str, Any]) -> None:
        target = package
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def _nan_in(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def change(package: dict[str, Any]) -> None:
        target = package
        for key in path:
            target = target[key]
        target.view(-1)[3] = math.nan

    return change


# (what is changed, the key the error must name)
TAMPERED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "bucket_cap_mb=1e300": (_set(("bucket_cap_mb",), 1e300), '["bucket_cap_mb"]'),
    "bucket_cap_mb=nan": (_set(("bucket_cap_mb",), math.nan), '["bucket_cap_mb"]'),
    "bucket_cap_mb='8'": (_set(("bucket_cap_mb",), "8"), '["bucket_cap_mb"]'),
    "first_bucket_cap_mb=-1": (_set(("first_bucket_cap_mb",), -1.0), '["first_bucket_cap_mb"]'),
    "compression='int8'": (_set(("compression",), "int8"), '["compression"]'),
    "tuning=[]": (_set(("tuning",), []), '["tuning"]'),
    "tuning.status=42": (_set(("tuning", "status"), 42), '["tuning"]["status"]'),
    "tuning.chosen_mb=inf": (_set(("tuning", "chosen_mb"), math.inf), '["tuning"]["chosen_mb"]'),
    "tuning.reason=tensor": (_set(("tuning", "reason"), torch.zeros(3)), '["tuning"]["reason"]'),
    "powersgd.iter='abc'": (_set(("powersgd", "iter"), "abc"), '["powersgd"]["iter"]'),
    "powersgd.iter=-1": (_set(("powersgd", "iter"), -1), '["powersgd"]["iter"]'),
    "powersgd.seed=1.5": (_set(("powersgd", "seed"), 1.5), '["powersgd"]["seed"]'),
    "powersgd.rng.keys='x'": (_set(("powersgd", "rng", "keys"), "x"), '["powersgd"]["rng"]["keys"]'),
    "powersgd.rng.keys short": (
        _set(("powersgd", "rng", "keys"), torch.zeros(3, dtype=torch.int64)),
        '["rng"]["keys"]',
    ),
    "powersgd.rng.pos=10**6": (_set(("powersgd", "rng", "pos"), 10**6), '["powersgd"]["rng"]["pos"]'),
    "powersgd.rng.cached_gaussian=nan": (_set(("powersgd", "rng", "cached_gaussian"), math.nan), '["cached_gaussian"]'),
    "powersgd.rng=None is fine, rng='x' is not": (_set(("powersgd", "rng"), "x"), '["powersgd"]["rng"]'),
    "powersgd.q=[1, 2]": (_set(("powersgd", "q"), [1, 2]), '["powersgd"]["q"]'),
    "powersgd.q entry a list": (_set(("powersgd", "q", "body.0.weight"), [1.0, 2.0]), '["q"]["body.0.weight"]'),
    "powersgd.q NaN": (_nan_in(("powersgd", "q", "body.0.weight")), '["powersgd"]["q"]["body.0.weight"]'),
    "powersgd.q integer tensor": (
        _set(("powersgd", "q", "body.0.weight"), torch.ones(32, dtype=torch.int64)),
        '["q"]["body.0.weight"]',
    ),
    "powersgd.error NaN": (
        _nan_in(("powersgd", "error_per_rank", 1, "body.0.bias")),
        '["error_per_rank"][1]["body.0.bias"]',
    ),
    "powersgd.error_per_rank='x'": (_set(("powersgd", "error_per_rank"), "x"), '["powersgd"]["error_per_rank"]'),
    "powersgd.world_size=0": (_set(("powersgd", "world_size"), 0), '["powersgd"]["world_size"]'),
    "powersgd.world_size vs error_per_rank": (_set(("powersgd", "world_size"), 3), '["powersgd"]["error_per_rank"]'),
    "hybrid.sizes=[0, 4]": (_set(("hybrid", "sizes"), [0, 4]), '["hybrid"]["sizes"]'),
    "hybrid.microbatches='2'": (_set(("hybrid", "microbatches"), "2"), '["hybrid"]["microbatches"]'),
}


def write(tmp_path: Path, package: Any, name: str = "tampered.ckpt") -> Path:
    path = tmp_path / name
    torch.save({"state_dict": {}, "lightning_mgpu": package}, path)
    return path


def test_a_valid_package_loads(tmp_path: Path) -> None:
    strategy = TunedDDPStrategy(bucket_cap_mb="auto", compression="powersgd")
    checkpoint = strategy.load_checkpoint(write(tmp_path, valid_package()))
    assert checkpoint["lightning_mgpu"]["bucket_cap_mb"] == 8.0
    assert strategy.bucket_cap_mb == 8.0 and strategy.tuning_status == "resumed"
    package = valid_package()
    package["powersgd"]["rng"] = None  # optional entries may be None or absent
    del package["tuning"], package["hybrid"]
    TunedDDPStrategy(compression="powersgd").load_checkpoint(write(tmp_path, package))


@pytest.mark.parametrize("case", list(TAMPERED))
@pytest.mark.parametrize("strategy", [TunedDDPStrategy, HybridParallelStrategy])
def test_a_tampered_entry_is_one_value_error_naming_the_file_and_the_key(
    tmp_path: Path, case: str, strategy: Callable[..., TunedDDPStrategy]
) -> None:
    change, key = TAMPERED[case]
    package = valid_package()
    change(package)
    path = write(tmp_path, package)
    with pytest.raises(ValueError) as caught:
        strategy(bucket_cap_mb="auto", compression="powersgd").load_checkpoint(path)
    message = str(caught.value)
    assert str(path) in message, message
    assert 'checkpoint["lightning_mgpu"]' in message and key in message, message
    assert "Parameter containing" not in message and len(message) < 800, message  # one readable message


def test_a_package_that_is_not_a_dict_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, [1, 2])
    with pytest.raises(ValueError, match=re.escape('checkpoint["lightning_mgpu"] must be a dict')):
        TunedDDPStrategy().load_checkpoint(path)


def test_unknown_entries_are_left_alone(tmp_path: Path) -> None:
    # a newer version may store more: an older one ignores what it does not know
    package = {**valid_package(), "from_the_future": object.__name__}
    TunedDDPStrategy(compression="powersgd").load_checkpoint(write(tmp_path, package))
