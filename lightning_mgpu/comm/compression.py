"""Gradient-compression communication hooks for DDP, on every backend.

torch ships the hooks (``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``);
this module only picks the right one for the process group in use and fills the one gap:
torch's bf16 hook refuses any backend but NCCL, although gloo (torch >= 2.13) sums
bfloat16 tensors. :func:`bf16_allreduce_hook` below is that missing path.

No ``from __future__ import annotations`` here: DDP checks a hook's annotations at
registration and rejects them as strings; it also refuses any hook *named*
``bf16_compress_hook`` without NCCL, hence the other name.
"""


from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

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
        return CommHookSpec(default_hooks.fp16_compress_hook, None, torch.float16)
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
