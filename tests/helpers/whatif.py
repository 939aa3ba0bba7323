"""Profiles the whatif tests share: the 8M MLP of bench/models.py as comm_profile.json describes it.

Used by tests/unit/whatif/test_whatif.py, tests/unit/cli/test_whatif_cli.py and
tests/unit/callbacks/comm_profiler/test_comm_profiler_whatif.py.
"""

from __future__ import annotations

import math
from typing import Any

# The 8M MLP of bench/models.py in DDP's order (last layer first), as DDP bucketed it by default.
MLP_BUCKETS = [
    [[256], [256, 1024]],
    [[1024], [1024, 2048], [2048], [2048, 2048], [2048], [2048, 1024]],
]


def nbytes(shapes: list[list[int]]) -> int:
    return sum(math.prod(s) * 4 for s in shapes)


def mlp_profile(
    *, world_size: int = 2, params: bool = True, launches: tuple[float, float] = (3.0, 25.0)
) -> dict[str, Any]:
    """A 55 ms step: forward 10, backward compute 25, exposed 8, optimizer 8 (other: 4)."""
    buckets = []
    done = (4.0, 33.0)
    for index, shapes in enumerate(MLP_BUCKETS):
        bucket: dict[str, Any] = {
            "index": index,
            "bytes": nbytes(shapes),
            "num_params": len(shapes),
            "launch_ms": launches[index],
            "done_ms": done[index],
            "duration_ms": done[index] - launches[index],
        }
        if params:
            bucket["params"] = [{"shape": s, "dtype": "float32"} for s in shapes]
        buckets.append(bucket)
    return {
        "world_size": world_size,
        "backend": "gloo",
        "device_type": "cpu",
        "summary": {
            "steps": 20,
            "step_ms": {"median": 55.0, "p90": 60.0},
            "forward_ms": 10.0,
            "backward_compute_ms": 25.0,
            "comm_ms": 30.0,
            "exposed_comm_ms": 8.0,
            "optimizer_ms": 8.0,
            "compression_ratio": 1.0,
        },
        "buckets": buckets,
        "steps": [],
    }
