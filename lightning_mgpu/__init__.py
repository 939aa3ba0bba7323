"""lightning_mgpu: multi-GPU training for PyTorch Lightning that is fast, visible and hard to get wrong.

Importing the package registers its strategy names with Lightning, so that
``Trainer(strategy="ddp_tuned")`` works once ``import lightning_mgpu`` has run.

The package itself imports neither torch nor Lightning, so that the ``lightning-mgpu``
command starts at once: the public classes below load on first use, and the names are
registered as soon as Lightning is loaded (at once when it already is; see
:mod:`lightning_mgpu._registration`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_mgpu import _registration
from lightning_mgpu._version import __version__

# Every name registered, in registration order (strategies/parts/options.py: TUNED_STRATEGY_NAMES, then hybrid);
# written out so that reading it imports no torch. tests/unit/strategies/test_lightning_parity.py keeps it equal to
# the registry.
STRATEGY_NAMES = (
    "ddp_tuned",
    "ddp_tuned_spawn",
    "ddp_tuned_fork",
    "ddp_tuned_notebook",
    "ddp_tuned_find_unused_parameters_false",
    "ddp_tuned_find_unused_parameters_true",
    "ddp_tuned_spawn_find_unused_parameters_false",
    "ddp_tuned_spawn_find_unused_parameters_true",
    "ddp_tuned_fork_find_unused_parameters_false",
    "ddp_tuned_fork_find_unused_parameters_true",
    "ddp_tuned_notebook_find_unused_parameters_false",
    "ddp_tuned_notebook_find_unused_parameters_true",
    "ddp_tuned_fp16",
    "ddp_tuned_bf16",
    "ddp_tuned_powersgd",
    "ddp_tuned_auto",
    "hybrid",
)

# Public name -> the module that defines it, imported on first access.
_PUBLIC = {
    "BucketInfo": "lightning_mgpu.strategies",
    "HybridParallelStrategy": "lightning_mgpu.strategies",
    "TunedDDPStrategy": "lightning_mgpu.strategies",
    "CommProfiler": "lightning_mgpu.callbacks",
    "DistributedDoctor": "lightning_mgpu.callbacks",
    "DistributedDoctorError": "lightning_mgpu.callbacks",
}
# Importing the package used to load these; `lightning_mgpu.strategies.X` keeps working without an import.
_SUBPACKAGES = ("callbacks", "comm", "placement", "strategies", "tuning")

if TYPE_CHECKING:
    from lightning_mgpu.callbacks import CommProfiler, DistributedDoctor, DistributedDoctorError
    from lightning_mgpu.strategies import BucketInfo, HybridParallelStrategy, TunedDDPStrategy


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [
    "BucketInfo",
    "CommProfiler",
    "DistributedDoctor",
    "DistributedDoctorError",
    "HybridParallelStrategy",
    "STRATEGY_NAMES",
    "TunedDDPStrategy",
    "__version__",
]

_registration.install()
