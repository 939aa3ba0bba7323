"""Which gradient buckets DDP will build for a bucket size, before building them.

DDP assigns gradients to buckets twice: once at construction (in reverse parameter order),
and once more, for good, at the start of the second iteration, in the order the gradients
became ready during the first ("bucket rebuild"). Both use one greedy rule, torch's
``_compute_bucket_assignment_by_size``: walk the gradients in order, add each to the open
bucket of its dtype and device, and close that bucket as soon as it holds at least its
limit; bucket ``i`` has limit ``limits[min(i, len(limits) - 1)]`` (TunedDDPStrategy passes
``[first_bucket_cap, bucket_cap]``).

So, once the ready order has been seen, the layout every candidate size would give is
known without measuring anything, and sizes that give the same layout are the same
experiment: :func:`distinct_candidates` keeps one of each. :func:`predict_buckets` calls
torch's own function when the installed torch has it, and
:func:`~lightning_mgpu.tuning.buckets.assign_buckets` (a plain Python copy of the rule, tested
against torch) otherwise. The arithmetic itself (sizes, limits, the first-bucket rule) is
:mod:`lightning_mgpu.tuning.buckets`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lightning_mgpu.tuning.buckets import assign_buckets, bucket_limits

if TYPE_CHECKING:
    import torch


def predict_buckets(tensors: Sequence[torch.Tensor], limits: Sequence[int]) -> list[list[int]]:
    """Buckets DDP builds for ``tensors`` walked in this order (positions into ``tensors``).

    Uses torch's own ``_compute_bucket_assignment_by_size`` (the function DDP's rebuild
    calls) when this torch has it; :func:`assign_buckets` otherwise.
    """
    from lightning_mgpu._compat.torch import ddp_bucket_assignment

    compute: Optional[Callable[..., Any]] = ddp_bucket_assignment()
    positions = list(range(len(tensors)))
    if compute is not None:
        buckets, _ = compute(list(tensors), list(limits), [False] * len(tensors), positions)
        return [[int(i) for i in bucket] for bucket in buckets]
    sizes = [t.numel() * t.element_size() for t in tensors]
    keys = [(t.dtype, t.device) for t in tensors]
    return assign_buckets(sizes, limits, keys)


@dataclass(frozen=True)
class Candidate:
    """One bucket layout worth measuring, and every candidate size that gives it."""

    cap_mb: float
    """The size applied when this layout is measured (DDP's default if it gives this layout)."""
    equivalent_mb: tuple[float, ...]
    """Every candidate size giving the same layout, ``cap_mb`` included, ascending."""
    bucket_bytes: tuple[int, ...]
    """Predicted bucket sizes in launch order."""
    is_default: bool
    """True for the layout of DDP's default size."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "cap_mb": self.cap_mb,
            "equivalent_mb": list(self.equivalent_mb),
            "bucket_bytes": list(self.bucket_bytes),
            "is_default": self.is_default,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        return cls(
            cap_mb=float(data["cap_mb"]),
            equivalent_mb=tuple(float(s) for s in data["equivalent_mb"]),
            bucket_bytes=tuple(int(b) for b in data["bucket_bytes"]),
            is_default=bool(data["is_default"]),
        )


def distinct_candidates(
    sizes_mb: Sequence[float],
    default_mb: float,
    layout_for: Callable[[float], Sequence[int]],
) -> list[Candidate]:
    """Group candidate sizes by the layout they give; one :class:`Candidate` per layout.

    Args:
        sizes_mb: candidate sizes (MiB); ``default_mb`` is added if missing.
        default_mb: DDP's default size: its layout is always measured (the baseline) and,
            in its group, it is the size applied.
        layout_for: predicted bucket sizes (bytes, launch order) for a size.

    Returns:
        The candidates, DDP's default first, then by ascending size.
    """
    groups: dict[tuple[int, ...], list[float]] = {}
    for size in sorted({float(s) for s in sizes_mb} | {float(default_mb)}):
        groups.setdefault(tuple(int(b) for b in layout_for(size)), []).append(size)
    candidates = []
    for layout, members in groups.items():
        is_default = float(default_mb) in members
        candidates.append(
            Candidate(
                cap_mb=float(default_mb) if is_default else members[0],
                equivalent_mb=tuple(members),
                bucket_bytes=layout,
                is_default=is_default,
            )
        )
    candidates.sort(key=lambda c: (not c.is_default, c.cap_mb))
    return candidates


def ready_order(observed: Sequence[int], count: int) -> list[int]:
    """The order DDP's rebuild will walk ``count`` parameters in, from the indices seen ready.

    A parameter seen twice counts at its first sighting; parameters without a gradient in
    the observed step go last, in reverse index order, as DDP leaves them.
    """
    seen: set[int] = set()
    order = []
    for index in observed:
        if index not in seen and 0 <= index < count:
            seen.add(index)
            order.append(index)
    return order + [i for i in reversed(range(count)) if i not in seen]


def candidates_from_ready_order(
    params: Sequence[torch.Tensor],
    observed: Sequence[int],
    sizes_mb: Sequence[float],
    default_mb: float,
    first_cap_for: Callable[[float], float],
) -> list[Candidate]:
    """:func:`distinct_candidates` for parameters seen ready in ``observed`` order."""
    order = ready_order(observed, len(params))
    tensors = [params[i] for i in order]

    def layout_for(cap_mb: float) -> list[int]:
        buckets = predict_buckets(tensors, bucket_limits(first_cap_for(cap_mb), cap_mb))
        return [sum(tensors[p].numel() * tensors[p].element_size() for p in bucket) for bucket in buckets]

    return distinct_candidates(sizes_mb, default_mb, layout_for)


def observe_ready_order(params: Sequence[torch.Tensor], backward: Callable[[], None]) -> list[int]:
    """Indices of ``params`` in the order their gradients became ready during ``backward()``."""
    order: list[int] = []
    handles = [
        param.register_post_accumulate_grad_hook(lambda _, index=index: order.append(index))  # type: ignore[no-untyped-call]
        for index, param in enumerate(params)
    ]
    try:
        backward()
    finally:
        for handle in handles:
            handle.remove()
    return order
