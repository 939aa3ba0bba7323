"""bench-comm's small-message latency excludes the group's start-up (issue 18 item 4).

The first collectives of a new process group pay one-time costs; they used to land in the first
(smallest) size's times (2,264 us at 1 KiB against 442 us at 4 KiB). Every worker now runs
``SWEEP_WARMUP`` untimed all-reduces of the smallest size before the sweep (none with ``--warmup 0``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_mgpu.comm import allreduce_bench
from lightning_mgpu.comm.allreduce_bench import SWEEP_WARMUP, warm_up_group


def test_the_group_is_warmed_up_untimed_at_the_smallest_size(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(allreduce_bench.dist, "all_reduce", counting)
    warm_up_group(1024, device=torch.device("cpu"))
    assert sizes == [1024] * SWEEP_WARMUP and SWEEP_WARMUP >= 20
