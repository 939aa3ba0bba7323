"""Gradient-bucket arithmetic, in one place: sizes, DDP's defaults, the first-bucket rule, the byte
limits DDP fills buckets up to, how it assigns gradients to them, and the keyword arguments that ask
``DistributedDataParallel`` for a layout.

The strategies (what DDP is given), the bucket tuner (which sizes give distinct layouts) and the
what-if model (a layout replayed on another system) all use these functions, so a size means the
same everywhere. Pure Python: no torch import (the one fact about the installed torch, whether DDP
takes a per-bucket list of caps, is an argument).

The rule: bucket 0 is filled up to the *first* cap (DDP's 1 MiB: the last layers' gradients, ready
first, so communication starts early), every later bucket up to ``bucket_cap_mb``; a bucket is
closed as soon as it holds at least its cap. torch keeps the small first bucket only while
``bucket_cap_mb`` is left at its default; asking for ``bucket_cap_mb_list=[first, cap]`` keeps it
whatever the size (torch >= 2.13).
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Optional, Sequence

from lightning_mgpu._sizes import MiB as MIB

DDP_DEFAULT_BUCKET_CAP_MB = 25.0
"""torch's default bucket size, in MiB (``torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB``;
``tests/unit/repo/test_compat.py`` checks the installed torch agrees)."""
DDP_DEFAULT_FIRST_BUCKET_MB = 1.0
"""torch's first-bucket size, in MiB (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``; checked likewise)."""
MAX_SIZE_MB = float(2**40)
"""Largest bucket size accepted, in MiB (1 EiB): DDP counts bucket bytes in 64-bit integers."""
DEFAULT_GRID_MB: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
"""Candidate bucket sizes (MiB) tried by ``bucket_cap_mb="auto"``: a log grid, plus DDP's default."""

__all__ = [
    "DDP_DEFAULT_BUCKET_CAP_MB",
    "DDP_DEFAULT_FIRST_BUCKET_MB",
    "DEFAULT_GRID_MB",
    "MAX_SIZE_MB",
    "MIB",
    "assign_buckets",
    "bucket_limits",
    "cap_bytes",
    "check_size_mb",
    "ddp_bucket_kwargs",
    "first_cap",
]


def check_size_mb(name: str, value: object, *, auto: bool = False) -> Optional[float]:
    """A bucket size argument as a float (None stays None); ``ValueError`` naming ``name`` otherwise."""
    allowed = "a positive number of MiB, 'auto' or None" if auto else "a positive number of MiB or None"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    if not value > MAX_SIZE_MB and (not math.isfinite(value) or value <= 0):  # (a huge int has no float)
        raise ValueError(f"{name} must be {allowed.replace('a positive', 'a positive, finite')}, got {value!r}")
    if value > MAX_SIZE_MB:
        raise ValueError(
            f"{name} must be at most {MAX_SIZE_MB:.0f} MiB (1 EiB; DDP counts bucket bytes in 64-bit integers), "
            f"got {value!r:.40}"
        )
    return float(value)


def cap_bytes(cap_mb: float) -> int:
    """A MiB size as DDP turns it into bytes (``int(cap_mb * 2**20)``, truncating)."""
    return int(cap_mb * MIB)


def first_cap(
    bucket_cap_mb: float,
    *,
    given_cap: Optional[float] = None,
    given_first: Optional[float] = None,
    per_bucket_caps: bool = True,
) -> float:
    """The first bucket's cap (MiB) when later buckets are capped at ``bucket_cap_mb``.

    ``given_cap``/``given_first`` are what the user asked for (None: DDP's defaults); without
    ``per_bucket_caps`` (torch before 2.13) an explicit size applies to every bucket, the first included.
    """
    first = given_first if given_first is not None else DDP_DEFAULT_FIRST_BUCKET_MB
    if not per_bucket_caps and not (given_cap is None and given_first is None):
        return bucket_cap_mb
    return min(first, bucket_cap_mb)


def bucket_limits(first_cap_mb: float, cap_mb: float) -> list[int]:
    """The per-bucket byte limits DDP uses with ``bucket_cap_mb_list=[first_cap_mb, cap_mb]``."""
    return [cap_bytes(first_cap_mb), cap_bytes(cap_mb)]


def ddp_bucket_kwargs(*, cap: Optional[float], given_first: Optional[float], per_bucket_caps: bool) -> dict[str, Any]:
    """``DistributedDataParallel`` keyword arguments for these caps (``{}``: DDP's own default).

    Without ``per_bucket_caps`` the one ``bucket_cap_mb`` DDP takes applies to every bucket (the caller says so).
    """
    if cap is None and given_first is None:
        return {}  # DDP's own default: 1 MiB first bucket, then 25 MiB (also "auto" before it decides)
    in_force = cap if cap is not None else DDP_DEFAULT_BUCKET_CAP_MB
    if not per_bucket_caps:
        return {"bucket_cap_mb": in_force}
    first = first_cap(in_force, given_cap=cap, given_first=given_first)
    return {"bucket_cap_mb_list": [first, in_force]}  # bucket 0 up to the first cap, every later one to the last


def assign_buckets(
    sizes: Sequence[int], limits: Sequence[int], keys: Optional[Sequence[Hashable]] = None
) -> list[list[int]]:
    """DDP's greedy bucket assignment, in plain Python.

    Args:
        sizes: bytes of each gradient, in the order DDP walks them (the ready order).
        limits: byte limit of bucket 0, 1, ...; the last one applies to every later bucket.
        keys: one hashable per gradient (dtype and device): gradients of different keys
            never share a bucket. None: all the same.

    Returns:
        Buckets in the order DDP launches them, each a list of positions into ``sizes``.
    """
    if not limits:
        raise ValueError("limits must hold at least one byte limit")
    keys = keys if keys is not None else [None] * len(sizes)
    if len(keys) != len(sizes):
        raise ValueError(f"sizes and keys differ in length ({len(sizes)} and {len(keys)})")
    closed: list[list[int]] = []
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_per_key: dict[Hashable, int] = {}
    for position, (size, key) in enumerate(zip(sizes, keys)):
        open_buckets.setdefault(key, []).append(position)
        open_bytes[key] = open_bytes.get(key, 0) + size
        done = closed_per_key.get(key, 0)
        if open_bytes[key] >= limits[min(done, len(limits) - 1)]:
            closed.append(open_buckets.pop(key))
            open_bytes[key] = 0
            closed_per_key[key] = done + 1
    closed.extend(bucket for bucket in open_buckets.values() if bucket)
    return closed
