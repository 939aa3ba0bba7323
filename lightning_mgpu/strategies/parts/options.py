"""``TunedDDPStrategy``'s arguments: their checks, DDP's defaults, and the names it registers.

The bucket-size arithmetic is :mod:`lightning_mgpu.tuning.buckets`; :func:`bucket_kwargs` adds the one
fact about the installed torch it needs (whether DDP takes a per-bucket list of caps, torch >= 2.13:
an explicit size then never drops the small first bucket; older torch gets one size for all buckets
and a warning).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu._checks import check_int
from lightning_mgpu.comm.compression import COMPRESSIONS
from lightning_mgpu.tuning.buckets import DEFAULT_GRID_MB, check_size_mb, ddp_bucket_kwargs
from lightning_mgpu.tuning.plan import TuningSettings

DEFAULT_POWERSGD_RANK = 1
DEFAULT_POWERSGD_START_ITER = 10

START_METHODS = ("popen", "spawn", "fork", "forkserver")
DDP_SIGNATURE = inspect.signature(DistributedDataParallel.__init__)
DDP_PARAMETERS = frozenset(DDP_SIGNATURE.parameters) - {"self"}
SUPPORTS_BUCKET_LIST = "bucket_cap_mb_list" in DDP_PARAMETERS
SUPPORTS_INIT_SYNC = "init_sync" in DDP_PARAMETERS
# Set by the strategy itself, or by Lightning; never accepted from the user.
RESERVED_DDP_KWARGS = {
    "module": "the strategy wraps your LightningModule itself",
    "device_ids": "the strategy picks the device of each process",
    "output_device": "the strategy picks the device of each process",
    "bucket_cap_mb_list": "use bucket_cap_mb= and first_bucket_cap_mb= instead",
}
BOOL_DDP_KWARGS = (
    "broadcast_buffers",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "init_sync",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
    "forward_sync_buffers",
)


def _tuned_strategy_names() -> tuple[tuple[str, str, dict[str, Any]], ...]:
    """Every ``Trainer(strategy=...)`` name of ``TunedDDPStrategy``: (name, description, preset options).

    Lightning's own DDP names with ``ddp`` read ``ddp_tuned`` (``ddp_spawn`` -> ``ddp_tuned_spawn``,
    ``ddp_find_unused_parameters_true`` -> ``ddp_tuned_find_unused_parameters_true``, ...), so that a
    user swaps one word; then the presets of this package's own options.
    """
    launches = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"), ("_notebook", "fork"))
    names: list[tuple[str, str, dict[str, Any]]] = [
        ("ddp_tuned", "DDP with sized buckets and compression hooks on every backend", {}),
    ]
    for suffix, method in launches[1:]:
        where = "in notebooks, processes forked" if suffix == "_notebook" else f"processes started with `{method}`"
        names.append((f"ddp_tuned{suffix}", f"ddp_tuned, {where}", {"start_method": method}))
    for suffix, method in launches:
        for unused in (False, True):
            preset: dict[str, Any] = {"find_unused_parameters": unused}
            if method != "popen":
                preset["start_method"] = method
            names.append(
                (
                    f"ddp_tuned{suffix}_find_unused_parameters_{str(unused).lower()}",
                    f"ddp_tuned{suffix} with find_unused_parameters={unused}",
                    preset,
                )
            )
    names += [
        ("ddp_tuned_fp16", "ddp_tuned with gradients all-reduced in float16", {"compression": "fp16"}),
        ("ddp_tuned_bf16", "ddp_tuned with gradients all-reduced in bfloat16", {"compression": "bf16"}),
        ("ddp_tuned_powersgd", "ddp_tuned with PowerSGD gradient compression", {"compression": "powersgd"}),
        ("ddp_tuned_auto", "ddp_tuned with the bucket size measured during the first steps", {"bucket_cap_mb": "auto"}),
    ]
    return tuple(names)


TUNED_STRATEGY_NAMES = _tuned_strategy_names()
"""What ``TunedDDPStrategy.register_strategies`` registers, in order (``lightning_mgpu.STRATEGY_NAMES`` lists
the names too, without importing torch; a test keeps both equal)."""

__all__ = [
    "DEFAULT_POWERSGD_RANK",
    "DEFAULT_POWERSGD_START_ITER",
    "TUNED_STRATEGY_NAMES",
    "bucket_kwargs",
    "check_backend",
    "check_backend_registered",
    "check_ddp_kwargs",
    "check_options",
]


BACKEND_ALLOWED = "a torch.distributed backend name such as 'gloo' or 'nccl' (or None: nccl on GPUs, gloo on CPU)"


def check_backend(value: object) -> None:
    """At construction: a backend name is a non-empty string (or None).

    Whether torch knows the name is checked at setup (:func:`check_backend_registered`), as stock
    ``DDPStrategy`` does: a backend registered after the strategy was built (e.g. by a plugin
    imported later, ``torch.distributed.Backend.register_backend``) must be accepted.
    """
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"process_group_backend must be {BACKEND_ALLOWED}, got {value!r}")


def known_backends() -> set[str]:
    """The backend names torch.distributed knows now (registered ones included)."""
    return {str(name) for name in getattr(torch.distributed.Backend, "backend_list", ())} - {"undefined"}


def check_backend_registered(value: str) -> None:
    """At setup, before the process group is created: refuse a backend torch does not know (yet).

    The message starts as torch's own (``Invalid backend: 'NAME'``) and says how to fix it.
    """
    known = known_backends()
    # "cpu:gloo,cuda:nccl" names one backend per device type
    unknown = [part.split(":", 1)[-1] for part in value.lower().split(",") if part.split(":", 1)[-1] not in known]
    if known and unknown:
        raise ValueError(
            f"Invalid backend: {unknown[0]!r} (process_group_backend={value!r}). torch.distributed knows "
            f"{sorted(known)}: pass one of them, None (nccl on GPUs, gloo on CPU), or register yours with "
            "torch.distributed.Backend.register_backend(...) before fit starts."
        )


def ddp_default(name: str) -> Any:
    """``DistributedDataParallel``'s default for ``name`` (``inspect.Parameter.empty`` when it has none)."""
    return DDP_SIGNATURE.parameters[name].default


def check_ddp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Check the keyword arguments meant for ``DistributedDataParallel``; return those to pass on.

    A reserved argument (set by the strategy itself) is accepted at DDP's own default (None),
    and dropped: LightningCLI/jsonargparse fills in every default of DDP's signature
    (``output_device=None``, ``bucket_cap_mb_list=None``, ...), which means "not given".
    Any other value of a reserved argument is refused.
    """
    passed: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in RESERVED_DDP_KWARGS:
            if key in DDP_PARAMETERS and value is None and ddp_default(key) is None:
                continue  # "not given": the strategy sets it
            raise ValueError(f"TunedDDPStrategy does not accept {key}={value!r}: {RESERVED_DDP_KWARGS[key]}.")
        if key not in DDP_PARAMETERS:
            allowed = ", ".join(sorted(DDP_PARAMETERS - set(RESERVED_DDP_KWARGS) - {"bucket_cap_mb"}))
            raise ValueError(
                f"TunedDDPStrategy got an unknown keyword argument {key}={value!r}. Keyword arguments not named by "
                f"the strategy go to DistributedDataParallel, which accepts: {allowed}."
            )
        # DDP's default may be None for a flag (broadcast_buffers, forward_sync_buffers): "DDP decides".
        if key in BOOL_DDP_KWARGS and not isinstance(value, bool) and not (value is None and ddp_default(key) is None):
            allowed_flag = "True, False or None" if ddp_default(key) is None else "True or False"
            raise ValueError(f"{key} must be {allowed_flag}, got {value!r} ({type(value).__name__})")
        passed[key] = value
    return passed


def bucket_kwargs(*, cap: Optional[float], given_first: Optional[float]) -> dict[str, Any]:
    """``DistributedDataParallel`` keyword arguments for these caps on the installed torch (``{}``: DDP's default)."""
    kwargs = ddp_bucket_kwargs(cap=cap, given_first=given_first, per_bucket_caps=SUPPORTS_BUCKET_LIST)
    if "bucket_cap_mb" in kwargs:
        warnings.warn(
            f"torch {torch.__version__} cannot size the first bucket separately; every bucket, the first "
            f"included, will be {kwargs['bucket_cap_mb']:g} MiB. Upgrade to torch >= 2.13 to keep a small first bucket.",
            stacklevel=3,
        )
    return kwargs


@dataclass(frozen=True, kw_only=True)
class TunedOptions:
    """``TunedDDPStrategy``'s own arguments after their checks."""

    bucket_cap_mb: Optional[float]
    """None: DDP's default (also for "auto" until it decides)."""
    first_bucket_cap_mb: Optional[float]
    compression: Optional[str]
    powersgd_rank: int
    powersgd_start_iter: int
    tuning: Optional[TuningSettings]
    """The search's settings with ``bucket_cap_mb="auto"``, else None."""
    ddp_kwargs: dict[str, Any]
    """What goes on to ``DistributedDataParallel`` (reserved arguments left at their defaults dropped)."""


def check_options(
    *,
    bucket_cap_mb: object,
    first_bucket_cap_mb: object,
    compression: Optional[str],
    powersgd_rank: object,
    powersgd_start_iter: object,
    tune_steps: Optional[int],
    tune_candidates: Optional[Sequence[float]],
    tune_rounds: int,
    ddp_comm_hook: object,
    ddp_comm_wrapper: object,
    model_averaging_period: object,
    process_group_backend: object,
    timeout: object,
    start_method: object,
    ddp_kwargs: dict[str, Any],
) -> TunedOptions:
    """Check every argument of ``TunedDDPStrategy`` (``ValueError`` naming the first bad one)."""
    auto = isinstance(bucket_cap_mb, str) and bucket_cap_mb == "auto"
    cap = None if auto else check_size_mb("bucket_cap_mb", bucket_cap_mb, auto=True)
    first = check_size_mb("first_bucket_cap_mb", first_bucket_cap_mb)
    tuning = None
    if auto:
        tuning = TuningSettings(
            candidates_mb=DEFAULT_GRID_MB if tune_candidates is None else tune_candidates,  # type: ignore[arg-type]  # checked in TuningSettings
            steps=tune_steps,
            rounds=tune_rounds,
        )
    else:
        given = {
            "tune_steps": (tune_steps, None),
            "tune_candidates": (tune_candidates, None),
            "tune_rounds": (tune_rounds, 2),
        }
        for name, (value, default) in given.items():
            if value is not default and (default is None or value != default):
                raise ValueError(
                    f"{name}={value!r} applies only to bucket_cap_mb='auto' (got bucket_cap_mb={bucket_cap_mb!r}); "
                    f"pass TunedDDPStrategy(bucket_cap_mb='auto', {name}=...) or leave {name} out."
                )
    if cap is not None and first is not None and first > cap:
        raise ValueError(
            f"first_bucket_cap_mb ({first:g}) must not exceed bucket_cap_mb "
            f"({cap:g}): the first bucket exists to start communication early."
        )
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression is not None and (ddp_comm_hook is not None or ddp_comm_wrapper is not None):
        raise ValueError(
            f"compression={compression!r} registers its own communication hook; pass either compression= or "
            "ddp_comm_hook=/ddp_comm_wrapper=, not both."
        )
    rank = check_int("powersgd_rank", powersgd_rank, minimum=1)
    start_iter = check_int(
        "powersgd_start_iter", powersgd_start_iter, minimum=2, why=" (DDP rebuilds its buckets during the first step)"
    )
    if compression != "powersgd":  # accepted and ignored, they would look like they did something
        for name, value, default in (
            ("powersgd_rank", rank, DEFAULT_POWERSGD_RANK),
            ("powersgd_start_iter", start_iter, DEFAULT_POWERSGD_START_ITER),
        ):
            if value != default:
                raise ValueError(
                    f"{name}={value!r} applies only to compression='powersgd' (got compression={compression!r}); "
                    f"pass TunedDDPStrategy(compression='powersgd', {name}=...) or leave {name} out."
                )
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"timeout must be a positive datetime.timedelta or None, got {timeout!r}")
    check_backend(process_group_backend)
    for name, hook in (("ddp_comm_hook", ddp_comm_hook), ("ddp_comm_wrapper", ddp_comm_wrapper)):
        if hook is not None and not callable(hook):
            raise ValueError(f"{name} must be a callable (a DDP communication hook) or None, got {hook!r}")
    if model_averaging_period is not None:
        check_int("model_averaging_period", model_averaging_period, minimum=1)
    passed = check_ddp_kwargs(ddp_kwargs)
    return TunedOptions(
        bucket_cap_mb=cap,
        first_bucket_cap_mb=first,
        compression=compression,
        powersgd_rank=rank,
        powersgd_start_iter=start_iter,
        tuning=tuning,
        ddp_kwargs=passed,
    )
