"""The machine checks of ``lightning-mgpu doctor``, one function each, and the :class:`Check` every check returns.

Versions (Python, torch, Lightning, CUDA, NCCL, driver), visible devices and
``CUDA_VISIBLE_DEVICES``, the distributed backends, ``/dev/shm`` and the open-file limit.
Each says ``ok``, ``warn`` or ``fail``, with one sentence on how to fix every warn and fail.
The shell's variables are checked in :mod:`lightning_mgpu.envcheck.variables`, the
multi-process all_reduce by the command (:mod:`lightning_mgpu.cli._allreduce`).

Only light imports at module level; torch and Lightning are imported inside the checks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

STATUSES = ("ok", "warn", "fail")
SHM_MIN_BYTES = 1 << 30
NOFILE_MIN = 4096


@dataclass
class Check:
    """One line of the doctor's report: ``fix`` is required for every ``warn`` and ``fail``."""

    name: str
    status: str
    value: str
    fix: Optional[str] = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.status != "ok" and not self.fix:
            raise ValueError(f"check {self.name!r}: a {self.status} needs a fix sentence")


SUPPORTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "torch": ((2, 11), (2, 16)),
    "lightning": ((2, 6), (2, 7)),
}
"""pyproject.toml's bounds (from, inclusive; to, exclusive): the releases the suite ran on
(docs/development.md, "Versions tested"); ``tests/unit/repo/test_compat.py`` keeps the two equal."""

EXCLUDED: dict[str, dict[tuple[int, int], str]] = {
    "torch": {
        (2, 12): "a thread that ran a backward aborts the process when it ends during interpreter "
        "shutdown (torch keeps a Python object in its thread-local storage; fixed in 2.13), and the "
        "pipeline's stage threads run backwards",
    },
}
"""Minors inside :data:`SUPPORTED` that pyproject.toml excludes (``!=2.12.*``), and why."""


def _outside_tested(name: str, version: str) -> Optional[str]:
    """The fix for a ``name`` release outside :data:`SUPPORTED` or in :data:`EXCLUDED`, or None."""
    (low, high) = SUPPORTED[name]
    excluded = EXCLUDED.get(name, {})
    major, minor = (int(p) for p in re.findall(r"\d+", version)[:2])
    major_minor = (major, minor)
    if low <= major_minor < high and major_minor not in excluded:
        return None
    spec = ",".join(
        [f"{name}>={low[0]}.{low[1]}"] + [f"!={a}.{b}.*" for a, b in sorted(excluded)] + [f"<{high[0]}.{high[1]}"]
    )
    first, last = f"{low[0]}.{low[1]}", f"{high[0]}.{high[1] - 1}"
    tested = first if first == last else f"{first} to {last}"
    if excluded:
        tested += " except " + ", ".join(f"{a}.{b}" for a, b in sorted(excluded))
    why = excluded.get(major_minor)
    reason = f"{version}: {why}" if why else f"{version} was not run"
    return f"pip install '{spec}' (lightning_mgpu is tested on {name} {tested}; {reason})"


def check_versions() -> list[Check]:
    import lightning
    import torch

    checks = [Check("python", "ok", f"{sys.version.split()[0]} ({sys.executable})")]
    torch_value = f"{torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'})"
    for name, value, version in (
        ("torch", torch_value, torch.__version__),
        ("lightning", lightning.__version__, lightning.__version__),
    ):
        fix = _outside_tested(name, version)
        checks.append(Check(name, "ok", value) if fix is None else Check(name, "warn", value, fix=fix))
    return checks


def _nvidia_smi(timeout: float = 5.0) -> Optional[list[list[str]]]:
    """Rows of (index, name, driver, memory) from nvidia-smi, or None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[part.strip() for part in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


def parse_visible_devices(value: Optional[str]) -> tuple[Optional[list[str]], Optional[str]]:
    """(entries, problem) of a CUDA_VISIBLE_DEVICES value: None = unset (every GPU)."""
    if value is None:
        return None, None
    entries = [e.strip() for e in value.split(",")] if value.strip() else []
    if any(e == "" for e in entries):
        return entries, f"CUDA_VISIBLE_DEVICES={value!r} has an empty entry"
    if len(set(entries)) != len(entries):
        return entries, f"CUDA_VISIBLE_DEVICES={value!r} lists a device twice"
    for entry in entries:
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            return entries, f"CUDA_VISIBLE_DEVICES={value!r}: {entry!r} is neither an index nor a GPU-/MIG- UUID"
    return entries, None


def check_devices(environ: Mapping[str, str]) -> list[Check]:
    import torch

    smi = _nvidia_smi()
    visible_value = environ.get("CUDA_VISIBLE_DEVICES")
    entries, problem = parse_visible_devices(visible_value)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    physical = len(smi) if smi is not None else None
    details = {
        "cuda_visible_devices": visible_value,
        "torch_device_count": count,
        "names": names,
        "nvidia_smi_gpus": physical,
    }
    checks = []
    cuda_value = torch.version.cuda or "none (CPU build of torch)"
    if torch.version.cuda is None and physical:
        checks.append(
            Check(
                "cuda",
                "warn",
                f"{cuda_value}; nvidia-smi sees {physical} GPU(s)",
                fix="install a CUDA build of torch (https://pytorch.org/get-started/locally/)",
            )
        )
    elif torch.version.cuda and physical and not torch.cuda.is_available():
        checks.append(
            Check(
                "cuda",
                "fail",
                f"CUDA {cuda_value} build, but torch cannot use the {physical} GPU(s)",
                fix="the driver is too old for this torch build or not loaded: update the NVIDIA driver, "
                "or install a torch build for the CUDA version nvidia-smi shows",
            )
        )
    else:
        checks.append(Check("cuda", "ok", cuda_value))
    nccl = "n/a"
    if count:
        try:
            version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # untyped in torch
            nccl = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
        except Exception as error:  # noqa: BLE001 - reported, not fatal
            nccl = f"unknown ({error})"
    checks.append(Check("nccl", "ok", nccl))
    driver = smi[0][2] if smi else ("no nvidia-smi" if smi is None else "nvidia-smi lists no GPU")
    checks.append(Check("driver", "ok", driver))

    described = f"{count} GPU(s){': ' + ', '.join(names) if names else ''}; CUDA_VISIBLE_DEVICES=" + (
        "unset" if visible_value is None else repr(visible_value)
    )
    device_fix = None
    if problem:
        device_fix = f"{problem}: set it to distinct GPU indices or UUIDs, e.g. CUDA_VISIBLE_DEVICES=0,1"
    elif entries == [] and physical:
        device_fix = (
            f"CUDA_VISIBLE_DEVICES is empty and hides all {physical} GPU(s): unset it "
            "(unless CPU training is what you want)"
        )
    elif physical is not None and entries is None and count < physical:
        device_fix = (
            f"torch sees {count} of the {physical} GPUs nvidia-smi lists: check the driver and "
            "that no other process holds them in exclusive mode"
        )
    if device_fix is not None:
        checks.append(Check("devices", "warn", described, details=details, fix=device_fix))
    else:
        checks.append(
            Check("devices", "ok", described + ("" if count else " (CPU processes will use gloo)"), details=details)
        )
    return checks


def check_backends(gpu_count: int) -> Check:
    import torch.distributed as dist

    if not dist.is_available():
        return Check(
            "backends",
            "fail",
            "torch.distributed is not available in this torch build",
            fix="install a torch build with distributed support (the official wheels have it)",
        )
    available = {
        name: bool(getattr(dist, f"is_{name}_available", lambda: False)()) for name in ("gloo", "nccl", "mpi", "ucc")
    }
    value = ", ".join(name for name, ok in available.items() if ok) or "none"
    if not available["gloo"]:
        return Check(
            "backends",
            "fail",
            value,
            details=available,
            fix="this torch build has no gloo: CPU training and CPU-side collectives need it; install an "
            "official torch wheel",
        )
    if gpu_count and not available["nccl"]:
        return Check(
            "backends",
            "warn",
            value,
            details=available,
            fix="GPUs without NCCL: gradients would go through gloo (slow); install a CUDA build with NCCL",
        )
    return Check("backends", "ok", value, details=available)


def check_shm(path: str = "/dev/shm") -> Check:
    try:
        stats = os.statvfs(path)
    except OSError:
        return Check("/dev/shm", "ok", f"{path} not present (not Linux?): DataLoader workers share memory otherwise")
    total, free = stats.f_frsize * stats.f_blocks, stats.f_frsize * stats.f_bavail
    value = f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)"
    details = {"total_bytes": total, "free_bytes": free}
    if total < SHM_MIN_BYTES:
        return Check(
            "/dev/shm",
            "warn",
            value,
            details=details,
            fix="DataLoader workers pass batches through /dev/shm and crash ('bus error') when it is full: "
            "give the container more (docker run --shm-size=16g, or --ipc=host)",
        )
    return Check("/dev/shm", "ok", value, details=details)


def check_open_files() -> Check:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return Check("open files", "ok", "n/a on this platform")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    value = f"soft {soft}, hard {hard if hard != resource.RLIM_INFINITY else 'unlimited'}"
    if soft != resource.RLIM_INFINITY and soft < NOFILE_MIN:
        target = hard if hard != resource.RLIM_INFINITY and hard < 65536 else 65536
        return Check(
            "open files",
            "warn",
            value,
            details={"soft": soft, "hard": hard},
            fix=f"DataLoader workers and NCCL open many descriptors ('Too many open files'): ulimit -n "
            f"{target} before training (or torch.multiprocessing.set_sharing_strategy('file_system'))",
        )
    return Check("open files", "ok", value, details={"soft": soft, "hard": hard})
