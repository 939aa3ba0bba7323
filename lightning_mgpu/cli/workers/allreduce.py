"""One rank of ``lightning-mgpu doctor``'s all_reduce check.

    python -m lightning_mgpu.cli.workers.allreduce RANK WORLD PORT BACKEND NBYTES TIMEOUT

Started ``WORLD`` times by :mod:`lightning_mgpu.cli._allreduce`.

Rank 0 serves the rendezvous store on 127.0.0.1:PORT, listening there only; every rank
joins a BACKEND process group through it (gloo/NCCL's own sockets kept on the loopback
interface too), all-reduces NBYTES of float32 holding ``rank + 1``, counts the elements that
differ from the exact sum, times five more all-reduces, and prints one JSON line::

    {"rank": int, "wrong": int, "import_s": float, "init_s": float, "allreduce_ms": float}
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any, Optional, Sequence

STARTED = time.perf_counter()  # before torch is imported: import_s says how long that took


def check_and_time(rank: int, world: int, nbytes: int, device: Any, group: Any = None) -> tuple[int, float]:
    """All-reduce ``nbytes`` of float32 holding ``rank + 1`` over ``group`` (None: the default one): the elements
    that differ from the exact sum, and the median of five more all-reduces in milliseconds (``device``
    synchronised around each on CUDA). Every rank of the group calls it."""
    import torch
    import torch.distributed as dist

    x = torch.full((nbytes // 4,), float(rank + 1), device=device)
    dist.all_reduce(x, group=group)
    wrong = int((x != world * (world + 1) / 2).sum().item())
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        dist.all_reduce(x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - begin)
    return wrong, 1e3 * sorted(times)[len(times) // 2]


def run(argv: Sequence[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_mgpu.comm.distributed import LOOPBACK, loopback_store, pin_backend_to_loopback

    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    backend, nbytes, timeout = argv[3], int(argv[4]), timedelta(seconds=float(argv[5]))
    imported = time.perf_counter()
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    pin_backend_to_loopback(backend)
    store = loopback_store(LOOPBACK, port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    joined = time.perf_counter()
    wrong, allreduce_ms = check_and_time(rank, world, nbytes, device)
    dist.destroy_process_group()
    return {
        "rank": rank,
        "wrong": wrong,
        "import_s": imported - STARTED,
        "init_s": joined - imported,
        "allreduce_ms": allreduce_ms,
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    print(json.dumps(run(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
