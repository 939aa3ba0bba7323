"""What the replay model reads from a ``comm_profile.json``: one profiled step, as plain records.

:func:`load_profile` turns the document (schema in DESIGN.md and ``docs/comm_profiler.md``)
into a :class:`ProfiledRun`: the step's phases (forward, backward compute, optimizer and the
rest), each bucket's bytes and when DDP launched it (ms from the start of backward), and, when
known, the gradients DDP put into each bucket (shape and element size, in the order DDP walks
them). The gradients are what re-bucketing and PowerSGD need; a profile without them still
predicts world size, link and fp16/bf16 for the layout it recorded.

Where the gradients come from, first found wins:

1. ``parameters=`` given by the caller (``lightning-mgpu whatif --params FILE``), a list of
   ``{"shape": [...], "dtype": "float32", "bucket": int}`` in DDP's order (``bucket``
   optional: then the list is cut into the recorded buckets by their byte counts);
2. each bucket's ``"params"`` entry in the profile: ``[{"shape": [...], "dtype": ...}, ...]``
   (the field the profiler records for the replay model, when it does);
3. nothing: :attr:`ProfiledRun.parameters` is empty and :attr:`ProfiledRun.has_parameters`
   False; re-bucketing then splits each recorded bucket into ``num_params`` equal gradients
   (an approximation :mod:`~lightning_mgpu.whatif.model` states in its assumptions).

With gradient accumulation (``summary.accumulate_grad_batches`` > 1) the profiled step is the
synchronising micro-batch of each optimizer step; the window's other micro-batches, which do
not communicate, are ``summary.accumulation_ms`` (of which ``accumulation_compute_ms`` forward
and backward), added by the model to every predicted step. Profiles written before these fields
existed read as ``accumulate_grad_batches = 1``.

Every file is read by :func:`read_json`: a file that cannot be read, is not text or not JSON,
or holds something else than expected is a :class:`ProfileError` naming the file and what was
expected.

Pure Python: no torch import.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float64": 8,
    "double": 8,
}
"""Bytes per element of the gradient dtypes DDP buckets (``torch.`` prefix accepted)."""
CASTING_RATIO_MAX = 2.5
"""A profile compressed by at most this much on the wire (and more than 1.5x) was taken with a casting hook (fp16 /
bf16 send exactly half); more is another hook (PowerSGD)."""


SHARED_CORES_NOTE = (
    "profiled with {ranks} CPU ranks on one machine: their compute and gloo's transfers shared its cores, so the "
    "profile's compute times and all-reduce rate carry that contention, and predictions for other links can be far "
    "too slow. Profile one rank and give a bench-comm result over the target link instead (--link-bench); "
    "docs/whatif.md, 'Results', has the measured errors of both"
)
"""The note on a profile of several CPU ranks on one node (``docs/whatif.md``, "Results")."""


class ProfileError(ValueError):
    """A profile (or parameter list) the replay model cannot use; the message says how to fix it."""


PROFILE_EXPECTED = "a comm_profile.json written by CommProfiler(export_dir=DIR)"


def read_json(path: Union[str, os.PathLike[str]], *, expected: str) -> Any:
    """The JSON document in ``path``; :class:`ProfileError` naming the file and ``expected`` when it
    cannot be read, is not UTF-8 text (a binary file) or is not JSON."""
    where = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise ProfileError(f"{where}: cannot read it ({error.strerror or error}); expected {expected}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ProfileError(
            f"{where}: not a text file (byte {raw[error.start]:#04x} at offset {error.start} is not UTF-8, "
            f"so not JSON); expected {expected}"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileError(f"{where}: not JSON ({error}); expected {expected}") from None
    except RecursionError:
        raise ProfileError(f"{where}: not JSON this reader can take (nested too deeply); expected {expected}") from None


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``"float32"`` / ``"torch.float16"`` / ...; ProfileError for others."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ProfileError(f"unknown gradient dtype {dtype!r}; expected one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True, kw_only=True)
class Gradient:
    """One parameter's gradient as DDP buckets it."""

    shape: tuple[int, ...]
    """The parameter's shape (PowerSGD compresses ``shape[0] x prod(shape[1:])``)."""
    element_bytes: int = 4
    """Bytes per element (4 for float32)."""
    bucket: int = 0
    """The recorded bucket it was in (its position in launch order)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def bytes(self) -> int:
        return self.numel * self.element_bytes


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """One recorded gradient bucket (slowest rank's medians, ms from the start of backward)."""

    index: int
    bytes: int
    num_params: int
    launch_ms: float
    """When DDP launched its all-reduce: its last gradient was ready (and every earlier bucket launched)."""
    done_ms: float
    """When its all-reduce (the hook's future) completed."""


@dataclass(frozen=True, kw_only=True)
class ProfiledRun:
    """One profiled training step: the compute a rank does and the buckets it sends."""

    world_size: int
    backend: str
    device_type: str
    step_ms: float
    forward_ms: float
    backward_compute_ms: float
    """From the end of forward until autograd finished the backward graph."""
    optimizer_ms: float
    exposed_comm_ms: float
    comm_ms: float
    buckets: tuple[Bucket, ...]
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step; the profiled phases above are the synchronising one's."""
    accumulation_ms: float = 0.0
    """The micro-batches of an optimizer step that do not communicate, together (0 without accumulation)."""
    accumulation_compute_ms: float = 0.0
    """Their forward and backward, what a faster device shortens (the rest: the loop's own time)."""
    measured_optimizer_step_ms: Optional[float] = None
    """The whole optimizer step as profiled (median), when the profile records it."""
    parameters: tuple[Gradient, ...] = ()
    compression: Optional[str] = None
    """The compression in force when profiled (None: none, or not recorded)."""
    wire_ratio: Optional[float] = 1.0
    """Bytes on the wire per gradient byte when profiled (0.5 for fp16/bf16; None: unknown)."""
    source: str = "<dict>"
    nodes: Optional[int] = None
    """Machines the profiled ranks ran on (None: not recorded, profiles before it was)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What was assumed while reading (missing optional fields)."""

    @property
    def has_parameters(self) -> bool:
        """True when every gradient's shape is known (re-bucketing and PowerSGD are exact)."""
        return bool(self.parameters)

    @property
    def other_ms(self) -> float:
        """What a step spends outside forward, backward compute, exposed communication and the
        optimizer (zero_grad, hooks, DDP's finalize); kept as profiled, never below 0."""
        known = self.forward_ms + self.backward_compute_ms + self.exposed_comm_ms + self.optimizer_ms
        return max(0.0, self.step_ms - known)

    @property
    def gradient_bytes(self) -> int:
        return sum(b.bytes for b in self.buckets)

    @property
    def optimizer_step_ms(self) -> float:
        """The whole optimizer step as profiled: measured, or the synchronising step plus the
        micro-batches without communication (medians do not add exactly)."""
        if self.measured_optimizer_step_ms is not None:
            return self.measured_optimizer_step_ms
        return self.step_ms + self.accumulation_ms


# ---------------------------------------------------------------------------------- reading


def _number(mapping: Mapping[str, Any], key: str, where: str) -> float:
    value = mapping.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProfileError(f"{where}: {key!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def _integer(value: Any, where: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ProfileError(f"{where} must be an integer >= {minimum}, got {value!r:.80}")
    return value


def _optional_number(mapping: Mapping[str, Any], key: str, where: str) -> Optional[float]:
    """``mapping[key]`` checked as :func:`_number`; None when missing or null."""
    return None if mapping.get(key) is None else _number(mapping, key, where)


def _median(summary: Mapping[str, Any], key: str, where: str) -> float:
    value = summary.get(key)
    if not isinstance(value, Mapping):
        raise ProfileError(f"{where}: summary.{key} must be {{'median': ..., 'p90': ...}}, got {value!r:.80}")
    return _number(value, "median", f"{where}: summary.{key}")


def _gradients_from_buckets(raw_buckets: Sequence[Mapping[str, Any]], where: str) -> tuple[Gradient, ...]:
    """The per-bucket ``"params"`` entries, flattened in launch order (empty if any bucket lacks them)."""
    gradients: list[Gradient] = []
    for position, bucket in enumerate(raw_buckets):
        params = bucket.get("params")
        if not params:
            return ()
        if not isinstance(params, list):
            raise ProfileError(f"{where}: buckets[{position}].params must be a list, got {type(params).__name__}")
        for param in params:
            gradients.append(_gradient(param, bucket=position, where=f"{where}: buckets[{position}].params"))
    return tuple(gradients)


def _gradient(param: Any, *, bucket: int, where: str) -> Gradient:
    if not isinstance(param, Mapping) or "shape" not in param:
        raise ProfileError(
            f"{where}: expected a parameter, an object with a 'shape' (and a 'dtype'), got {param!r:.80}"
        )
    shape = param["shape"]
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProfileError(f"{where}: 'shape' must be a list of integers >= 0, got {shape!r:.80}")
    try:
        element_bytes = dtype_bytes(param.get("dtype", "float32"))
    except ProfileError as error:
        raise ProfileError(f"{where}: {error}") from None
    return Gradient(
        shape=tuple(int(d) for d in shape),
        element_bytes=element_bytes,
        bucket=_integer(param.get("bucket", bucket), f"{where}: 'bucket'"),
    )


def assign_to_buckets(
    parameters: Sequence[Mapping[str, Any]], buckets: Sequence[Bucket], *, where: str = "parameters"
) -> tuple[Gradient, ...]:
    """Gradients in DDP's order, each given its recorded bucket.

    An entry's own ``"bucket"`` wins; otherwise the list is cut into the recorded buckets by
    their byte counts (it must then add up to each bucket exactly: ProfileError says where not).
    ``where`` names the list in messages (the ``--params`` file).
    """
    if not isinstance(parameters, (list, tuple)) or not all(isinstance(p, Mapping) for p in parameters):
        raise ProfileError(
            f"{where}: expected a list of {{'shape': [...], 'dtype': 'float32'}} objects in DDP's order, got "
            f"{parameters!r:.80}"
        )
    gradients = [_gradient(p, bucket=0, where=f"{where}[{i}]") for i, p in enumerate(parameters)]
    if parameters and all("bucket" in p for p in parameters):
        return tuple(gradients)
    out: list[Gradient] = []
    position, filled = 0, 0
    for gradient in gradients:
        if position >= len(buckets):
            raise ProfileError(
                f"{where}: {len(gradients)} gradients hold more bytes than the profile's {len(buckets)} "
                f"bucket(s) ({sum(b.bytes for b in buckets)} bytes); give each entry its 'bucket' or list only "
                "the parameters that require gradients, in DDP's order"
            )
        out.append(Gradient(shape=gradient.shape, element_bytes=gradient.element_bytes, bucket=position))
        filled += gradient.bytes
        if filled == buckets[position].bytes:
            position, filled = position + 1, 0
        elif filled > buckets[position].bytes:
            raise ProfileError(
                f"{where}: the gradients do not line up with bucket {position} ({buckets[position].bytes} bytes "
                f"recorded, {filled} reached); list them in the order DDP walks them (reverse order of "
                "model.parameters() unless DDP rebuilt its buckets) or give each entry its 'bucket'"
            )
    if position != len(buckets):
        raise ProfileError(
            f"{where}: {sum(g.bytes for g in out)} bytes of gradients, the profile's buckets hold "
            f"{sum(b.bytes for b in buckets)}; the list must cover every parameter that has a gradient"
        )
    return tuple(out)


def load_profile(
    profile: Union[str, os.PathLike[str], Mapping[str, Any]],
    *,
    parameters: Optional[Sequence[Mapping[str, Any]]] = None,
    parameters_source: str = "parameters",
) -> ProfiledRun:
    """Read a ``comm_profile.json`` (path or the parsed document) into a :class:`ProfiledRun`.

    ``parameters``: the gradients in DDP's order, when the profile does not hold them (see the
    module docstring); ``parameters_source`` names them in messages (their file). Raises
    :class:`ProfileError` naming the file and the field that is missing or wrong.
    """
    if isinstance(profile, Mapping):
        document: Any = profile
        where = "profile"
    else:
        where = str(profile)
        document = read_json(profile, expected=PROFILE_EXPECTED)
    if not isinstance(document, Mapping) or not isinstance(document.get("summary"), Mapping):
        raise ProfileError(f"{where}: no 'summary' object, so not a comm_profile.json; expected {PROFILE_EXPECTED}")
    summary = document["summary"]
    notes: list[str] = []
    world_size = _integer(document.get("world_size"), f"{where}: 'world_size'", minimum=1)
    step_ms = _median(summary, "step_ms", where)
    raw_buckets = document.get("buckets") or []
    if not isinstance(raw_buckets, list):
        raise ProfileError(f"{where}: 'buckets' must be a list, got {type(raw_buckets).__name__}")
    for i, raw in enumerate(raw_buckets):
        if not isinstance(raw, Mapping):
            raise ProfileError(f"{where}: buckets[{i}] must be an object, got {raw!r:.80}")
    buckets = tuple(
        Bucket(
            index=_integer(b.get("index", i), f"{where}: buckets[{i}].index"),
            bytes=int(_number(b, "bytes", f"{where}: buckets[{i}]")),
            num_params=max(1, _integer(b.get("num_params") or 1, f"{where}: buckets[{i}].num_params")),
            launch_ms=_number(b, "launch_ms", f"{where}: buckets[{i}]"),
            done_ms=_number(b, "done_ms", f"{where}: buckets[{i}]"),
        )
        for i, b in enumerate(raw_buckets)
    )
    if not buckets and not parameters:
        raise ProfileError(
            f"{where}: no gradient buckets were recorded (a strategy that is not ddp_tuned, or no hook in DDP); "
            "profile with strategy='ddp_tuned' (any world size, 1 included), or give the parameters (--params)"
        )
    optimizer_ms = _optional_number(summary, "optimizer_ms", f"{where}: summary")
    if optimizer_ms is None:
        notes.append("the profile has no optimizer_ms: counted in 'other'")
    compression = summary.get("compression", document.get("compression"))
    if compression is not None and str(compression).lower() not in ("none", "fp16", "bf16", "powersgd"):
        notes.append(f"the profile names a compression the model does not know ({compression!r:.40}): replayed without")
        compression = None
    elif compression is not None:
        compression = None if str(compression).lower() == "none" else str(compression).lower()
    ratio = summary.get("compression_ratio")
    wire_ratio: Optional[float] = 1.0 / float(ratio) if isinstance(ratio, (int, float)) and ratio > 0 else 1.0
    if compression is None and isinstance(ratio, (int, float)) and ratio > 1.5:
        if ratio <= CASTING_RATIO_MAX:
            compression = "fp16"  # a casting hook: fp16 or bf16 cost the same for the model
            notes.append("the profile was taken with a casting compression (fp16 or bf16)")
        else:
            notes.append(
                f"the profile's hook sent {ratio:.1f}x fewer bytes than the gradients (PowerSGD?), which the model "
                "cannot name: the profiled configuration replays as uncompressed (name one: --compression)"
            )
    if summary.get("measures_comm") is False:
        notes.append("the profile did not time communication (no CommHookHost strategy)")
    nodes = document.get("nodes")
    nodes = nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1 else None
    device_type = str(document.get("device_type", "cpu"))
    if device_type == "cpu" and world_size > 1 and nodes == 1:
        notes.append(SHARED_CORES_NOTE.format(ranks=world_size))
    accumulate, accumulation_ms, accumulation_compute_ms, full_step_ms = _accumulation(summary, where, notes)
    if parameters:
        gradients = assign_to_buckets(parameters, buckets, where=parameters_source)
    else:
        gradients = _gradients_from_buckets(raw_buckets, where)
    if not gradients:
        notes.append(
            "the profile does not list the gradients in each bucket: re-bucketing splits each recorded bucket "
            "into equal gradients, and PowerSGD cannot be predicted"
        )
        if compression == "powersgd":
            notes.append("the profile names PowerSGD but not its gradients' shapes: replayed without compression")
            compression = None
    return ProfiledRun(
        world_size=world_size,
        backend=str(document.get("backend", "unknown")),
        device_type=device_type,
        step_ms=step_ms,
        forward_ms=_number(summary, "forward_ms", f"{where}: summary"),
        backward_compute_ms=_number(summary, "backward_compute_ms", f"{where}: summary"),
        optimizer_ms=optimizer_ms or 0.0,
        exposed_comm_ms=_optional_number(summary, "exposed_comm_ms", f"{where}: summary") or 0.0,
        comm_ms=_optional_number(summary, "comm_ms", f"{where}: summary") or 0.0,
        buckets=buckets,
        accumulate_grad_batches=accumulate,
        accumulation_ms=accumulation_ms,
        accumulation_compute_ms=accumulation_compute_ms,
        measured_optimizer_step_ms=full_step_ms,
        parameters=gradients,
        compression=str(compression) if compression else None,
        wire_ratio=wire_ratio,
        source=where,
        nodes=nodes,
        notes=tuple(notes),
    )


def _accumulation(
    summary: Mapping[str, Any], where: str, notes: list[str]
) -> tuple[int, float, float, Optional[float]]:
    """(micro-batches per optimizer step, their time without communication, its compute part, the
    whole optimizer step if recorded); a profile from before these fields: (1, 0, 0, None)."""
    raw = summary.get("accumulate_grad_batches")
    accumulate = 1 if raw is None else _integer(raw, f"{where}: summary.accumulate_grad_batches", minimum=1)
    accumulation_ms = _optional_number(summary, "accumulation_ms", f"{where}: summary")
    compute_ms = _optional_number(summary, "accumulation_compute_ms", f"{where}: summary")
    full_ms = None if summary.get("optimizer_step_ms") is None else _median(summary, "optimizer_step_ms", where)
    if accumulate > 1 and accumulation_ms is None:
        notes.append(
            f"accumulate_grad_batches={accumulate}, but the profile does not time the micro-batches without "
            "communication: predictions are for the synchronising micro-batch only, not the optimizer step"
        )
    accumulation_ms = accumulation_ms or 0.0
    compute_ms = accumulation_ms if compute_ms is None else min(compute_ms, accumulation_ms)
    if accumulate > 1 and accumulation_ms > 0:
        notes.append(
            f"a step is the optimizer step of {accumulate} micro-batches (accumulate_grad_batches): "
            f"{accumulate - 1} without communication ({accumulation_ms:.1f} ms profiled), then the one that "
            "communicates"
        )
    return accumulate, accumulation_ms, compute_ms, full_ms


PARAMETERS_EXPECTED = (
    "a JSON list of {'shape': [...], 'dtype': 'float32'} in DDP's order (or an object with it under 'parameters')"
)


def load_parameters(path: Union[str, os.PathLike[str]]) -> list[dict[str, Any]]:
    """A ``--params`` file: a JSON list of ``{"shape": [...], "dtype": ..., "bucket": int}``
    (or an object with such a list under ``"parameters"``); each entry checked, naming the file."""
    data = read_json(path, expected=PARAMETERS_EXPECTED)
    if isinstance(data, Mapping):
        data = data.get("parameters")
    if not isinstance(data, list) or not data:
        raise ProfileError(f"{path}: expected {PARAMETERS_EXPECTED}")
    for index, entry in enumerate(data):
        _gradient(entry, bucket=0, where=f"{path}: entry {index}")  # raises naming the file and the entry
    return data


__all__ = [
    "DTYPE_BYTES",
    "PARAMETERS_EXPECTED",
    "PROFILE_EXPECTED",
    "SHARED_CORES_NOTE",
    "Bucket",
    "Gradient",
    "ProfileError",
    "ProfiledRun",
    "assign_to_buckets",
    "dtype_bytes",
    "load_parameters",
    "load_profile",
    "read_json",
]
