"""Measure on this machine what a compression hook computes (torch imported when called).

The replay model needs the compute that fp16/bf16 and PowerSGD add (see
:mod:`~lightning_mgpu.whatif.compression`): measured here with the same tensor operations as
torch's hooks, on the gradients' own shapes, with the thread count a training rank uses. Run
it on the profiled machine (``lightning-mgpu whatif`` does, when this machine's device type is
the profile's); the result is a :class:`~lightning_mgpu.whatif.compression.CompressionCosts`
that can be saved (``as_dict``) and reused.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lightning_mgpu._sizes import MiB as MIB
from lightning_mgpu.whatif.compression import CompressionCosts, powersgd_matrices
from lightning_mgpu.whatif.records import Gradient

if TYPE_CHECKING:
    import torch

PROBE_MIB = 8
"""Size of the buffer the per-MiB rates are measured on."""


def _time_ms(run: Callable[[], object], *, repeats: int, sync: Callable[[], None]) -> float:
    run()  # warm-up: allocation, kernels
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return float(statistics.median(samples))


def _orthogonalize(matrix: torch.Tensor) -> None:
    """Gram-Schmidt on the columns, in place (what torch's PowerSGD does for small ranks)."""
    for i in range(matrix.shape[-1]):
        column = matrix[..., i : i + 1]
        column.div_(column.norm(dim=-2, keepdim=True) + 1e-8)
        if i + 1 < matrix.shape[-1]:
            rest = matrix[..., i + 1 :]
            rest.sub_((column * rest).sum(dim=-2, keepdim=True) * column)


def _matrix_phases(
    n: int, m: int, r: int, *, device: torch.device, repeats: int, sync: Callable[[], None]
) -> tuple[float, float, float]:
    """ms of PowerSGD's three compute phases on one ``n x m`` gradient at rank ``r``."""
    import torch

    grad = torch.randn(1, n, m, device=device)
    p = torch.empty(1, n, r, device=device)
    q = torch.randn(1, m, r, device=device)

    def compress_p() -> None:  # autograd thread: orthogonalise the warm-started Q, P = M Q
        _orthogonalize(q)
        torch.bmm(grad, q, out=p)

    def compress_q() -> None:  # after P's all-reduce: orthogonalise P, Q = M^T P
        _orthogonalize(p)
        torch.bmm(grad.transpose(1, 2), p, out=q)

    def decompress() -> None:  # after Q's all-reduce: M = P Q^T
        torch.bmm(p, q.transpose(1, 2), out=grad)

    first, second, third = (_time_ms(f, repeats=repeats, sync=sync) for f in (compress_p, compress_q, decompress))
    return (first, second, third)


def measure_gloo_allreduce(
    dtypes: Sequence[str] = ("float32", "float16", "bfloat16"), *, mib: int = PROBE_MIB, repeats: int = 3
) -> dict[str, float]:
    """ms per MiB on the wire of a 2-rank gloo all-reduce on this machine's loopback, per dtype.

    Two ranks in this process (two threads, each with its own ``ProcessGroupGloo`` on an
    in-memory store): gloo's own TCP transport and reduction, without starting a process.
    On CPU gloo sums float16 element by element through float conversions, slower per byte
    than float32: the replay model adds the difference to fp16/bf16 buckets.
    """
    import torch.distributed as dist

    store = dist.HashStore()
    return {name: _gloo_ms(store, name, mib=mib, repeats=repeats) / mib for name in dtypes}


def measure_gloo_latency(*, nbytes: int = 4096, repeats: int = 20) -> float:
    """ms of one 2-rank gloo all-reduce of ``nbytes`` float32 on this machine's loopback: the fixed
    cost of an all-reduce on this host, whatever its size (two ranks on threads, as
    :func:`measure_gloo_allreduce`)."""
    import torch.distributed as dist

    return _gloo_ms(dist.HashStore(), "float32", mib=nbytes / MIB, repeats=repeats)


def _gloo_ms(store: Any, name: str, *, mib: float, repeats: int) -> float:
    """The slower rank's median ms for one 2-rank all-reduce of ``mib`` MiB of ``name`` elements."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dtype = getattr(torch, name)
    elements = max(1, int(mib * MIB) // torch.tensor([], dtype=dtype).element_size())
    times: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            prefixed = dist.PrefixStore(f"whatif-{name}", store)
            group: Any = dist.ProcessGroupGloo(prefixed, index, 2, timedelta(seconds=60))
            buffer = torch.ones(elements, dtype=dtype)
            # the warm-up also opens the connections
            times[index] = _time_ms(lambda: group.allreduce([buffer]).wait(), repeats=repeats, sync=lambda: None)
        except BaseException as error:  # reported below, in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors or len(times) != 2:
        raise RuntimeError(f"measuring gloo's {name} all-reduce failed: {errors[0] if errors else 'timed out'}")
    return max(times.values())


def measure_costs(
    gradients: Sequence[Gradient],
    *,
    powersgd_ranks: Sequence[int] = (1, 4),
    device: str = "cpu",
    threads: Optional[int] = None,
    repeats: int = 5,
    world_size: int = 2,
    gloo_dtypes: bool = True,
) -> CompressionCosts:
    """Time the compression work for these gradients' shapes at each PowerSGD rank.

    ``threads``: torch's intra-op threads while measuring (a training rank's
    ``OMP_NUM_THREADS``); restored afterwards. Medians of ``repeats`` runs after one warm-up.
    On CPU also gloo's all-reduce per dtype (:func:`measure_gloo_allreduce`; ``gloo_dtypes=False``: not).
    """
    import torch

    dev = torch.device(device)
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        elements = PROBE_MIB * MIB // 4
        bucket = torch.randn(elements, device=dev)
        error = torch.randn(elements, device=dev)
        half = bucket.to(torch.float16)
        holder: dict[str, torch.Tensor] = {}

        def cast() -> None:
            holder["h"] = bucket.to(torch.float16).div_(world_size)

        def feedback_pre() -> None:
            bucket.add_(error)
            holder["copy"] = bucket.detach().clone()

        def feedback_post() -> None:
            holder["error"] = holder["copy"] - bucket

        cast_ms = _time_ms(cast, repeats=repeats, sync=sync) / PROBE_MIB
        uncast_ms = _time_ms(lambda: bucket.copy_(half), repeats=repeats, sync=sync) / PROBE_MIB
        pre_ms = _time_ms(feedback_pre, repeats=repeats, sync=sync) / PROBE_MIB
        post_ms = _time_ms(feedback_post, repeats=repeats, sync=sync) / PROBE_MIB

        matrices: dict[str, tuple[float, float, float]] = {}
        flops = seconds = 0.0
        for rank in powersgd_ranks:
            for n, m, r in powersgd_matrices(gradients, rank):
                key = f"{n},{m},{r}"
                if key in matrices:
                    continue
                phases = _matrix_phases(n, m, r, device=dev, repeats=repeats, sync=sync)
                matrices[key] = (phases[0], phases[1], phases[2])
                flops += 6.0 * n * m * r
                seconds += sum(phases) / 1e3
        gflops = flops / seconds / 1e9 if seconds > 0 else 0.0
        on_gloo = dev.type == "cpu" and gloo_dtypes
        gloo = measure_gloo_allreduce(repeats=max(1, repeats // 2 + 1)) if on_gloo else {}
        gloo_latency = measure_gloo_latency(repeats=4 * repeats) if on_gloo else 0.0
    finally:
        torch.set_num_threads(previous_threads)
    return CompressionCosts(
        cast_ms_per_mib=cast_ms,
        uncast_ms_per_mib=uncast_ms,
        feedback_pre_ms_per_mib=pre_ms,
        feedback_post_ms_per_mib=post_ms,
        matrices=matrices,
        gflops=gflops,
        gloo_ms_per_mib=gloo,
        allreduce_overhead_ms=gloo_latency,
        device_type=dev.type,
        threads=threads if threads is not None else previous_threads,
        source=f"measured on this machine ({dev.type}, {threads or previous_threads} thread(s), median of {repeats})",
    )


__all__ = ["PROBE_MIB", "measure_costs", "measure_gloo_allreduce", "measure_gloo_latency"]
