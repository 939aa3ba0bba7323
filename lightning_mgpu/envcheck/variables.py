"""The shell's side of ``lightning-mgpu doctor``: launcher variables, ``MASTER_ADDR``/``MASTER_PORT``, the rest.

Which launcher started this process (torchrun, SLURM or none) and whether stale launcher
variables are left in the shell; whether ``MASTER_ADDR`` resolves and ``MASTER_PORT`` is
usable; which distributed-related variables are set (those that slow training are named).
Values that look like secrets (API keys, tokens, passwords) are masked wherever they are shown.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
from typing import Any, Callable, Mapping, Optional

from lightning_mgpu.envcheck.checks import Check

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


_URL_CREDENTIALS = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:@/\s]*)(?::(?P<password>[^@/\s]*))?@"
)


def mask_url_credentials(value: str) -> str:
    """``https://alice:hunter2@host`` -> ``https://alice:****@host``; a user name alone (``git@``-style
    tokens put the secret there: ``https://ghp_xxx@github.com``) is masked too unless it is short and plain."""

    def hide(match: re.Match[str]) -> str:
        user, password = match["user"], match["password"]
        if password is not None:
            return f"{match['scheme']}{user}:****@"
        return f"{match['scheme']}****@" if looks_secret("", user) or len(user) > 16 else match[0]

    return _URL_CREDENTIALS.sub(hide, value)


def mask(name: str, value: str) -> str:
    """``value`` as it may be shown: fully masked if it looks secret, else with URL credentials masked."""
    if value and looks_secret(name, value):
        return f"****({len(value)} chars)"
    return mask_url_credentials(value)


def relevant_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The distributed-related variables of ``environ``, secrets masked."""
    shown = {}
    for name in sorted(environ):
        if name.startswith(ENV_PREFIXES) or name in ENV_NAMES or name in SLURM_NAMES:
            shown[name] = mask(name, environ[name])
    return shown


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
