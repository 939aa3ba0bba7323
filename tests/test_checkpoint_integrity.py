"""Checkpoints that were cut short or edited fail with one clear error (issue 17 items 5 and 6).

* Item 6: every field of ``checkpoint["lightning_mgpu"]`` is checked on load with the constructor's
  own checks; a bad entry is one ``ValueError`` that names the file and the key (before: a raw
  ``TypeError`` dumping parameter tensors, a bare ``ValueError``/``AttributeError``, or NaN
  accepted into PowerSGD's memory and from there into the parameters).
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lightning_mgpu import HybridParallelStrategy, TunedDDPStrategy
from lightning_mgpu.comm.powersgd_memory import PowerSGDLayoutKeeper

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
    "powersgd.rng.keys short": (_set(("powersgd", "rng", "keys"), torch.zeros(3, dtype=torch.int64)), '["rng"]["keys"]'),
    "powersgd.rng.pos=10**6": (_set(("powersgd", "rng", "pos"), 10**6), '["powersgd"]["rng"]["pos"]'),
    "powersgd.rng.cached_gaussian=nan": (_set(("powersgd", "rng", "cached_gaussian"), math.nan), '["cached_gaussian"]'),
    "powersgd.rng=None is fine, rng='x' is not": (_set(("powersgd", "rng"), "x"), '["powersgd"]["rng"]'),
    "powersgd.q=[1, 2]": (_set(("powersgd", "q"), [1, 2]), '["powersgd"]["q"]'),
    "powersgd.q entry a list": (_set(("powersgd", "q", "body.0.weight"), [1.0, 2.0]), '["q"]["body.0.weight"]'),
    "powersgd.q NaN": (_nan_in(("powersgd", "q", "body.0.weight")), '["powersgd"]["q"]["body.0.weight"]'),
    "powersgd.q integer tensor": (
        _set(("powersgd", "q", "body.0.weight"), torch.ones(32, dtype=torch.int64)), '["q"]["body.0.weight"]',
    ),
    "powersgd.error NaN": (
        _nan_in(("powersgd", "error_per_rank", 1, "body.0.bias")), '["error_per_rank"][1]["body.0.bias"]',
    ),
    "powersgd.error_per_rank='x'": (_set(("powersgd", "error_per_rank"), "x"), '["powersgd"]["error_per_rank"]'),
    "powersgd.world_size=0": (_set(("powersgd", "world_size"), 0), '["powersgd"]["world_size"]'),
    "powersgd.world_size vs error_per_rank": (_set(("powersgd", "world_size"), 3), '["powersgd"]["error_per_rank"]'),
    "hybrid.sizes=[0, 4]": (_set(("hybrid", "sizes"), [0, 4]), '["hybrid"]["sizes"]'),
    "hybrid.microbatches='2'": (_set(("hybrid", "microbatches"), "2"), '["hybrid"]["microbatches"]'),
}  # fmt: skip


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
