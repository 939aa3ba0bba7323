"""Callbacks: CommProfiler (communication timing)."""

from lightning_mgpu.callbacks.comm_profiler import CommProfiler

__all__ = ["CommProfiler"]
