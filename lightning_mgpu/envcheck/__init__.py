"""The machine check ``lightning-mgpu doctor`` (not the ``DistributedDoctor`` callback): is this machine ready?

Is this machine (and this shell) ready for multi-process training? :func:`collect` runs every check and returns a list of :class:`Check`; :func:`report` turns it
into the JSON the command prints with ``--json``::

    {"version": 1, "status": "ok"|"warn"|"fail", "elapsed_s": float,
     "counts": {"ok": int, "warn": int, "fail": int},
     "checks": [{"name": str, "status": str, "value": str, "fix": str|null, "details": {...}}, ...]}

What it checks: versions (Python, torch, Lightning, CUDA, NCCL, driver), whether torchvision (if
installed) pairs with torch (a mismatched one breaks ``import lightning``), visible devices and
``CUDA_VISIBLE_DEVICES``, the distributed backends, a real 2-process gloo all_reduce over
127.0.0.1 (and an NCCL one across every GPU when there are at least 2: the check that starts
those processes is the command's, :mod:`lightning_mgpu.cli._allreduce`), the launcher
environment (torchrun, SLURM or none), ``MASTER_ADDR``/``MASTER_PORT``, ``/dev/shm``, the
open-file limit and the distributed-related environment variables (values that look like
secrets are masked: API keys, tokens, passwords).

* :mod:`~lightning_mgpu.envcheck.checks`: :class:`Check` and the machine checks;
* :mod:`~lightning_mgpu.envcheck.packages`: torch and torchvision pairing (versions and builds);
* :mod:`~lightning_mgpu.envcheck.variables`: the shell's variables (launcher, master, secrets masked);
* :mod:`~lightning_mgpu.envcheck.nodes`: every node's checks as one report (the command started on
  every node by ``srun`` or ``torchrun``: :mod:`lightning_mgpu.cli._across_nodes`).

Only light imports at module level (``lightning-mgpu doctor --help`` imports this package);
torch and Lightning are imported when the checks run. The ``DistributedDoctor`` callback, which
watches a run as it trains, is :mod:`lightning_mgpu.callbacks.doctor`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Mapping, Optional

from lightning_mgpu.envcheck.checks import (
    STATUSES,
    Check,
    check_backends,
    check_devices,
    check_open_files,
    check_shm,
    check_versions,
    parse_visible_devices,
)
from lightning_mgpu.envcheck.packages import check_torchvision
from lightning_mgpu.envcheck.variables import (
    check_environment,
    check_master,
    detect_launcher,
    looks_secret,
    mask,
    relevant_environment,
)


def collect(
    environ: Mapping[str, str],
    *,
    smoke: Optional[Callable[[str, int], Check]] = None,
    allreduce_placeholder: bool = True,
) -> list[Check]:
    """Every check, in the order the table shows them; ``smoke(backend, world_size)``: the multi-process all_reduce
    check (None: skipped, and said so unless ``allreduce_placeholder`` is False: across nodes, the command puts the
    world's all_reduce there instead)."""
    import torch

    vision = check_torchvision()  # before Lightning is imported: a mismatched torchvision breaks that import
    try:
        checks = check_versions()
    except Exception as error:  # noqa: BLE001 - the report must come out whatever broke the import
        fix = vision.fix or "pip install --force-reinstall lightning, then run lightning-mgpu doctor again"
        checks = [Check("lightning", "fail", f"import lightning fails: {str(error)[:200]}", fix=fix)]
    checks.append(vision)
    checks += check_devices(environ)
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks.append(check_backends(gpu_count))
    if smoke is not None:
        checks.append(smoke("gloo", 2))
        if gpu_count >= 2 and torch.distributed.is_nccl_available():
            checks.append(smoke("nccl", gpu_count))
        else:
            checks.append(Check("nccl all_reduce", "ok", f"not run: needs 2 or more GPUs ({gpu_count} visible)"))
    elif allreduce_placeholder:
        checks.append(Check("all_reduce", "ok", "not run (--skip-allreduce)"))
    checks.append(detect_launcher(environ))
    checks.append(check_master(environ))
    checks.append(check_shm())
    checks.append(check_open_files())
    checks.append(check_environment(environ))
    return checks


def report(checks: list[Check], elapsed_s: float) -> dict[str, Any]:
    """The JSON form of ``checks`` (the schema above): the worst status decides the overall one."""
    counts = {status: sum(c.status == status for c in checks) for status in STATUSES}
    status = "fail" if counts["fail"] else "warn" if counts["warn"] else "ok"
    return {
        "version": 1,
        "status": status,
        "elapsed_s": elapsed_s,
        "counts": counts,
        "checks": [asdict(c) for c in checks],
    }


__all__ = [
    "STATUSES",
    "Check",
    "check_backends",
    "check_devices",
    "check_environment",
    "check_master",
    "check_open_files",
    "check_shm",
    "check_torchvision",
    "check_versions",
    "collect",
    "detect_launcher",
    "looks_secret",
    "mask",
    "parse_visible_devices",
    "relevant_environment",
    "report",
]
