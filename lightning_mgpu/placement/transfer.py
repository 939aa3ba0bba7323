"""Moving a tensor across a stage boundary; on CUDA through a copy stream per destination device."""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["CopyStreams"]


class CopyStreams:
    """Moves boundary tensors between stage devices, keeping one copy stream per CUDA device.

    A copy to a GPU runs on that device's copy stream, so it overlaps with the kernels of
    the stages; the consumer's current stream waits for it, and both tensors are recorded
    on the streams that use them so the caching allocator does not reuse them too early.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def move(self, tensor: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
        """``tensor`` on ``device`` (itself if already there; None stays None)."""
        if tensor is None or tensor.device == device:
            return tensor
        if device.type != "cuda":
            return tensor.to(device)  # device -> host (or cpu -> cpu-like): a plain, synchronous copy
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # untyped in torch
        consumer = torch.cuda.current_stream(device)
        if tensor.is_cuda:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            moved = tensor.to(device, non_blocking=True)
        consumer.wait_stream(stream)
        if tensor.is_cuda:
            tensor.record_stream(stream)
        moved.record_stream(consumer)
        return moved
