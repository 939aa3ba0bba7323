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

import math
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
FP16_HEADROOM_BITS = 4
"""With a scale carried over from the bucket's previous step (CPU), its estimated peak is mapped to
2**(15 - 4): the gradients may grow about 16-fold (more with fewer ranks) before the all-reduce
could overflow; beyond that the bucket is summed again in float32 (never an inf)."""
_SCALE_EXPONENT_LIMIT = 100  # |exponent| at most this: a scale float32 holds (2**±100), 0 and inf peaks included
_FP16_MAX = 65504.0
_FP16_TINY = 2.0**-24  # float16's smallest subnormal
_FP32_SAFE = 2.0**100  # a scaled gradient beyond this is not scaled (float32 ends near 2**128)
_FP16_LEAST_PEAK = 2.0  # a carried scale that leaves the bucket's peak below this (gradients shrank ~1000-fold since
# the scale was set, so the small ones underflowed) is redone in float32


class ScaledFp16Allreduce:
    """``compression="fp16"``: gradients all-reduced in float16 without overflow, and no silent NaN.

    For each bucket, every rank multiplies the bucket by the same power of two, ``scale``,
    divides by the world size, casts to float16 and sums; the sum, back in the bucket's dtype,
    divided by ``scale`` is the average. ``scale`` is chosen so that no partial sum of the
    all-reduce can reach float16's 65504 and small gradients are lifted away from float16's
    underflow (~6e-8) as far as the bucket's largest one allows. Where ``scale`` comes from:

    * **Exchanged** (CUDA buffers; on CPU, a bucket's first step and the step after a fallback):
      the largest magnitude of the bucket, all-reduced with ``MAX`` (one scalar), mapped to at
      most 2**15 (:data:`FP16_PEAK_EXPONENT`). On NCCL that scalar is enqueued on the stream
      (no host wait). On gloo the hook would have to wait for it, and the scalar queues behind
      the previous bucket's transfer, so the backward stalls for a whole bucket on a slow link.
    * **Carried over** (CPU buffers, every other step): no exchange. Each rank appends one
      element to the float16 bucket, its own peak times ``scale / 2**15``; the all-reduce sums
      it, so every rank learns ``R``, the sum of the ranks' peaks in those units. ``R`` bounds
      every partial sum of the step (by ``R * 2**15 / n``): when that is below float16's range
      the result is used, and the next step's ``scale`` maps ``R``'s peak to 2**(15 - 4)
      (:data:`FP16_HEADROOM_BITS`). Otherwise (since the last step the gradients grew about
      16-fold or shrank about 1000-fold, or they hold inf/NaN) the float16 result is dropped and the bucket is summed again **in float32** once
      the backward is done (its scaled values are still in the bucket), and the next step
      exchanges its scale again. ``R`` comes from an all-reduce, so every rank takes the same
      branch and keeps its collectives in lockstep.

    A non-finite peak means the gradients themselves hold inf or NaN (the model's, not the
    compression's): they reach the parameters as they would uncompressed, and :meth:`end_step`
    reports it (never silently). Values still below float16's smallest subnormal after scaling
    (smaller than the bucket's peak by about 2**39, or 2**35 divided by the world size with a
    carried-over scale) become 0: every ``underflow_every``-th step counts them (:attr:`stats`;
    a count costs two passes over the bucket, hence the sampling).

    Cost over torch's ``fp16_compress_hook``: a min/max pass over the bucket, and on a bucket's
    exchanged steps one scalar all-reduce; ``bench/fp16_safety.py`` measures it against the
    alternatives, ``bench/netlab.py --sweep`` over real links.

    The instance itself is the hook (``register_comm_hook(state=None, hook=instance)``); the
    strategy calls :meth:`end_step` after each optimizer step. The float32 fallback runs in
    an autograd callback after DDP's own, so a hook called outside a backward (a test calling
    it directly) always exchanges its scale.
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
        """The largest gradient magnitude of the last step, over all ranks and buckets (exact where the scale was
        exchanged; with a carried-over scale an upper bound, at most the world size times it)."""
        self.exchanged_buckets = 0
        """Buckets whose scale was exchanged with a blocking all-reduce (CPU: first steps and after fallbacks)."""
        self.fallbacks = 0
        """Buckets summed again in float32 because float16 could have overflowed (or held inf/NaN)."""
        self._underflow_warnings = 0
        self._peaks: list[torch.Tensor] = []
        self._lost: list[torch.Tensor] = []
        self._nonzero: list[torch.Tensor] = []
        # A bucket (its size and its parameters' ids, in any order: DDP re-orders them when it rebuilds its buckets) -> next
        # step's exponent. Not keyed by the bucket's index:
        # in a static graph's first backward (DDP delays every bucket to its end) torch gives every bucket index 0,
        # and the buckets' completions, in whatever order gloo ran them, would overwrite one another differently on
        # each rank: one rank would then carry a scale where another exchanges one (a collective mismatch).
        self._exponents: dict[tuple[int, tuple[int, ...]], float] = {}
        self._redo: list[tuple[list[torch.Tensor], float]] = []  # (parameters, this rank's divisor)
        # The group of the backward that may redo buckets: set and cleared on the backward's thread. Never captured by
        # a bucket's callback: gloo frees the callback on its own worker thread, and were it the group's last
        # reference (destroy_process_group() right after a step), the group would join that thread from inside it
        # ("Resource deadlock avoided", abort).
        self._redo_group: Any = None

    @property
    def counting_underflow(self) -> bool:
        """True during a step whose underflow is counted (the first one, then every ``underflow_every``-th)."""
        return self.steps % self.underflow_every == 0

    @property
    def stats(self) -> dict[str, Any]:
        """Plain numbers: ``steps`` seen, ``nonfinite_steps`` (a gradient was inf/NaN), the last step's
        ``peak`` magnitude, ``underflowed`` of ``nonzero_checked`` elements over ``underflow_checks`` steps,
        ``exchanged_buckets`` (scales exchanged with a blocking all-reduce) and ``fallbacks`` (buckets
        summed again in float32)."""
        return {
            "steps": self.steps,
            "nonfinite_steps": self.nonfinite_steps,
            "peak": self.peak,
            "underflow_checks": self.underflow_checks,
            "underflowed": self.underflowed,
            "nonzero_checked": self.nonzero_checked,
            "exchanged_buckets": self.exchanged_buckets,
            "fallbacks": self.fallbacks,
        }

    def __call__(
        self, process_group: Optional[dist.ProcessGroup], bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
        buffer = bucket.buffer()
        if buffer.numel() == 0:  # nothing to scale (every rank's bucket holds the same parameters)
            return default_hooks.allreduce_hook(cast(dist.ProcessGroup, group), bucket)
        if buffer.is_cuda:
            return self._exchanged(group, world_size, bucket)
        return self._carried(group, world_size, bucket)

    def _exchanged(self, group: Any, world_size: int, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The scale from the bucket's peak all-reduced with MAX: no host wait on NCCL.

        Few kernels per bucket (on a GPU each launch costs host time on the autograd thread): one pass for the
        peak (the largest magnitude; NaN if any element is NaN), eight tiny ones for the scale and the factor,
        one pass that scales and casts, and on the way back one that widens and divides (11 launches and three
        passes over the bucket; before: 17 and five). The bucket is left as it is until the result overwrites it."""
        buffer = bucket.buffer().detach()
        peak = torch.linalg.vector_norm(buffer, ord=math.inf).reshape(1).to(torch.float32)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)  # the same peak, hence scale, on every rank
        # 2**(15 - ceil(log2 peak)), the exponent within +-100; an inf/NaN peak (the gradients' own) gives scale 1,
        # sending them as they are; a zero peak (log2 = -inf) the largest scale.
        log2 = torch.log2(peak).nan_to_num_(nan=FP16_PEAK_EXPONENT, posinf=FP16_PEAK_EXPONENT)
        scale = log2.ceil_().neg_().add_(FP16_PEAK_EXPONENT).clamp_(-_SCALE_EXPONENT_LIMIT, _SCALE_EXPONENT_LIMIT)
        scale = scale.exp2_()
        self._peaks.append(peak)
        self.exchanged_buckets += 1
        compressed = self._compress(buffer, scale / world_size)
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = bucket.buffer()
            torch.div(fut.value()[0], scale, out=out)  # one pass: float16 widened exactly, divided by a power of 2
            return out

        result: torch.futures.Future[torch.Tensor] = future.then(decompress)
        return result

    def _carried(self, group: Any, world_size: int, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """CPU: the scale carried over from the bucket's last step when it can be, checked by the all-reduce itself."""
        buffer = bucket.buffer()
        numel = buffer.numel()
        members = bucket.parameters()
        key = (
            numel,
            tuple(sorted(id(p) for p in members)),
        )  # ints only: the callback must hold no tensor of the bucket
        low, high = torch.aminmax(buffer.detach())
        local_peak = max(abs(float(low)), abs(float(high)))  # a CPU tensor: nothing to wait for (NaN stays NaN)
        known = self._exponents.pop(key, None)
        carried = known is not None and self._queue_fallback()
        exact_peak = math.nan
        if carried:
            exponent: Optional[float] = known
        else:
            peak = torch.tensor([local_peak], dtype=torch.float32)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)  # gloo: waits for the transfers queued before it
            self.exchanged_buckets += 1
            exact_peak = float(peak)
            exponent = float(_exponent_for(exact_peak, FP16_PEAK_EXPONENT)) if math.isfinite(exact_peak) else None
        scale = 1.0 if exponent is None else 2.0**exponent  # a non-finite peak: sent as it is, and said
        factor = scale / world_size
        compressed = torch.empty(numel + 1, dtype=torch.float16)
        # The bucket is scaled in place unless a carried scale would take it near float32's own limit (gradients
        # that jumped by ~2**100): then this rank sends zeros and an inf share, every rank falls back, and the
        # fallback starts from what each rank's bucket holds (scaled or not: its own divisor undoes it).
        in_place = not carried or local_peak * factor < _FP32_SAFE
        if in_place:
            self._compress(buffer, factor, into=compressed[:numel])
        else:
            compressed[:numel].zero_()
        # This rank's peak in units of 2**15 / scale (inf beyond float16: a fallback; a nonzero peak counts at least
        # float16's smallest value, so that a sum of 0 means every gradient of the bucket was 0 on every rank).
        share = local_peak * scale / 2**FP16_PEAK_EXPONENT if in_place else math.inf
        compressed[numel] = 0.0 if local_peak == 0 else max(share, _FP16_TINY) if math.isfinite(share) else share
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()
        parameters = members if carried else []
        if carried:
            self._redo_group = group  # for _finish_backward, queued above: it runs on this thread and clears it
        divisor = scale if in_place else float(world_size)  # what turns this rank's bucket back into g / n

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = bucket.buffer()
            result = fut.value()[0]
            total = float(result[numel])  # sum over ranks of peak * scale / 2**15: the same on every rank
            if total == 0.0:  # every gradient 0 on every rank: exact, and the scale is kept
                self._exponents[key] = min(0.0 if exponent is None else exponent, FP16_PEAK_EXPONENT)
                self._peaks.append(torch.zeros(1))
                return out.zero_()
            largest = total * 2**FP16_PEAK_EXPONENT  # bounds every rank's largest scaled gradient, and their sum
            fits = math.isfinite(total) and largest / world_size < 0.95 * _FP16_MAX and largest >= _FP16_LEAST_PEAK
            if carried and not fits:  # float16 could have overflowed, or lost the small values: redo in float32
                self._redo.append((parameters, divisor))
                return out
            out.copy_(result[:numel])
            out.div_(scale)
            bound = largest / scale  # >= the largest gradient magnitude of any rank
            self._peaks.append(torch.tensor([bound if carried else exact_peak]))
            if math.isfinite(bound) and bound > 0:
                self._exponents[key] = float(_exponent_for(bound, FP16_PEAK_EXPONENT - FP16_HEADROOM_BITS))
            return out

        result: torch.futures.Future[torch.Tensor] = future.then(decompress)
        return result

    def _compress(self, buffer: torch.Tensor, factor: Any, *, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``buffer * factor`` in float16, counting the elements lost to underflow on a counted step. With ``into``
        (the carried path, CPU): the bucket is scaled in place, then cast into ``into``; otherwise (the exchanged path,
        GPUs) one pass computes the product in float32 and stores it as float16, the bucket left as it is."""
        nonzero = torch.count_nonzero(buffer) if self.counting_underflow else None
        if into is not None:
            # A same-dtype multiply then a cast is ~4x faster on CPU than one multiply writing float16
            # (torch.mul(..., out=half) takes an unvectorised casting path), and rounds the same.
            compressed = into.copy_(buffer.mul_(factor))
        else:
            compressed = torch.empty_like(buffer, dtype=torch.float16)
            torch.mul(buffer, factor, out=compressed)
        if nonzero is not None:
            self._nonzero.append(nonzero)
            self._lost.append(nonzero - torch.count_nonzero(compressed))
        return compressed

    def _queue_fallback(self) -> bool:
        """Make the float32 fallback run at the end of this backward, after DDP's own end of backward (which DDP
        queues after the last bucket's hook); False outside a backward. Queued by every carried bucket: the
        first run does the work, the others find nothing left."""
        try:
            queue_autograd_callback(self._after_hooks)
        except RuntimeError:  # not inside a backward: no carried-over scale
            return False
        return True

    def _after_hooks(self) -> None:
        # Queued before DDP queued its end of backward; queued from here, the fallback runs after it,
        # once every gradient is written.
        queue_autograd_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """Sum in float32 the buckets whose float16 sum could have overflowed (same buckets, same order, every rank)."""
        redo, self._redo = self._redo, []
        group, self._redo_group = self._redo_group, None
        for parameters, divisor in redo:
            grads = [p.grad for p in parameters if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(divisor)  # this rank's g / n, exactly (powers of 2)
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            peak = float(flat.abs().max()) if flat.numel() else 0.0
            self._peaks.append(torch.tensor([peak]))
            self.fallbacks += 1

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
        finite = bool(torch.isfinite(peaks).all())
        self.peak = float(peaks.max()) if finite else float("nan")
        if counted:
            self.underflow_checks += 1
            self.underflowed += lost
            self.nonzero_checked += nonzero
        if not finite:
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


def _exponent_for(peak: float, target: int) -> int:
    """The power of two that maps ``peak`` to at most ``2**target`` (bounded, for 0 and tiny peaks)."""
    if peak <= 0:
        return _SCALE_EXPONENT_LIMIT
    return max(-_SCALE_EXPONENT_LIMIT, min(_SCALE_EXPONENT_LIMIT, target - math.ceil(math.log2(peak))))


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
            queue_autograd_callback(self._after_graph)
            return grad / self.world_size

        loss.register_hook(scale_root)  # type: ignore[no-untyped-call]

    def _after_graph(self) -> None:
        # Runs once autograd has finished the graph, but before the end-of-backward callbacks DDP
        # queued during it: with static_graph=True, a wrapper's first backward launches every bucket
        # from such a callback (DDP delays its reduction to find the graph). Queued from here, the
        # flag is cleared after them, so those buckets are not divided a second time.
        queue_autograd_callback(self._end_of_backward)

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
