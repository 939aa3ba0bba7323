"""Communication hooks (compression) and, later, timing and bandwidth formulas."""

from lightning_mgpu.comm.compression import COMPRESSIONS, bf16_allreduce_hook, resolve_compression

__all__ = ["COMPRESSIONS", "bf16_allreduce_hook", "resolve_compression"]
