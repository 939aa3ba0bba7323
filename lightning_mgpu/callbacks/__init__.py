"""Callbacks: CommProfiler (communication timing), DistributedDoctor (checks for multi-GPU mistakes)."""

from lightning_mgpu.callbacks.comm_profiler import CommProfiler
from lightning_mgpu.callbacks.doctor import DistributedDoctor, DistributedDoctorError, DistributedDoctorWarning

__all__ = ["CommProfiler", "DistributedDoctor", "DistributedDoctorError", "DistributedDoctorWarning"]
