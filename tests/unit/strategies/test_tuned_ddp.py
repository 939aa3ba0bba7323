"""TunedDDPStrategy without starting processes: arguments, registry, DDP keyword arguments."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_mgpu
from lightning_mgpu import TunedDDPStrategy
from lightning_mgpu.comm.compression import bf16_allreduce_hook, resolve_compression
from lightning_mgpu.strategies.tuned_ddp import CHECKPOINT_KEY


def test_defaults_leave_ddp_untouched() -> None:
    strategy = TunedDDPStrategy()
    assert isinstance(strategy, DDPStrategy)
    assert strategy.ddp_kwargs == {}  # DDP builds its own default layout
    assert strategy.bucket_cap_mb == 25.0
    assert strategy.first_bucket_cap_mb == 1.0
    assert strategy.compression is None


@pytest.mark.parametrize(
    ("kwargs", "expected_list", "cap", "first"),
    [
        ({"bucket_cap_mb": 50}, [1.0, 50.0], 50.0, 1.0),
        ({"bucket_cap_mb": 0.25}, [0.25, 0.25], 0.25, 0.25),  # first bucket never above the cap
        ({"bucket_cap_mb": 8, "first_bucket_cap_mb": 2}, [2.0, 8.0], 8.0, 2.0),
        ({"first_bucket_cap_mb": 0.5}, [0.5, 25.0], 25.0, 0.5),
    ],
)
def test_explicit_cap_keeps_a_first_bucket(
    kwargs: dict[str, Any], expected_list: list[float], cap: float, first: float
) -> None:
    strategy = TunedDDPStrategy(**kwargs)
    assert strategy.ddp_kwargs == {"bucket_cap_mb_list": expected_list}
    assert (strategy.bucket_cap_mb, strategy.first_bucket_cap_mb) == (cap, first)


def test_other_kwargs_go_to_ddp() -> None:
    strategy = TunedDDPStrategy(bucket_cap_mb=4, static_graph=True, gradient_as_bucket_view=True)
    assert strategy.ddp_kwargs == {
        "static_graph": True,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb_list": [1.0, 4.0],
    }


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"bucket_cap_mb": 0}, ["bucket_cap_mb", "0"]),
        ({"bucket_cap_mb": -3.0}, ["bucket_cap_mb", "-3.0"]),
        ({"bucket_cap_mb": float("nan")}, ["bucket_cap_mb", "nan"]),
        ({"bucket_cap_mb": float("inf")}, ["bucket_cap_mb", "inf"]),
        ({"bucket_cap_mb": "25"}, ["bucket_cap_mb", "'25'", "str"]),
        ({"bucket_cap_mb": True}, ["bucket_cap_mb", "True"]),
        ({"first_bucket_cap_mb": 0}, ["first_bucket_cap_mb", "0"]),
        ({"bucket_cap_mb": 2, "first_bucket_cap_mb": 4}, ["first_bucket_cap_mb", "4", "bucket_cap_mb", "2"]),
        ({"compression": "int8"}, ["compression", "'int8'", "powersgd"]),
        ({"compression": "fp16", "ddp_comm_hook": lambda s, b: None}, ["compression", "ddp_comm_hook"]),
        ({"powersgd_rank": 0}, ["powersgd_rank", "0"]),
        ({"powersgd_rank": 1.5}, ["powersgd_rank", "1.5"]),
        ({"powersgd_start_iter": 1}, ["powersgd_start_iter", "1", ">= 2"]),
        ({"start_method": "thread"}, ["start_method", "'thread'", "spawn"]),
        ({"timeout": 30}, ["timeout", "30", "timedelta"]),
        ({"timeout": timedelta(seconds=-1)}, ["timeout"]),
        ({"bucket_size": 25}, ["bucket_size", "DistributedDataParallel", "static_graph"]),
        ({"static_graph": "yes"}, ["static_graph", "'yes'"]),
        ({"find_unused_parameters": 1}, ["find_unused_parameters", "1"]),
        ({"bucket_cap_mb_list": [1, 2]}, ["bucket_cap_mb_list", "first_bucket_cap_mb"]),
        ({"device_ids": [0]}, ["device_ids"]),
    ],
)
def test_bad_arguments_name_the_argument_and_value(kwargs: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        TunedDDPStrategy(**kwargs)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_auto_is_accepted_and_starts_from_ddps_default() -> None:
    # Tuning itself is tested in tests/unit/tuning/ and tests/dist/tuning/.
    strategy = TunedDDPStrategy(bucket_cap_mb="auto")
    assert strategy.auto and strategy.bucket_cap_mb == 25.0 and strategy.ddp_kwargs == {}


@pytest.mark.parametrize(
    ("name", "attrs"),
    [
        ("ddp_tuned", {"_compression": None, "_start_method": "popen"}),
        ("ddp_tuned_spawn", {"_compression": None, "_start_method": "spawn"}),
        ("ddp_tuned_fp16", {"_compression": "fp16", "_start_method": "popen"}),
        ("ddp_tuned_powersgd", {"_compression": "powersgd", "_start_method": "popen"}),
    ],
)
def test_registered_names_resolve_through_trainer(name: str, attrs: dict[str, Any]) -> None:
    assert name in lightning_mgpu.STRATEGY_NAMES
    assert name in StrategyRegistry
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, TunedDDPStrategy)
    assert trainer.world_size == 2
    for attr, value in attrs.items():
        assert getattr(trainer.strategy, attr) == value


def test_compression_resolution_per_backend() -> None:
    assert resolve_compression(None, backend="gloo", powersgd_rank=1, powersgd_start_iter=2) is None
    fp16 = resolve_compression("fp16", backend="gloo", powersgd_rank=1, powersgd_start_iter=2)
    assert fp16 is not None and fp16.wire_dtype == torch.float16
    bf16_gloo = resolve_compression("bf16", backend="gloo", powersgd_rank=1, powersgd_start_iter=2)
    assert bf16_gloo is not None and bf16_gloo.hook is bf16_allreduce_hook
    bf16_nccl = resolve_compression("bf16", backend="nccl", powersgd_rank=1, powersgd_start_iter=2)
    assert bf16_nccl is not None and bf16_nccl.hook.__name__ == "bf16_compress_hook"  # torch's own on NCCL
    powersgd = resolve_compression("powersgd", backend="gloo", powersgd_rank=3, powersgd_start_iter=7)
    assert powersgd is not None and powersgd.wire_dtype is None
    assert powersgd.state.matrix_approximation_rank == 3 and powersgd.state.start_powerSGD_iter == 7


def test_checkpoint_carries_the_bucket_state() -> None:
    strategy = TunedDDPStrategy(bucket_cap_mb=12, compression="fp16")
    assert strategy.state_for_checkpoint() == {"bucket_cap_mb": 12.0, "first_bucket_cap_mb": 1.0, "compression": "fp16"}
    assert CHECKPOINT_KEY == "lightning_mgpu"


def test_bucket_layout_is_none_before_ddp_exists() -> None:
    assert TunedDDPStrategy().bucket_layout is None
