"""What every benchmark reports besides its figures: the machine, the settings, the JSON file and the table.

* :func:`machine_facts`: the machine and software a result was measured on (load average
  included: a shared machine says so);
* :func:`report_header`: machine and settings of a launch-based step-time comparison;
* :func:`write_json`: the report, written whole or not at all;
* :func:`print_table`: a rich table, numbers right-aligned;
* :func:`subplots` / :func:`save_figure`: a matplotlib figure drawn off-screen, and written.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_mgpu._tables import print_table  # noqa: F401  (the benches' tables are the package's)


def load_average() -> Optional[list[float]]:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_facts(*, backend: str, world_size: int, device_type: str, threads_per_rank: int) -> dict[str, Any]:
    import lightning
    import torch

    facts: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "backend": backend,
        "device_type": device_type,
        "world_size": world_size,
        "threads_per_rank": threads_per_rank,
        "load_average": load_average(),
    }
    if device_type == "cuda" and torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["cuda"] = torch.version.cuda
    try:
        import lightning_mgpu

        facts["lightning_mgpu"] = lightning_mgpu.__version__
    except ImportError:
        facts["lightning_mgpu"] = None
    return facts


def machine_of(args: Any) -> dict[str, Any]:
    """:func:`machine_facts` of a benchmark run with the launch options (:func:`bench.harness.cli.add_launch_options`)."""
    from bench.harness.worker import backend_for

    return machine_facts(
        backend=backend_for(args.accelerator),
        world_size=args.nproc,
        device_type=args.accelerator,
        threads_per_rank=args.threads,
    )


def report_header(args: Any, configs: Sequence[str], *, rounds: Optional[int] = None) -> dict[str, Any]:
    """The machine and the settings every launch-based benchmark records (``rounds``: ``args.rounds`` by default)."""
    return {
        "machine": machine_of(args),
        "settings": {
            "configs": list(configs),
            "rounds": args.rounds if rounds is None else rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "batch_size_per_rank": args.batch_size,
        },
    }


def write_json(path: os.PathLike[str] | str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``path`` (parents created), via a temporary file so a crash never leaves half a file."""
    from lightning_mgpu.comm.allreduce_bench import write_report

    return write_report(payload, path)


def subplots(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``matplotlib.pyplot.subplots`` on the off-screen backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig: Any, path: Path, *, dpi: int = 120) -> Path:
    """Lay ``fig`` out, write it to ``path`` (parents created) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
