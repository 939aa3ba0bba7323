"""The package's own state in checkpoints: ``checkpoint["lightning_mgpu"]``.

What ``TunedDDPStrategy`` stores: the bucket caps in force, the compression, with
``bucket_cap_mb="auto"`` the search's record (a resumed fit reuses the size and does not tune
again), and PowerSGD's memory (error feedback per rank, Q per parameter), so that a resume
continues the same run. Everything is plain data (``weights_only`` loading works).

On load, :func:`check_package` checks every field with the constructor's own checks, so a
damaged or edited checkpoint is one ``ValueError`` naming the key, never a raw error from
deep inside DDP or a NaN carried into the parameters.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mgpu._checks import check_int, check_real
from lightning_mgpu.comm.compression import COMPRESSIONS
from lightning_mgpu.comm.distributed import gather_objects
from lightning_mgpu.comm.powersgd_memory import PowerSGDLayoutKeeper
from lightning_mgpu.tuning.buckets import check_size_mb
from lightning_mgpu.tuning.tuner import DONE, MEASURING, OBSERVING, RESUMED, SKIPPED, UNFINISHED, WAITING, BucketTuner

CHECKPOINT_KEY = "lightning_mgpu"
"""Top-level checkpoint key under which the package stores its own state."""


def restore_tuned_size(tuner: Optional[BucketTuner], package: dict[str, Any]) -> Optional[float]:
    """The tuned bucket size to reuse from a checkpoint (the tuner is told), or None to tune again."""
    record = package.get("tuning")
    if tuner is None or tuner.status != WAITING or not isinstance(record, dict):
        return None
    size = package.get("bucket_cap_mb")
    valid = isinstance(size, (int, float)) and not isinstance(size, bool) and math.isfinite(size) and size > 0
    if record.get("status") in (DONE, RESUMED) and valid:
        tuner.resume(float(size), record)  # type: ignore[arg-type]
        return float(size)  # type: ignore[arg-type]
    return None  # saved before the search finished: search again (the steps are ordinary ones)


def gather_powersgd_state(keeper: PowerSGDLayoutKeeper, world_size: int) -> dict[str, Any]:
    """PowerSGD's memory for the checkpoint; a collective that every rank enters."""
    state = keeper.state_dict()
    error = state.pop("error")
    # Each rank's residual is its own; Q and the counters are the same everywhere.
    return {**state, "world_size": world_size, "error_per_rank": gather_objects(error, world_size)}


def restore_powersgd_state(
    keeper: PowerSGDLayoutKeeper, saved: dict[str, Any], *, world_size: int, global_rank: int, owner: str
) -> None:
    """Load checkpointed PowerSGD memory into ``keeper``; warn about what cannot be used."""
    per_rank = saved.get("error_per_rank") or []
    error = None
    if saved.get("world_size") == world_size and global_rank < len(per_rank):
        error = per_rank[global_rank]
    else:
        rank_zero_warn(
            f"{owner}: the checkpoint's PowerSGD error feedback comes from {saved.get('world_size')} "
            f"processes, this run has {world_size}; it starts again from zero."
        )
    rejected = keeper.load_state_dict(saved, error)
    if rejected:
        rank_zero_warn(
            f"{owner}: PowerSGD memory for {len(rejected)} parameter(s) did not match this model "
            f"and was dropped (e.g. {rejected[0]!r})."
        )


# ------------------------------------------------------------------ checks on load

_MT19937_WORDS = 624
_TUNING_STATUSES = (WAITING, OBSERVING, MEASURING, DONE, SKIPPED, RESUMED, UNFINISHED)


def _key(*parts: object) -> str:
    """``checkpoint["lightning_mgpu"]["powersgd"]["q"]["body.0.weight"]``, as a user would index it."""
    return "checkpoint" + "".join(f'["{p}"]' if isinstance(p, str) else f"[{p}]" for p in (CHECKPOINT_KEY, *parts))


def check_package(package: object) -> dict[str, Any]:
    """``checkpoint["lightning_mgpu"]`` checked field by field, with the constructor's own checks.

    A checkpoint this package wrote always passes; one that was damaged or edited raises one
    ``ValueError`` naming the key (e.g. ``checkpoint["lightning_mgpu"]["bucket_cap_mb"]``), before
    anything is restored: a bad size would reach DDP, a NaN in PowerSGD's memory the parameters.
    Entries this version does not know are left alone (a newer version may store more).
    """
    if not isinstance(package, dict):
        raise ValueError(f"{_key()} must be a dict of the package's state, got {type(package).__name__}")
    for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
        if name in package:
            check_size_mb(_key(name), package[name])
    if "compression" in package and package["compression"] not in COMPRESSIONS:
        raise ValueError(f"{_key('compression')} must be one of {COMPRESSIONS}, got {package['compression']!r:.60}")
    if package.get("tuning") is not None:
        _check_tuning(package["tuning"])
    if package.get("powersgd") is not None:
        _check_powersgd(package["powersgd"])
    if package.get("hybrid") is not None:
        _check_hybrid(package["hybrid"])
    return package


def _check_dict(value: object, *key: object) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{_key(*key)} must be a dict with string keys, got {value!r:.60}")
    return value


def _check_plain(value: object, *key: object) -> None:
    """JSON-like data only (the tuning record goes back out as JSON and into logs)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, *key, index)
        return
    if isinstance(value, dict):
        for name, item in _check_dict(value, *key).items():
            _check_plain(item, *key, name)
        return
    raise ValueError(f"{_key(*key)} must be plain data (numbers, strings, lists, dicts), got {type(value).__name__}")


def _check_tuning(record: object) -> None:
    record = _check_dict(record, "tuning")
    status = record.get("status")
    if status not in _TUNING_STATUSES:
        raise ValueError(f"{_key('tuning', 'status')} must be one of {_TUNING_STATUSES}, got {status!r:.60}")
    if record.get("chosen_mb") is not None:
        check_size_mb(_key("tuning", "chosen_mb"), record["chosen_mb"])
    for name, value in record.items():
        _check_plain(value, "tuning", name)


def _check_finite_tensor(value: object, *key: object) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        shown = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"{value!r:.60}"
        raise ValueError(f"{_key(*key)} must be a floating-point tensor, got {shown}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{_key(*key)} holds NaN or infinite values; PowerSGD would carry them into the parameters")


def _check_tensors(value: object, *key: object) -> None:
    for name, tensor in _check_dict(value, *key).items():
        _check_finite_tensor(tensor, *key, name)


def _check_powersgd(saved: object) -> None:
    saved = _check_dict(saved, "powersgd")
    check_int(_key("powersgd", "iter"), saved.get("iter"), minimum=0)
    if saved.get("seed") is not None:
        check_int(_key("powersgd", "seed"), saved["seed"], minimum=0, maximum=2**62)
    if saved.get("rng") is not None:
        rng = _check_dict(saved["rng"], "powersgd", "rng")
        keys = rng.get("keys")
        if (
            not isinstance(keys, torch.Tensor)
            or keys.dtype != torch.int64
            or keys.shape != (_MT19937_WORDS,)
            or not bool(((keys >= 0) & (keys < 2**32)).all())
        ):
            shown = (
                f"a {keys.dtype} tensor of shape {tuple(keys.shape)}"
                if isinstance(keys, torch.Tensor)
                else f"{keys!r:.60}"
            )
            raise ValueError(
                f"{_key('powersgd', 'rng', 'keys')} must be an int64 tensor of {_MT19937_WORDS} words in [0, 2**32) "
                f"(numpy's MT19937 state), got {shown}"
            )
        check_int(_key("powersgd", "rng", "pos"), rng.get("pos"), minimum=0, maximum=_MT19937_WORDS)
        check_int(_key("powersgd", "rng", "has_gauss"), rng.get("has_gauss"), minimum=0, maximum=1)
        check_real(_key("powersgd", "rng", "cached_gaussian"), rng.get("cached_gaussian"), what="a finite number")
    _check_tensors(saved.get("q", {}), "powersgd", "q")
    world_size = check_int(_key("powersgd", "world_size"), saved.get("world_size"), minimum=1)
    per_rank = saved.get("error_per_rank")
    if per_rank is not None:
        if not isinstance(per_rank, (list, tuple)) or len(per_rank) != world_size:
            raise ValueError(
                f"{_key('powersgd', 'error_per_rank')} must be a list of one dict per rank "
                f"({_key('powersgd', 'world_size')} = {world_size}), got "
                + (f"{len(per_rank)} entries" if isinstance(per_rank, (list, tuple)) else f"{per_rank!r:.60}")
            )
        for rank, error in enumerate(per_rank):
            if error is not None:
                _check_tensors(error, "powersgd", "error_per_rank", rank)


def _check_hybrid(saved: object) -> None:
    saved = _check_dict(saved, "hybrid")
    for name in ("devices_per_replica", "microbatches"):
        if name in saved:
            check_int(_key("hybrid", name), saved[name], minimum=1)
    sizes = saved.get("sizes")
    if sizes is not None:
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise ValueError(f"{_key('hybrid', 'sizes')} must be a list of stage sizes, got {sizes!r:.60}")
        for index, size in enumerate(sizes):
            check_int(_key("hybrid", "sizes", index), size, minimum=1)
    for name, value in saved.items():
        _check_plain(value, "hybrid", name)
