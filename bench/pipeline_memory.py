"""Peak activation memory per pipeline stage, measured: the bytes autograd holds for backward, live, per stage.

What a pipeline schedule changes is how many micro-batches' activations a stage keeps at
once: the tensors autograd saves in the forward for the backward, alive from the forward
until the micro-batch's backward (zero-bubble: its weight pass) frees the graph. On a CPU
there is no per-device allocator to ask (``torch.cuda.max_memory_allocated`` has no CPU
counterpart), the process's RSS mixes both stages (they are threads of one process) and
glibc keeps or returns freed blocks at will, and ``tracemalloc`` sees only Python's own
allocations, not tensors. So :class:`ActivationMeter` counts exactly those tensors:

* a ``torch.autograd.graph.saved_tensors_hooks`` pack hook, active in every thread that
  runs a stage's forward, records each saved tensor's storage (by address, each storage
  once however many saved tensors view it; parameters and the batch left out) against the stage running
  in that thread;
* when the storage itself is freed (autograd released the saved tensor after the backward
  that used it, or with the graph, and nothing else holds it: the staged pipeline's
  ``nn.Linear`` fast path keeps a layer's input until zero-bubble's ``W``), a finaliser on it
  takes its bytes off the stage's live count;
* each stage's peak of live bytes is the figure reported.

It measures real tensors over a real step of each engine (ours and torch's pipelining),
not an estimate; it leaves out the transient buffers of a single operation, gradients in
flight, and the engines' own bookkeeping (a few tensors per micro-batch at the cut, which
the next stage's first operation saves anyway). Measuring adds a Python call per saved
tensor, so it runs in its own, untimed step.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["ActivationMeter", "Metered"]


class ActivationMeter:
    """Live and peak bytes of saved activations for ``num_stages`` stages (see the module docstring)."""

    def __init__(self, num_stages: int, not_activations: Iterable[torch.Tensor]) -> None:
        """``not_activations``: tensors whose storage is never counted (the parameters, and the batch, which the
        caller holds whatever the schedule: the micro-batches are views of it)."""
        self.live = [0] * num_stages
        self.peak = [0] * num_stages
        self._tracked: set[tuple[int, int]] = set()  # (stage, id of a storage) counted and still alive
        self._lock = threading.Lock()
        self._local = threading.local()
        self._excluded = {t.untyped_storage().data_ptr() for t in not_activations}
        self._cuts: set[int] = set()  # ids of live storages not to count (see exclude)

    def reset_peak(self) -> None:
        """Start the peaks again from what is live now (e.g. after a warm-up step)."""
        with self._lock:
            self.peak = list(self.live)

    def exclude(self, tensor: torch.Tensor) -> None:
        """Never count ``tensor``'s storage while it lives: e.g. a stage's input, which the stage before it
        holds until its own backward (how long depends on that other thread's progress, not on this stage)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        with self._lock:
            self._cuts.add(key)
        weakref.finalize(storage, self._forget_cut, key)

    def _forget_cut(self, key: int) -> None:
        with self._lock:
            self._cuts.discard(key)

    # --- which stage the calling thread runs
    def set_stage(self, stage: int) -> None:
        self._local.stage = stage

    @contextmanager
    def recording(self, stage: int) -> Iterator[None]:
        """Count what the calling thread's forwards save from here on, against ``stage`` (until :meth:`set_stage`)."""
        previous = getattr(self._local, "stage", None)
        self._local.stage = stage
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._local.stage = previous

    # --- the hooks
    def _pack(self, tensor: torch.Tensor) -> Any:
        stage = getattr(self._local, "stage", None)
        storage = tensor.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        if stage is None or address in self._excluded or nbytes == 0 or id(storage) in self._cuts:
            return tensor
        key = (stage, id(storage))
        with self._lock:
            if key not in self._tracked:
                self._tracked.add(key)
                self.live[stage] += nbytes
                self.peak[stage] = max(self.peak[stage], self.live[stage])
                weakref.finalize(storage, self._release, key, nbytes)  # torch keeps one storage object per storage
        # Autograd keeps a detached alias (same storage) in the tensor's place: holding the tensor itself would,
        # for a saved output, tie it to the output's grad_fn, the node that saved it, a cycle through C++ that
        # is never freed when that node is not run again (zero-bubble's input-side nodes after a retained B).
        return tensor.detach()

    @staticmethod
    def _unpack(alias: Any) -> torch.Tensor:
        return alias  # type: ignore[no-any-return]

    def _release(self, key: tuple[int, int], nbytes: int) -> None:
        with self._lock:
            self._tracked.discard(key)
            self.live[key[0]] -= nbytes


class Metered(nn.Module):
    """A stage module whose forward runs under ``meter.recording(stage)`` (for engines that run a stage's
    forward in a process we do not otherwise reach: torch's pipelining)."""

    def __init__(self, inner: nn.Module, meter: ActivationMeter, stage: int) -> None:
        super().__init__()
        self.inner = inner
        self.meter = meter
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.meter.recording(self.stage):
            return self.inner(*args, **kwargs)
