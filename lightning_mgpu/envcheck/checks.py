"""The environment checks of ``lightning-mgpu doctor``, one function each, and the :class:`Check` they return.

Each check looks at one thing (versions, devices, backends, the launcher's variables,
``MASTER_ADDR``/``MASTER_PORT``, ``/dev/shm``, the open-file limit, the distributed-related
environment variables) and says ``ok``, ``warn`` or ``fail``, with one sentence on how to fix
every warn and fail. Values that look like secrets are masked. The multi-process all_reduce
check is :mod:`lightning_mgpu.envcheck.smoke`.

Only light imports at module level; torch and Lightning are imported inside the checks.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

STATUSES = ("ok", "warn", "fail")
SHM_MIN_BYTES = 1 << 30
NOFILE_MIN = 4096
# Launcher variables: a stale one in the shell confuses every launcher.
LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
ENV_PREFIXES = ("CUDA_", "NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_", "MASTER_", "PL_", "WANDB_", "OMP_", "MKL_")
ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
SLURM_NAMES = (
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES",
    "SLURM_GPUS_ON_NODE",
    "SLURM_STEP_ID",
)
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION|SIGNATURE|PRIVATE", re.IGNORECASE)
_SECRET_VALUE = re.compile(r"[A-Za-z0-9+/=_\-]{20,}")


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


# --------------------------------------------------------------------------- secrets


def looks_secret(name: str, value: str) -> bool:
    """A variable whose name says secret (``*_KEY``, ``*TOKEN*``, ...) or whose value looks like one: a
    run of 20+ key-alphabet characters mixing letters and digits (hex keys, base64, the parts of a JWT).
    Paths and host names (short dot-separated labels) are left readable; masking too much is the safe side."""
    if _SECRET_NAME.search(name):
        return True
    if value.startswith(("/", ".", "~")) or any(c.isspace() for c in value):
        return False
    for part in re.split(r"[.:,@]", value):
        if _SECRET_VALUE.fullmatch(part) and any(c.isdigit() for c in part) and any(c.isalpha() for c in part):
            return True
    return False


def mask(name: str, value: str) -> str:
    return f"****({len(value)} chars)" if value and looks_secret(name, value) else value


def relevant_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The distributed-related variables of ``environ``, secrets masked."""
    shown = {}
    for name in sorted(environ):
        if name.startswith(ENV_PREFIXES) or name in ENV_NAMES or name in SLURM_NAMES:
            shown[name] = mask(name, environ[name])
    return shown


# --------------------------------------------------------------------------- individual checks


def check_versions() -> list[Check]:
    import lightning
    import torch

    checks = [
        Check("python", "ok", f"{sys.version.split()[0]} ({sys.executable})"),
        Check(
            "torch",
            "ok",
            f"{torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'})",
        ),
    ]
    major_minor = tuple(int(p) for p in re.findall(r"\d+", lightning.__version__)[:2])
    if major_minor < (2, 4):
        checks.append(
            Check(
                "lightning",
                "warn",
                lightning.__version__,
                fix="pip install 'lightning>=2.4' (this package needs Lightning 2.4 or newer)",
            )
        )
    else:
        checks.append(Check("lightning", "ok", lightning.__version__))
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
    if problem:
        checks.append(
            Check(
                "devices",
                "warn",
                described,
                details=details,
                fix=f"{problem}: set it to distinct GPU indices or UUIDs, e.g. CUDA_VISIBLE_DEVICES=0,1",
            )
        )
    elif entries == [] and physical:
        checks.append(
            Check(
                "devices",
                "warn",
                described,
                details=details,
                fix=f"CUDA_VISIBLE_DEVICES is empty and hides all {physical} GPU(s): unset it "
                "(unless CPU training is what you want)",
            )
        )
    elif physical is not None and entries is None and count < physical:
        checks.append(
            Check(
                "devices",
                "warn",
                described,
                details=details,
                fix=f"torch sees {count} of the {physical} GPUs nvidia-smi lists: check the driver and "
                "that no other process holds them in exclusive mode",
            )
        )
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


def detect_launcher(environ: Mapping[str, str]) -> Check:
    present = {k: environ[k] for k in (*ENV_NAMES, "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID") if k in environ}
    slurm = {k: environ[k] for k in SLURM_NAMES if k in environ}
    details = {"variables": {k: mask(k, v) for k, v in {**present, **slurm}.items()}}

    def to_int(name: str) -> Optional[int]:
        try:
            return int(environ[name])
        except (KeyError, ValueError):
            return None

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        if name in environ and to_int(name) is None:
            return Check(
                "launcher",
                "fail",
                f"{name}={environ[name]!r} is not an integer",
                details=details,
                fix=f"unset {name} (a launcher sets it) or give it a whole number",
            )
    rank, world = to_int("RANK"), to_int("WORLD_SIZE")
    if rank is not None and world is not None and not 0 <= rank < world:
        return Check(
            "launcher",
            "fail",
            f"RANK={rank} outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})",
            details=details,
            fix="unset RANK and WORLD_SIZE in this shell; torchrun or SLURM set them per process",
        )
    if "TORCHELASTIC_RUN_ID" in environ or (rank is not None and "LOCAL_RANK" in environ):
        return Check("launcher", "ok", f"torchrun (rank {rank} of {world})", details=details)
    if slurm:
        ntasks = int(slurm.get("SLURM_NTASKS", "1") or 1)
        if "SLURM_PROCID" not in slurm and ntasks > 1:
            return Check(
                "launcher",
                "warn",
                f"SLURM job {slurm.get('SLURM_JOB_ID')} with {ntasks} tasks, but this process was not started by srun",
                details=details,
                fix="start training with srun (srun python train.py ...): Lightning takes ranks from "
                "srun's SLURM_PROCID/SLURM_LOCALID",
            )
        return Check("launcher", "ok", f"SLURM (job {slurm.get('SLURM_JOB_ID')}, {ntasks} task(s))", details=details)
    stale = {k: v for k, v in present.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}  # those two: see "master"
    if stale:
        names = ", ".join(sorted(stale))
        return Check(
            "launcher",
            "warn",
            f"no launcher, but {names} set in the environment",
            details=details,
            fix=f"unset {names} unless you start the ranks yourself: stale values make Lightning and "
            "torchrun join the wrong job or wait for ranks that never come",
        )
    return Check("launcher", "ok", "none (plain process: Lightning starts the ranks itself)", details=details)


def _resolve(host: str, timeout: float = 2.0) -> Optional[list[str]]:
    """Addresses of ``host``, or None if it cannot be resolved within ``timeout`` seconds."""
    result: list[Optional[list[str]]] = [None]

    def work() -> None:
        try:
            result[0] = sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None)})
        except OSError:
            result[0] = None

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0]


def _is_local(addresses: list[str]) -> bool:
    local = {"127.0.0.1", "::1"}
    local.update(_resolve(socket.gethostname(), 1.0) or [])
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in local for a in addresses)


def check_master(environ: Mapping[str, str], port_in_use: Optional[Callable[[int], bool]] = None) -> Check:
    addr, port_text = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    details: dict[str, Any] = {"MASTER_ADDR": addr, "MASTER_PORT": port_text}
    if addr is None and port_text is None:
        return Check(
            "master", "ok", "MASTER_ADDR/MASTER_PORT unset (torchrun or Lightning choose them)", details=details
        )
    port: Optional[int] = None
    if port_text is not None:
        try:
            port = int(port_text)
        except ValueError:
            port = None
        if port is None or not 1 <= port <= 65535:
            return Check(
                "master",
                "fail",
                f"MASTER_PORT={port_text!r} is not a port number",
                details=details,
                fix="set MASTER_PORT to a free port between 1024 and 65535 (e.g. 29500), or unset it",
            )
    if addr is not None:
        addresses = _resolve(addr)
        if addresses is None:
            return Check(
                "master",
                "fail",
                f"MASTER_ADDR={addr!r} does not resolve",
                details=details,
                fix="set MASTER_ADDR to the rank-0 node's hostname or IP address, reachable from every node",
            )
        details["addresses"] = addresses
    value = f"MASTER_ADDR={addr!r}, MASTER_PORT={port_text!r}"
    if addr is None or port is None:
        missing = "MASTER_PORT" if port is None else "MASTER_ADDR"
        return Check(
            "master",
            "warn",
            value,
            details=details,
            fix=f"{missing} is unset while the other is set: set both (rank 0's address and a free port) or neither",
        )
    if port < 1024:
        return Check(
            "master",
            "warn",
            value + " (a privileged port)",
            details=details,
            fix=f"port {port} needs root to listen on: pick one between 1024 and 65535 (e.g. 29500)",
        )
    inside_job = "RANK" in environ or "SLURM_PROCID" in environ
    if not inside_job and _is_local(details.get("addresses", [])):
        in_use = (port_in_use or _port_in_use)(port)
        if in_use:
            return Check(
                "master",
                "warn",
                value + " (in use on this machine)",
                details=details,
                fix=f"port {port} is taken (another job's rendezvous?): pick a free one or unset MASTER_PORT",
            )
    return Check("master", "ok", value, details=details)


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


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


def check_environment(environ: Mapping[str, str]) -> Check:
    shown = relevant_environment(environ)
    value = ", ".join(f"{k}={v}" for k, v in shown.items()) or "no distributed-related variables set"
    slow = {
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
        "CUDA_LAUNCH_BLOCKING": "1",
    }
    set_slow = [f"{k}={environ[k]}" for k, v in slow.items() if environ.get(k, "").upper() == v]
    if set_slow:
        return Check(
            "environment",
            "warn",
            value,
            details={"variables": shown},
            fix=f"{', '.join(set_slow)} slows training (debugging settings): unset them for real runs",
        )
    return Check("environment", "ok", value, details={"variables": shown})
