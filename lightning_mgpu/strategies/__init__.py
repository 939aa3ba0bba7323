"""Strategies for ``Trainer(strategy=...)``, one per file."""

from lightning_mgpu.strategies.hybrid import HybridParallelStrategy
from lightning_mgpu.strategies.tuned_ddp import BucketInfo, TunedDDPStrategy

__all__ = ["BucketInfo", "HybridParallelStrategy", "TunedDDPStrategy"]
