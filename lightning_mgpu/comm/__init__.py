"""Communication hooks (compression), bandwidth formulas (nccl-tests' algbw / busbw) and, later, timing."""

from lightning_mgpu.comm.bandwidth import BYTES_PER_GB, COLLECTIVES, algbw_gbps, bus_factor, busbw_gbps
from lightning_mgpu.comm.compression import COMPRESSIONS, bf16_allreduce_hook, resolve_compression

__all__ = [
    "BYTES_PER_GB",
    "COLLECTIVES",
    "COMPRESSIONS",
    "algbw_gbps",
    "bf16_allreduce_hook",
    "bus_factor",
    "busbw_gbps",
    "resolve_compression",
]
