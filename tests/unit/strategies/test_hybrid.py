"""HybridParallelStrategy in-process: arguments and placement checks.

Fits on CPU "devices" (subprocesses): tests/dist/strategies/test_hybrid.py.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import nn

import lightning_mgpu
from lightning_mgpu import HybridParallelStrategy
from lightning_mgpu.placement.runner import check_model, find_split_module


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices_per_replica": 0}, "devices_per_replica must be an integer >= 1, got 0"),
        ({"devices_per_replica": 2.0}, "devices_per_replica must be an integer >= 1"),
        ({"devices_per_replica": True}, "devices_per_replica must be an integer >= 1"),
        ({"balance": "fastest"}, r"balance must be one of \('time', 'memory', 'params'\)"),
        ({"balance": 3}, "balance must be one of"),
        ({"balance": [1, 0]}, "every stage size must be an integer >= 1"),
        ({"balance": [1, 2, 3]}, "has 3 stage sizes but there are 2 devices per replica"),
        ({"microbatches": 0}, "microbatches must be an integer >= 1, got 0"),
        ({"microbatches": "4"}, "microbatches must be an integer >= 1"),
        ({"checkpoint": "sometimes"}, "checkpoint must be one of"),
        ({"split_module": ""}, "split_module must be the attribute name"),
        ({"split_module": 3}, "split_module must be the attribute name"),
        ({"sample_input": [1, 2]}, "sample_input must be a tensor"),
        ({"threads_per_stage": 0}, "threads_per_stage must be an integer >= 1"),
        ({"split_points": "model.h.2"}, "split_points must be a list of qualified submodule names"),
        ({"split_points": ["a", ""]}, "split_points must be a list of qualified submodule names"),
        ({"split_points": ["a", "b"]}, r"makes 3 stage\(s\) but devices_per_replica=2: give 1 name"),
        ({"split_points": ["a"], "split_module": "body"}, "give split_points or split_module, not both"),
        ({"schedule": "interleaved"}, r"schedule must be one of \('gpipe', '1f1b', 'zero_bubble'\)"),
        ({"find_unused_parameters": True}, "find_unused_parameters=True is not supported"),
        ({"bucket_cap_mb": -1}, "bucket_cap_mb"),
        ({"compression": "zip"}, "compression must be one of"),
    ],
)
def test_every_bad_argument_gets_one_clear_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridParallelStrategy(**kwargs)


def test_registered_and_listed() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert "hybrid" in lightning_mgpu.STRATEGY_NAMES
    assert StrategyRegistry["hybrid"]["strategy"] is HybridParallelStrategy
    assert StrategyRegistry["ddp_tuned"]["strategy"] is lightning_mgpu.TunedDDPStrategy  # not overwritten


def test_a_device_count_that_is_not_a_multiple_fails_before_any_process_starts() -> None:
    with pytest.raises(
        ValueError, match=r"devices_per_replica=2\) needs a device count per node that is a multiple of 2"
    ):
        L.Trainer(accelerator="cpu", devices=3, strategy=HybridParallelStrategy(devices_per_replica=2), logger=False)


def test_world_size_is_devices_over_k() -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=HybridParallelStrategy(devices_per_replica=2), logger=False
    )
    strategy = trainer.strategy
    assert strategy.num_processes == 2 and strategy.devices_per_replica == 2
    assert strategy.determine_ddp_device_ids() is None
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


# ----------------------------------------------------------------------------- placement checks
class _Module(L.LightningModule):
    def __init__(self, **parts: nn.Module) -> None:
        super().__init__()
        for name, part in parts.items():
            setattr(self, name, part)


def _seq(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers) if layers else nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def test_the_split_module_is_found_or_the_error_says_how_to_name_it() -> None:
    module = _Module(body=_seq(), head=nn.Linear(4, 1))
    assert find_split_module(module, None)[0] == "body"
    with pytest.raises(ValueError, match=r"2 nn.Sequential children \(a, b\). Pass split_module="):
        find_split_module(_Module(a=_seq(), b=_seq()), None)
    with pytest.raises(ValueError, match=r"0 nn.Sequential children \(none\)"):
        find_split_module(_Module(head=nn.Linear(4, 1)), None)
    nested = _Module(trunk=_Module(layers=_seq()), other=_seq())
    assert find_split_module(nested, "trunk.layers")[0] == "trunk.layers"
    with pytest.raises(ValueError, match=r"split_module='head': _Module.head is Linear, not an nn.Sequential"):
        find_split_module(module, "head")
    with pytest.raises(ValueError, match=r"split_module='missing': _Module.missing is nothing"):
        find_split_module(module, "missing")


def _check(strategy: HybridParallelStrategy, module: nn.Module) -> Optional[str]:
    """The strategy's model checks on two CPU devices: raise for what it refuses, return its warning."""
    return check_model(module, strategy._options, [torch.device("cpu")] * strategy.devices_per_replica)


def test_unsupported_models_are_refused_with_the_reason() -> None:
    strategy = HybridParallelStrategy(devices_per_replica=2, microbatches=4)
    with pytest.raises(ValueError, match=r"`body` has 1 layer\(s\) but devices_per_replica=2"):
        _check(strategy, _Module(body=_seq(nn.Linear(2, 2))))
    shared = nn.Linear(4, 4)
    body = _seq(shared, nn.ReLU())
    with pytest.raises(ValueError, match=r"parameters shared between `body` and the rest of the model.*tied\.weight"):
        _check(strategy, _Module(body=body, tied=shared))
    sync = _seq(nn.Linear(4, 4), nn.SyncBatchNorm(4))
    with pytest.raises(ValueError, match="contains SyncBatchNorm"):
        _check(strategy, _Module(body=sync))
    with pytest.raises(ValueError, match="adds up to 2 layers but the split module has 3"):
        _check(HybridParallelStrategy(balance=[1, 1]), _Module(body=_seq()))
    bn = _seq(nn.Linear(4, 4), nn.BatchNorm1d(4))
    warning = _check(strategy, _Module(body=bn))
    assert warning and re.search(
        r"contains BatchNorm with microbatches=4, checkpoint='never': .*normalises each micro-batch", warning
    )
    assert _check(HybridParallelStrategy(microbatches=1), _Module(body=bn)) is None
    warning = _check(HybridParallelStrategy(microbatches=1, checkpoint="always"), _Module(body=bn))
    assert warning and re.search(r"checkpoint='always'.*up to 2 times per step", warning)
    shared_inside = nn.Linear(4, 4)
    tied = _seq(shared_inside, nn.ReLU(), shared_inside)
    with pytest.raises(ValueError, match=r"layers 0 and 2 of `body` share a parameter"):
        _check(strategy, _Module(body=tied))
    with pytest.raises(ValueError, match="static_graph=True is not supported"):
        HybridParallelStrategy(static_graph=True)
