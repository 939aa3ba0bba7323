"""What a compression hook sends and computes per bucket, for the replay model.

Each hook is torch's (``default_hooks.fp16_compress_hook``, the package's bf16 hook,
``powerSGD_hook.powerSGD_hook``); :func:`plan_bucket` writes down, for one bucket, the work it
does in the order it does it:

* ``pre_ms``: compute on the autograd thread when DDP calls the hook, before anything is sent
  (it delays the rest of backward as well as this bucket);
* ``segments``: what follows on the communication side, in order: ``("allreduce", bytes)``,
  ``("host", ms)`` (more host work inside the all-reduce just before it: gloo summing a
  16-bit type), or ``("compute", ms)`` (work in the future's callbacks).

fp16 / bf16: the bucket is cast (and divided) on the autograd thread, all-reduced at half
the bytes, and copied back; on CPU, gloo sums 16-bit types slower per byte than float32: the
difference (measured) is host work of that all-reduce. PowerSGD (steady state, after ``start_powerSGD_iter``; error
feedback and warm start on, torch's defaults): each gradient is viewed as a matrix
``shape[0] x prod(shape[1:])``; with rank ``r' = min(n, m, r)`` it is compressed when
``(n + m) r' * 2 < n m`` (torch's ``_should_compress`` with ``min_compression_rate=2``). Per
bucket: the error-feedback add and copy and ``P = M Q`` (autograd thread), all-reduce of the
uncompressed gradients, then of P, orthogonalise P and ``Q = M^T P``, all-reduce of Q, then
``M = P Q^T`` and the new error. The compute times come from :class:`CompressionCosts`,
measured on the profiled machine by :mod:`lightning_mgpu.whatif.measure`.

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence

from lightning_mgpu._sizes import MiB as MIB
from lightning_mgpu.whatif.records import Gradient

COMPRESSIONS: tuple[Optional[str], ...] = (None, "fp16", "bf16", "powersgd")
CASTING = ("fp16", "bf16")
WIRE_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
"""The element type a casting compression all-reduces."""
MIN_COMPRESSION_RATE = 2

Segment = tuple[str, float]
"""``("allreduce", bytes)``, ``("host", ms)`` or ``("compute", ms)``."""


def check_compression(compression: Optional[str]) -> Optional[str]:
    """``None``/``"none"`` -> None; ``"fp16"``, ``"bf16"``, ``"powersgd"`` as given; ValueError otherwise."""
    if compression is None or str(compression).lower() == "none":
        return None
    name = str(compression).lower()
    if name not in COMPRESSIONS:
        raise ValueError(f"compression must be one of none, fp16, bf16, powersgd; got {compression!r}")
    return name


@dataclass(frozen=True, kw_only=True)
class CompressionCosts:
    """Compute a compression hook adds, measured on the profiled machine (all in ms)."""

    cast_ms_per_mib: float = 0.0
    """fp16/bf16: cast to 16 bits and divide, per MiB of float32 gradient (autograd thread)."""
    uncast_ms_per_mib: float = 0.0
    """fp16/bf16: copy the result back into the float32 bucket, per MiB of gradient."""
    feedback_pre_ms_per_mib: float = 0.0
    """PowerSGD: add the previous error and keep a copy of the bucket, per MiB of gradient."""
    feedback_post_ms_per_mib: float = 0.0
    """PowerSGD: the new error (copy minus decompressed), per MiB of gradient."""
    matrices: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    """PowerSGD per matrix, keyed ``"n,m,r"``: (``P = M Q`` and orthogonalise Q; orthogonalise P and
    ``Q = M^T P``; ``M = P Q^T``)."""
    gflops: float = 0.0
    """Matrix-multiply rate for shapes not in :attr:`matrices` (0: such shapes cost nothing)."""
    gloo_ms_per_mib: Mapping[str, float] = field(default_factory=dict)
    """CPU: a 2-rank gloo all-reduce on loopback, ms per MiB on the wire, by dtype (``"float16"`` ...)."""
    allreduce_overhead_ms: float = 0.0
    """CPU: a 2-rank gloo all-reduce of 4 KiB on loopback: the fixed cost of one all-reduce on this host
    (what every extra bucket, and each of PowerSGD's three all-reduces, pays)."""
    device_type: str = "cpu"
    threads: Optional[int] = None
    source: str = ""

    def matrix_ms(self, n: int, m: int, rank: int) -> tuple[float, float, float]:
        """(pre, mid, post) ms of one ``n x m`` matrix at ``rank``; estimated from :attr:`gflops` if not measured."""
        measured = self.matrices.get(f"{n},{m},{rank}")
        if measured is not None:
            return measured
        if self.gflops <= 0:
            return (0.0, 0.0, 0.0)
        one_matmul = 2.0 * n * m * rank / (self.gflops * 1e6)
        return (one_matmul, one_matmul, one_matmul)

    def reduction_extra_ms_per_mib(self, compression: str) -> float:
        """What gloo spends beyond a float32 all-reduce of the same wire bytes, per MiB, when it
        sums the compression's 16-bit type (0 when not measured, or not slower)."""
        name = WIRE_DTYPES.get(compression)
        if name is None or name not in self.gloo_ms_per_mib or "float32" not in self.gloo_ms_per_mib:
            return 0.0
        return max(0.0, self.gloo_ms_per_mib[name] - self.gloo_ms_per_mib["float32"])

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["matrices"] = {key: list(value) for key, value in self.matrices.items()}
        out["gloo_ms_per_mib"] = dict(self.gloo_ms_per_mib)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> CompressionCosts:
        """The costs from :meth:`as_dict`'s output; ValueError saying which field is wrong (or
        that the object holds none of the fields: it is something else)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"expected an object of compression costs, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        if not known & set(data):
            raise ValueError(f"none of the fields of compression costs ({', '.join(sorted(known))}) is there")

        def number(key: str) -> float:
            value = data.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{key!r} must be a number >= 0, got {value!r:.60}")
            return float(value)

        def mapping(key: str) -> Mapping[str, Any]:
            value = data.get(key, {})
            if not isinstance(value, Mapping):
                raise ValueError(f"{key!r} must be an object, got {value!r:.60}")
            return value

        matrices = {}
        for key, value in mapping("matrices").items():
            if (
                not isinstance(value, (list, tuple))
                or len(value) != 3
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            ):
                raise ValueError(f"matrices[{key!r}] must be three numbers (ms), got {value!r:.60}")
            matrices[str(key)] = (float(value[0]), float(value[1]), float(value[2]))
        gloo = {}
        for key, value in mapping("gloo_ms_per_mib").items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"gloo_ms_per_mib[{key!r}] must be a number, got {value!r:.60}")
            gloo[str(key)] = float(value)
        threads = data.get("threads")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
            raise ValueError(f"'threads' must be an integer or null, got {threads!r:.60}")
        return cls(
            cast_ms_per_mib=number("cast_ms_per_mib"),
            uncast_ms_per_mib=number("uncast_ms_per_mib"),
            feedback_pre_ms_per_mib=number("feedback_pre_ms_per_mib"),
            feedback_post_ms_per_mib=number("feedback_post_ms_per_mib"),
            matrices=matrices,
            gflops=number("gflops"),
            gloo_ms_per_mib=gloo,
            allreduce_overhead_ms=number("allreduce_overhead_ms"),
            device_type=str(data.get("device_type", "cpu")),
            threads=threads,
            source=str(data.get("source", "")),
        )


NO_COSTS = CompressionCosts(source="not measured: compression compute counted as 0")


def matrix_view(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix PowerSGD compresses a gradient of this shape as: ``shape[0] x prod(shape[1:])``."""
    if not shape:
        return (1, 1)
    return (int(shape[0]), math.prod(int(d) for d in shape[1:]))


def powersgd_split(gradient: Gradient, rank: int) -> Optional[tuple[int, int, int]]:
    """``(n, m, r')`` if PowerSGD compresses this gradient at ``rank``, None if it sends it whole."""
    n, m = matrix_view(gradient.shape)
    effective = min(n, m, rank)
    if effective < 1 or (n + m) * effective * MIN_COMPRESSION_RATE >= n * m:
        return None
    return (n, m, effective)


@dataclass(frozen=True)
class BucketPlan:
    """One bucket's work under a compression (see the module docstring)."""

    pre_ms: float
    segments: tuple[Segment, ...]

    @property
    def wire_bytes(self) -> int:
        """Bytes all-reduced (every all-reduce of the bucket together)."""
        return int(sum(amount for kind, amount in self.segments if kind == "allreduce"))


def plan_bucket(
    nbytes: int,
    gradients: Sequence[Gradient],
    *,
    compression: Optional[str],
    powersgd_rank: int = 1,
    costs: CompressionCosts = NO_COSTS,
    pre_in_profile: bool = False,
) -> BucketPlan:
    """The work of one bucket of ``nbytes`` holding ``gradients`` (DDP's order) under ``compression``.

    ``pre_in_profile``: the profile was taken with this same compression, so its autograd-thread
    work is already inside the recorded ready times (not added again).
    """
    mib = nbytes / MIB
    if compression is None:
        return BucketPlan(0.0, (("allreduce", float(nbytes)),))
    if compression in CASTING:
        pre = 0.0 if pre_in_profile else costs.cast_ms_per_mib * mib
        sum16 = costs.reduction_extra_ms_per_mib(compression) * mib / 2
        segments: tuple[Segment, ...] = (
            ("allreduce", nbytes / 2),
            ("host", sum16),
            ("compute", costs.uncast_ms_per_mib * mib),
        )
        return BucketPlan(pre, segments)
    if compression != "powersgd":
        raise ValueError(f"compression must be one of none, fp16, bf16, powersgd; got {compression!r}")
    if not gradients:
        raise ValueError(
            "PowerSGD needs each gradient's shape: the profile does not list them; give the parameters "
            "(lightning-mgpu whatif --params FILE, or load_profile(..., parameters=...))"
        )
    uncompressed = 0
    p_bytes = q_bytes = 0
    pre = costs.feedback_pre_ms_per_mib * mib
    mid = 0.0
    post = costs.feedback_post_ms_per_mib * mib
    for gradient in gradients:
        split = powersgd_split(gradient, powersgd_rank)
        if split is None:
            uncompressed += gradient.bytes
            continue
        n, m, r = split
        p_bytes += n * r * gradient.element_bytes
        q_bytes += m * r * gradient.element_bytes
        matrix_pre, matrix_mid, matrix_post = costs.matrix_ms(n, m, r)
        pre, mid, post = pre + matrix_pre, mid + matrix_mid, post + matrix_post
    if pre_in_profile:
        pre = 0.0
    segments = (
        ("allreduce", float(uncompressed)),  # torch all-reduces the (maybe empty) uncompressed part first
        ("allreduce", float(p_bytes)),
        ("compute", mid),
        ("allreduce", float(q_bytes)),
        ("compute", post),
    )
    return BucketPlan(pre, segments)


def powersgd_matrices(gradients: Sequence[Gradient], rank: int) -> list[tuple[int, int, int]]:
    """The distinct ``(n, m, r')`` PowerSGD compresses among ``gradients`` (what to measure)."""
    seen: dict[tuple[int, int, int], None] = {}
    for gradient in gradients:
        split = powersgd_split(gradient, rank)
        if split is not None:
            seen.setdefault(split, None)
    return list(seen)


__all__ = [
    "CASTING",
    "COMPRESSIONS",
    "NO_COSTS",
    "BucketPlan",
    "CompressionCosts",
    "check_compression",
    "matrix_view",
    "plan_bucket",
    "powersgd_matrices",
    "powersgd_split",
]
