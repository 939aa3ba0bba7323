"""lightning_mgpu: multi-GPU training for PyTorch Lightning that is fast, visible and hard to get wrong.

Importing the package registers its strategy names with Lightning, so that
``Trainer(strategy="ddp_tuned")`` works once ``import lightning_mgpu`` has run.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mgpu.callbacks import CommProfiler, DistributedDoctor, DistributedDoctorError
from lightning_mgpu.strategies import BucketInfo, HybridParallelStrategy, TunedDDPStrategy

__version__ = "0.1.0"

STRATEGY_NAMES = ("ddp_tuned", "ddp_tuned_spawn", "ddp_tuned_fp16", "ddp_tuned_powersgd", "hybrid")

TunedDDPStrategy.register_strategies(StrategyRegistry)
HybridParallelStrategy.register_strategies(StrategyRegistry)

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
