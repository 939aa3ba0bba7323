"""PowerSGD whose memory follows the parameters, not the bucket numbers.

torch's ``powerSGD_hook`` keeps two things per *bucket index*: the error-feedback residual
(``state.error_dict[i]``, one value per gradient element of bucket ``i``) and, with warm
start, the low-rank factors Q of the bucket's matrices (``state.q_memory_dict[i]``). When
the layout changes, bucket ``i`` holds other parameters and that memory is wrong: DDP's own
rebuild on its second iteration is why ``start_powerSGD_iter`` must be at least 2, and
``bucket_cap_mb="auto"`` changes the layout several times while it measures.

:class:`PowerSGDLayoutKeeper` wraps the hook and remaps, so nothing is lost or misapplied:
it remembers which parameters each bucket index held; the first time a bucket arrives
with other parameters than its index had, it *parks* the memory of that index and of every
later one (cut per parameter: a slice of the residual, a Q matrix), then assembles the new
bucket's memory from the parked pieces. Buckets arrive in index order, always starting at
0, so the indices parked are never those of a bucket still in flight.

Everything per parameter follows the hook's own arithmetic (which tensors it compresses,
in which order their Qs sit), so PowerSGD computes exactly what it would with the new
layout from the start, with one difference that makes the run independent of the layout:
Q is first drawn per parameter (seeded by the parameter's position), not per bucket.
A run with ``"auto"`` buckets therefore ends on the same parameters as one with the
chosen size fixed, and the state can be checkpointed per parameter (:meth:`state_dict`)
and resumed under any layout.

A complex parameter occupies its real view in DDP's bucket (``torch.view_as_real``: twice
``numel`` elements), but ``bucket.gradients()`` gives it a view of ``numel`` elements in the
parameter's complex shape, so torch's hook compresses and all-reduces only the first half of
it and leaves the rest un-averaged (silently, with more than one rank).
:func:`complex_as_real` hands the hook each complex gradient as its real view, shape
``(*shape, 2)``: PowerSGD then treats a complex parameter exactly as it treats a real
parameter holding ``torch.view_as_real`` of it, and the keeper counts the same elements.

No ``from __future__ import annotations`` here: DDP inspects the hook's annotations.
"""

from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from lightning_mgpu._compat.torch import powersgd_should_compress
from lightning_mgpu.comm.compression import CommHook


def one_bucket_at_a_time(hook: CommHook) -> CommHook:
    """``hook``, returning only once the bucket's whole reduction is done (for gloo).

    torch's PowerSGD hooks issue their second and third all-reduce from completion callbacks,
    which gloo runs on its own worker threads. With several buckets in flight those calls
    reach each rank in a different order: a collective mismatch ("Received data size
    doesn't match expected size") or, with gloo's two worker threads both blocked in such
    a callback, a deadlock. Finishing each bucket before DDP launches the next keeps one
    order everywhere (and gives up overlapping PowerSGD with the backward, on gloo only).
    """

    def powerSGD_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        future.wait()
        return future

    powerSGD_hook.__name__ = powerSGD_hook.__qualname__ = getattr(hook, "__name__", "powerSGD_hook")
    return powerSGD_hook


def real_view_shape(param: torch.Tensor) -> torch.Size:
    """The shape of ``param`` as DDP's bucket holds it: ``torch.view_as_real``'s for a complex one."""
    return torch.Size((*param.shape, 2)) if param.is_complex() else param.shape


class _RealViewBucket:
    """A ``GradBucket`` whose complex gradients are given as their real views (see :func:`complex_as_real`)."""

    def __init__(self, bucket: dist.GradBucket) -> None:
        self._bucket = bucket
        self._buffer = bucket.buffer()
        self._views: list[torch.Tensor] = []
        offset = 0
        for param, view in zip(bucket.parameters(), bucket.gradients()):
            shape = real_view_shape(param)
            length = shape.numel()
            # DDP lays the bucket out in parameter order, a complex parameter as 2 * numel reals
            self._views.append(self._buffer[offset : offset + length].view(shape) if param.is_complex() else view)
            offset += length

    def index(self) -> int:
        return self._bucket.index()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        return self._bucket.parameters()

    def is_last(self) -> bool:
        return self._bucket.is_last()

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.set_buffer(tensor)


def complex_as_real(hook: CommHook) -> CommHook:
    """``hook`` (torch's ``powerSGD_hook``), given every complex gradient as its real view.

    Buckets without a complex parameter go to ``hook`` unchanged.
    """

    def powerSGD_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if any(param.is_complex() for param in bucket.parameters()):
            return hook(state, _RealViewBucket(bucket))  # type: ignore[arg-type]  # duck-typed: what the hook reads
        return hook(state, bucket)

    powerSGD_hook.__name__ = powerSGD_hook.__qualname__ = getattr(hook, "__name__", "powerSGD_hook")
    return powerSGD_hook


def supports(state: object) -> bool:
    """True for a ``PowerSGDState`` this keeper can remap (not the batched-by-shape variant)."""
    return isinstance(state, powersgd.PowerSGDState) and not state.batch_tensors_with_same_shape


def reset_bucket_memory(state: object) -> bool:
    """Forget a PowerSGD state's per-bucket memory (for hooks the keeper cannot remap).

    Returns True if there was memory to forget.
    """
    had = False
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        memory = getattr(state, name, None)
        if isinstance(memory, dict) and memory:
            memory.clear()
            had = True
    return had


class PowerSGDLayoutKeeper:
    """Keeps ``state``'s error feedback and warm-start Qs with the right parameters across
    bucket-layout changes (see the module docstring).

    Args:
        state: the ``PowerSGDState`` given to DDP with ``powerSGD_hook``.
        named_parameters: every parameter DDP reduces, with a name, in any fixed order;
            the position in this list seeds the parameter's first Q.
    """

    def __init__(self, state: powersgd.PowerSGDState, named_parameters: Sequence[tuple[str, torch.Tensor]]) -> None:
        if not supports(state):
            raise ValueError("PowerSGDLayoutKeeper needs a PowerSGDState with batch_tensors_with_same_shape=False")
        self.state = state
        self.names = [name for name, _ in named_parameters]
        self._position = {id(param): index for index, (_, param) in enumerate(named_parameters)}
        # counted as the bucket holds them: a complex parameter as its real view (complex_as_real)
        self._numel = [real_view_shape(param).numel() for _, param in named_parameters]
        self._matrix = [self._compressed_shape(real_view_shape(param)) for _, param in named_parameters]
        self._signatures: dict[int, tuple[int, ...]] = {}
        self._error: dict[int, torch.Tensor] = {}
        self._q: dict[int, torch.Tensor] = {}
        self._seed: Optional[int] = None
        self.remaps = 0
        """How many times a bucket index was found holding other parameters (tests read it)."""

    # ------------------------------------------------------------------ the hook's own rules

    def _compressed_shape(self, shape: torch.Size) -> Optional[tuple[int, int, int]]:
        """(n, m, rank) of the matrix the hook compresses for a tensor of this shape, or None."""
        if len(shape) == 0 or shape[0] == 0:
            return None
        n = int(shape[0])
        m = int(np.prod(shape)) // n
        rank = min(n, m, self.state.matrix_approximation_rank)
        compress = powersgd_should_compress(n, m, rank, self.state.min_compression_rate)
        return (n, m, rank) if compress else None

    def _q_order(self, signature: Sequence[int]) -> list[int]:
        """Positions of the compressed parameters in the order their Qs sit in the bucket's
        Q memory: the hook groups the matrices by shape, shapes in order of first appearance."""
        by_shape: dict[tuple[int, int], list[int]] = {}
        for position in signature:
            matrix = self._matrix[position]
            if matrix is not None:
                by_shape.setdefault(matrix[:2], []).append(position)
        return [position for group in by_shape.values() for position in group]

    # ------------------------------------------------------------------ hook

    def wrap(self, hook: CommHook) -> CommHook:
        """``hook`` (torch's ``powerSGD_hook``) with the memory remapped before each bucket."""
        keeper = self

        def powerSGD_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            if state.iter >= state.start_powerSGD_iter:  # the hook's own test for compressing
                keeper.prepare(bucket)
            return hook(state, bucket)

        # Same name as torch's: DDP's logging and every tool reading it see PowerSGD.
        powerSGD_hook.__name__ = powerSGD_hook.__qualname__ = getattr(hook, "__name__", "powerSGD_hook")
        return powerSGD_hook

    def prepare(self, bucket: dist.GradBucket) -> None:
        """Give the hook's state the memory of ``bucket``'s parameters (remapped if the layout changed)."""
        index = bucket.index()
        signature = tuple(self._position[id(p)] for p in bucket.parameters())
        known = self._signatures.get(index)
        if known == signature:
            return
        if known is not None:
            self.remaps += 1
        for stale in sorted(i for i in self._signatures if i >= index):
            self._park(stale)
        self._assemble(index, signature, bucket.buffer())

    def _cut(
        self, signature: Sequence[int], error: Optional[torch.Tensor], q_memory: Optional[torch.Tensor]
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """A bucket's residual and Q memory (either may be None) cut per parameter position: (error, Q), views."""
        errors: dict[int, torch.Tensor] = {}
        qs: dict[int, torch.Tensor] = {}
        if error is not None:
            offset = 0
            for position in signature:
                errors[position] = error[offset : offset + self._numel[position]]
                offset += self._numel[position]
        if q_memory is not None:
            offset = 0
            for position in self._q_order(signature):
                _, m, rank = self._matrix[position]  # type: ignore[misc]
                qs[position] = q_memory[offset : offset + m * rank]
                offset += m * rank
        return errors, qs

    def _park(self, index: int) -> None:
        signature = self._signatures.pop(index)
        state = self.state
        state.p_memory_dict.pop(index, None)
        errors, qs = self._cut(signature, state.error_dict.pop(index, None), state.q_memory_dict.pop(index, None))
        self._error.update(errors)
        self._q.update(qs)

    def _fresh_q(self, position: int, m: int, rank: int) -> torch.Tensor:
        if self._seed is None:  # one draw from the state's generator, the same on every rank
            self._seed = int(self.state.rng.randint(1_000_000_000))
        generator = torch.Generator().manual_seed(self._seed + position)
        return torch.randn(m * rank, generator=generator)

    def _assemble(self, index: int, signature: tuple[int, ...], buffer: torch.Tensor) -> None:
        state = self.state
        device, dtype = buffer.device, buffer.dtype
        if state.use_error_feedback:
            pieces = [
                self._error.pop(p).to(device=device, dtype=dtype)
                if p in self._error
                else torch.zeros(self._numel[p], device=device, dtype=dtype)
                for p in signature
            ]
            state.error_dict[index] = torch.cat(pieces) if pieces else buffer.new_zeros(0)
        if state.warm_start:
            qs = []
            p_total = 0
            for position in self._q_order(signature):
                n, m, rank = self._matrix[position]  # type: ignore[misc]
                q = self._q.pop(position) if position in self._q else self._fresh_q(position, m, rank)
                qs.append(q.to(device=device, dtype=dtype))
                p_total += n * rank
            # Present in p_memory_dict: the hook takes these Qs (after orthogonalising them)
            # instead of drawing new ones.
            state.q_memory_dict[index] = torch.cat(qs) if qs else buffer.new_empty(0)
            state.p_memory_dict[index] = buffer.new_empty(p_total)
        self._signatures[index] = signature

    # ------------------------------------------------------------------ checkpoint

    def _per_parameter(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """(error, Q) per parameter position, live buckets and parked pieces together; copies."""
        error, q = dict(self._error), dict(self._q)
        state = self.state
        for index, signature in self._signatures.items():
            live_error, live_q = self._cut(signature, state.error_dict.get(index), state.q_memory_dict.get(index))
            error.update(live_error)
            q.update(live_q)
        error, q = ({p: t.detach().to("cpu", copy=True) for p, t in pieces.items()} for pieces in (error, q))
        return error, q

    def state_dict(self) -> dict[str, Any]:
        """Plain types and CPU tensors only (loadable with ``torch.load(weights_only=True)``).

        ``error`` is this rank's own residual; ``q`` is the same on every rank.
        """
        error, q = self._per_parameter()
        keys, pos, has_gauss, cached = self.state.rng.get_state()[1:]  # type: ignore[index]  # a tuple at run time
        return {
            "iter": int(self.state.iter),
            "seed": self._seed,
            "rng": {
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "error": {self.names[p]: t for p, t in error.items()},
            "q": {self.names[p]: t for p, t in q.items()},
        }

    def load_state_dict(self, saved: dict[str, Any], error: Optional[dict[str, torch.Tensor]]) -> list[str]:
        """Restore from :meth:`state_dict` (``error``: this rank's residuals, or None to start
        them at zero). Returns the names of saved entries that did not fit a parameter."""
        state = self.state
        state.iter = int(saved["iter"])
        self._seed = None if saved.get("seed") is None else int(saved["seed"])
        rng = saved.get("rng")
        if rng is not None:
            keys = rng["keys"].numpy().astype(np.uint32)
            state.rng.set_state(
                ("MT19937", keys, int(rng["pos"]), int(rng["has_gauss"]), float(rng["cached_gaussian"]))
            )
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.clear()
        self._signatures.clear()
        position = {name: p for p, name in enumerate(self.names)}
        rejected = []
        self._error, self._q = {}, {}
        for name, tensor in (error or {}).items():
            p = position.get(name)
            if p is None or tensor.numel() != self._numel[p]:
                rejected.append(name)
            else:
                self._error[p] = tensor.reshape(-1)
        for name, tensor in saved.get("q", {}).items():
            p = position.get(name)
            matrix = None if p is None else self._matrix[p]
            if p is None or matrix is None or tensor.numel() != matrix[1] * matrix[2]:
                rejected.append(name)
            else:
                self._q[p] = tensor.reshape(-1)
        return rejected
