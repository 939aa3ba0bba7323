"""Gradient-compression communication hooks for DDP, on every backend.

torch ships the hooks (``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``);
this module picks the right one for the process group in use and fills two gaps:

* torch's bf16 hook refuses any backend but NCCL, although gloo (torch >= 2.13) sums
  bfloat16 tensors. :func:`bf16_allreduce_hook` below is that missing path.
* torch's fp16 hook casts to float16 *before* dividing by the world size: a gradient above
  65504 becomes inf (then NaN parameters, silently), one below ~6e-8 becomes 0 (training
  stalls, silently). :class:`ScaledFp16Allreduce` (``compression="fp16"``) scales every
  bucket by a power of two chosen from the largest gradient magnitude over all ranks, so
  that nothing overflows, the whole float16 range is used, and the rare values still too
  small to represent are counted (:attr:`ScaledFp16Allreduce.stats`).

bfloat16 has float32's exponent range: casting cannot overflow, and it underflows only
where float32 itself does (below ~1e-38). It loses precision (8 significant bits), not
range, so ``compression="bf16"`` needs no such guard.

No ``from __future__ import annotations`` here: DDP checks a hook's annotations at
registration and rejects them as strings; it also refuses any hook *named*
``bf16_compress_hook`` without NCCL, hence the other name.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, cast

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lightning_mgpu._compat.torch import queue_autograd_callback

COMPRESSIONS = (None, "fp16", "bf16", "powersgd")

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def bf16_allreduce_hook(
    process_group: Optional[dist.ProcessGroup], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket in bfloat16 on any backend that sums bfloat16.

    Same contract as torch's ``bf16_compress_hook``: the bucket is divided by the world
    size, cast to bfloat16, summed across ranks and written back in the bucket's dtype.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(world_size)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = bucket.buffer()
        out.copy_(fut.value()[0])
        return out

    result: torch.futures.Future[torch.Tensor] = future.then(decompress)
    return result


FP16_PEAK_EXPONENT = 15
"""The largest gradient magnitude of a bucket, over all ranks, is scaled to at most 2**15 = 32768.

Every partial sum of the all-reduce adds terms ``g_i * scale / n`` of at most ``peak * scale / n``
each, over at most ``n`` ranks: it stays below 2**15 (+ rounding), far from float16's 65504."""
_SCALE_EXPONENT_LIMIT = 100  # |exponent| at most this: a scale float32 holds (2**±100), 0 and inf peaks included


class ScaledFp16Allreduce:
    """``compression="fp16"``: gradients all-reduced in float16 without overflow, and no silent NaN.

    For each bucket, on every rank:

    1. the largest magnitude of the bucket, all-reduced with ``MAX`` (one scalar): every rank gets
       the same value, hence the same scale (their collectives stay in lockstep);
    2. ``scale`` = the power of two that maps that peak to at most 2**15 (:data:`FP16_PEAK_EXPONENT`):
       exact to apply and to undo, no overflow in any partial sum, and small gradients lifted
       away from float16's underflow (~6e-8) by as much as the bucket's largest one allows;
    3. ``bucket * scale / world_size`` cast to float16 (divided *before* the cast) and summed;
       the sum, back in the bucket's dtype, divided by ``scale``: the average.

    A non-finite peak means the gradients themselves hold inf or NaN (the model's, not the
    compression's): the bucket is sent unscaled, so they reach the parameters as they would
    uncompressed, and :meth:`end_step` reports it (never silently). Values still below float16's
    smallest subnormal after scaling (smaller than the bucket's peak by a factor of about 2**39)
    become 0: every ``underflow_every``-th step counts them (:attr:`stats`; a count costs two passes
    over the bucket, hence the sampling).

    Cost over torch's ``fp16_compress_hook``: one scalar all-reduce per bucket (on NCCL enqueued
    on the stream, no host wait; on gloo the hook waits for it) and a min/max pass over the bucket;
    ``bench/fp16_safety.py`` measures it against the alternatives.

    The instance itself is the hook (``register_comm_hook(state=None, hook=instance)``); the
    strategy calls :meth:`end_step` after each optimizer step.
    """

    def __init__(self, *, underflow_every: int = 50) -> None:
        self.__name__ = self.__qualname__ = "fp16_scaled_allreduce"  # DDP logs a hook's name
        self.underflow_every = underflow_every
        self.steps = 0
        self.nonfinite_steps = 0
        self.underflow_checks = 0
        self.underflowed = 0
        """Nonzero gradient elements sent as 0, over the steps that counted them."""
        self.nonzero_checked = 0
        self.peak = 0.0
        """The largest gradient magnitude of the last step, over all ranks and buckets."""
        self._underflow_warnings = 0
        self._peaks: list[torch.Tensor] = []
        self._lost: list[torch.Tensor] = []
        self._nonzero: list[torch.Tensor] = []

    @property
    def counting_underflow(self) -> bool:
        """True during a step whose underflow is counted (the first one, then every ``underflow_every``-th)."""
        return self.steps % self.underflow_every == 0

    @property
    def stats(self) -> dict[str, Any]:
        """Plain numbers: ``steps`` seen, ``nonfinite_steps`` (a gradient was inf/NaN), the last step's
        ``peak`` magnitude, and ``underflowed`` of ``nonzero_checked`` elements over ``underflow_checks`` steps."""
        return {
            "steps": self.steps,
            "nonfinite_steps": self.nonfinite_steps,
            "peak": self.peak,
            "underflow_checks": self.underflow_checks,
            "underflowed": self.underflowed,
            "nonzero_checked": self.nonzero_checked,
        }

    def __call__(
        self, process_group: Optional[dist.ProcessGroup], bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
        buffer = bucket.buffer()
        if buffer.numel() == 0:  # nothing to scale (every rank's bucket holds the same parameters)
            return default_hooks.allreduce_hook(cast(dist.ProcessGroup, group), bucket)
        low, high = torch.aminmax(buffer.detach())
        peak = torch.maximum(low.abs(), high.abs()).reshape(1).to(torch.float32)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)  # the same peak, hence scale, on every rank
        exponent = (FP16_PEAK_EXPONENT - torch.ceil(torch.log2(peak))).clamp(
            -_SCALE_EXPONENT_LIMIT, _SCALE_EXPONENT_LIMIT
        )  # log2(0) = -inf: clamped; a NaN peak stays NaN here and is replaced just below
        scale = torch.where(torch.isfinite(peak), torch.exp2(exponent), torch.ones_like(peak))
        self._peaks.append(peak)
        nonzero = torch.count_nonzero(buffer) if self.counting_underflow else None
        # Divided before the cast, in the bucket's own buffer (the average overwrites it anyway): a
        # same-dtype multiply then a cast is ~4x faster on CPU than one multiply writing float16
        # (torch.mul(..., out=half) takes an unvectorised casting path), and rounds the same.
        compressed = buffer.mul_(scale / world_size).to(torch.float16)
        if nonzero is not None:
            self._nonzero.append(nonzero)
            self._lost.append(nonzero - torch.count_nonzero(compressed))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = bucket.buffer()
            out.copy_(fut.value()[0])
            out.div_(scale.to(out.dtype))
            return out

        result: torch.futures.Future[torch.Tensor] = future.then(decompress)
        return result

    def end_step(self) -> Optional[str]:
        """Close an optimizer step (reads this step's few scalars: one host synchronisation).

        Returns a warning to show when a gradient was inf/NaN this step, or when a counted step lost
        more than 0.1% of its nonzero gradient elements to underflow, at the 1st, 2nd, 4th, 8th, ...
        such step; None otherwise (or when no bucket was reduced). The inf/NaN verdict is the same on
        every rank: it comes from all-reduced values.
        """
        if not self._peaks:
            return None
        peaks = torch.cat(self._peaks)
        counted = bool(self._lost)
        lost = int(torch.stack(self._lost).sum()) if counted else 0
        nonzero = int(torch.stack(self._nonzero).sum()) if counted else 0
        self._peaks, self._lost, self._nonzero = [], [], []
        self.steps += 1
        self.peak = float(peaks.max()) if bool(torch.isfinite(peaks).all()) else float("nan")
        if counted:
            self.underflow_checks += 1
            self.underflowed += lost
            self.nonzero_checked += nonzero
        if not bool(torch.isfinite(peaks).all()):
            self.nonfinite_steps += 1
            if not _is_power_of_two(self.nonfinite_steps):  # said at the 1st, 2nd, 4th, 8th, ... such step
                return None
            bad = int((~torch.isfinite(peaks)).sum())
            return (
                f"compression='fp16': at optimizer step {self.steps}, the gradients of {bad} of {peaks.numel()} "
                f"bucket(s) held inf or NaN before compression (the model's own, not the cast's; "
                f"{self.nonfinite_steps} such step(s) so far). They were sent as they are: the parameters will "
                "hold them unless a GradScaler skips the step."
            )
        if counted and lost > 1e-3 * max(nonzero, 1):
            self._underflow_warnings += 1
            if not _is_power_of_two(self._underflow_warnings):
                return None
            return (
                f"compression='fp16': at optimizer step {self.steps}, {lost} of {nonzero} nonzero gradient elements "
                f"({lost / max(nonzero, 1):.2%}) were below float16's range even after scaling (more than 2**39 "
                "times smaller than their bucket's largest) and were sent as 0. Use compression='bf16' (float32's "
                "range) or None if they matter."
            )
        return None


def _is_power_of_two(count: int) -> bool:
    return count > 0 and count & (count - 1) == 0


@dataclass(frozen=True)
class CommHookSpec:
    """A hook and the state DDP passes to it, ready for ``register_comm_hook``."""

    hook: CommHook
    state: Any
    wire_dtype: Optional[torch.dtype]
    """Element type on the wire, or None when the hook does not simply cast (PowerSGD)."""


def resolve_compression(
    compression: Optional[str],
    *,
    backend: str,
    powersgd_rank: int,
    powersgd_start_iter: int,
) -> Optional[CommHookSpec]:
    """The communication hook for ``compression`` on ``backend`` (None: plain all-reduce)."""
    if compression is None:
        return None
    if compression == "fp16":
        return CommHookSpec(ScaledFp16Allreduce(), None, torch.float16)
    if compression == "bf16":
        hook: CommHook = default_hooks.bf16_compress_hook if backend == "nccl" else bf16_allreduce_hook
        return CommHookSpec(hook, None, torch.bfloat16)
    if compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_iter,
        )
        return CommHookSpec(powerSGD_hook.powerSGD_hook, state, None)
    raise ValueError(f"compression={compression!r} is not one of {COMPRESSIONS}")


class PrescaledAllreduce:
    """DDP's plain averaging all-reduce as a Python hook, without an extra pass over the bucket.

    DDP's built-in all-reduce divides each gradient by the world size while copying it into
    its bucket; a Python hook must divide the bucket itself: one more pass over every
    gradient byte (on CPU, ~3% of an 8M-parameter MLP's step). Here :meth:`prescale` puts
    the 1/n on the loss instead, so autograd produces the gradients already divided and the
    hook only sums. A backward that did not start from a prescaled loss (a raw
    ``loss.backward()``) is detected, and its buckets are divided as usual: the result is
    the average either way.

    The instance itself is the hook (``register_comm_hook(state=None, hook=prescaler)``).
    With gradient accumulation every backward of the window must go through the strategy
    (Lightning's own ``backward`` / ``manual_backward``, which DDP needs anyway).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.__name__ = self.__qualname__ = "averaging_allreduce"  # DDP logs a hook's name
        self._prescaled = False  # True during a backward that started from a prescaled loss
        self.on_done: Optional[Callable[[int], None]] = None
        """Called with the bucket index when its all-reduce completed (before DDP sees it)."""

    def prescale(self, loss: torch.Tensor) -> None:
        if self.world_size == 1 or not loss.requires_grad:
            return

        def scale_root(grad: torch.Tensor) -> torch.Tensor:
            self._prescaled = True
            queue_autograd_callback(self._end_of_backward)
            return grad / self.world_size

        loss.register_hook(scale_root)  # type: ignore[no-untyped-call]

    def _end_of_backward(self) -> None:
        self._prescaled = False

    @contextmanager
    def prescaled_backward(self) -> Iterator[None]:
        """Treat buckets launched inside as coming from a prescaled loss (e.g. a pipeline's stage
        backward run after ``loss.backward()`` of a prescaled loss)."""
        self._prescaled = True
        try:
            yield
        finally:
            self._prescaled = False

    def __call__(
        self, process_group: Optional[dist.ProcessGroup], bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """The DDP communication hook: sum the bucket, dividing it first only if needed."""
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        if not self._prescaled:
            buffer.div_(self.world_size)
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        on_done, index = self.on_done, bucket.index()

        def unwrap(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            if on_done is not None:
                on_done(index)
            return fut.value()[0]

        result: torch.futures.Future[torch.Tensor] = future.then(unwrap)
        return result
