"""What every benchmark in ``bench/`` shares: the 8M-parameter MLP, its data, and how we measure and report.

Keeping the model, data, clock and statistics in one place means that two benchmarks
(overhead, profiler cost, bucket tuning, ...) that say "the 8M MLP, batch 64" measure the
same thing in the same way:

* :func:`make_mlp` / :func:`make_data`: the model and a synthetic regression set, both
  built from fixed seeds in-process (no downloads).
* :class:`StepTimer`: per-step wall time of a span you mark with ``start()``/``stop()``,
  host clock on CPU and CUDA events on GPUs (no synchronisation inside the loop).
* :func:`summarize`, :func:`percentile`: median / p90 without numpy.
* :func:`ddp_bucket_layout`: the gradient buckets DDP actually built.
* :func:`worker_device`, :func:`backend_for`: a rank's device and process-group backend.
* :func:`load_recipe`: a recipe's Lightning script as a module (its model and data classes, not copies).
* :func:`machine_facts`, :func:`report_header`, :func:`write_json`, :func:`print_table`: the report.

Scripts import it as ``bench.common`` (they run as ``python -m bench.<script>`` from the
repository root).
"""

from __future__ import annotations

import importlib.util
import math
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

MLP_WIDTHS: tuple[int, ...] = (1024, 2048, 2048, 1024, 256)
"""Layer widths of "the 8M MLP": 8,656,128 parameters, 33 MiB of fp32 gradients.

The narrow last layer (256 x 1024 weights, exactly 1 MiB) fills DDP's 1 MiB first
bucket on its own, so the default layout is a real "small first bucket, then 25 MiB"
one rather than a first bucket swallowed by a wide layer.
"""
MODEL_SEED = 0
DATA_SEED = 1234
REPO_ROOT = Path(__file__).resolve().parents[1]


def make_mlp(widths: Sequence[int] = MLP_WIDTHS, *, seed: int = MODEL_SEED) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them (no dropout: nothing draws random numbers)."""
    if len(widths) < 2:
        raise ValueError(f"widths needs an input and an output width at least, got {tuple(widths)}")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # same initial weights in every process and every benchmark
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        if index:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    torch.random.set_rng_state(generator_state)
    return nn.Sequential(*layers)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def make_data(num_samples: int, widths: Sequence[int] = MLP_WIDTHS, *, seed: int = DATA_SEED) -> TensorDataset:
    """Inputs ~ N(0, 1) and targets from a fixed random teacher, so the loss can actually go down.

    Built with a private generator: making the data never moves torch's global RNG.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, widths[0], generator=generator)
    teacher = torch.randn(widths[0], widths[-1], generator=generator) / math.sqrt(widths[0])
    targets = torch.tanh(inputs @ teacher)
    return TensorDataset(inputs, targets)


class StepTimer:
    """Wall time of each marked span, and of each whole iteration (one ``start`` to the next).

    On CPU it reads the host clock. On CUDA it records a pair of events per step and
    reads them once, after the loop: no ``synchronize`` inside the loop, which would stop
    the host from queueing the next step while the device works. An event pair measures
    the device timeline between the two points, host gaps included when the device is
    starved, so Python overhead in a loop still shows up.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._starts: list[Any] = []
        self._stops: list[Any] = []
        self._cpu_starts: list[int] = []

    def start(self) -> None:
        self._starts.append(self._mark())
        self._cpu_starts.append(time.process_time_ns())

    def stop(self) -> None:
        self._stops.append(self._mark())

    def _mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def _elapsed_ms(self, begin: Any, end: Any) -> float:
        if self._cuda:
            return float(begin.elapsed_time(end))
        return (end - begin) / 1e6

    def step_ms(self, skip: int = 0) -> list[float]:
        """Duration of every span from ``start`` to ``stop``, the first ``skip`` left out."""
        if len(self._starts) != len(self._stops):
            raise RuntimeError(f"unbalanced timer: {len(self._starts)} starts, {len(self._stops)} stops")
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return [self._elapsed_ms(b, e) for b, e in zip(self._starts[skip:], self._stops[skip:])]

    def iteration_ms(self, skip: int = 0) -> list[float]:
        """Time from each ``start`` to the next: the span plus whatever the loop does between spans."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        starts = self._starts[skip:]
        return [self._elapsed_ms(b, e) for b, e in zip(starts[:-1], starts[1:])]

    def cpu_iteration_ms(self, skip: int = 0) -> list[float]:
        """CPU time this process used (every thread: gloo's included) from each ``start`` to the next."""
        starts = self._cpu_starts[skip:]
        return [(e - b) / 1e6 for b, e in zip(starts[:-1], starts[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": percentile(values, 50),
        "p90": percentile(values, 90),
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def ddp_bucket_layout(model: DistributedDataParallel) -> dict[str, Any]:
    """The gradient buckets DDP uses, in launch order: bytes and reducer parameter indices per bucket.

    These are the buckets DDP rebuilt at the start of the second iteration (the layout it keeps);
    before that, or when this torch does not tell, ``rebuilt: False`` and no buckets.
    """
    # DDP says its layout only through a private method: read through the package's one door to it.
    from lightning_mgpu._compat.torch import ddp_rebuilt_buckets

    layout = ddp_rebuilt_buckets(model)
    if layout is None:
        return {"rebuilt": False, "bucket_bytes": [], "bucket_param_indices": None}
    sizes, indices = layout
    return {"rebuilt": True, "bucket_bytes": sizes, "bucket_param_indices": indices}


def worker_device(accelerator: str) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) or the CPU."""
    if accelerator == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def backend_for(accelerator: str) -> str:
    """The process-group backend benchmarks use on ``accelerator``: NCCL on GPUs, gloo on CPU."""
    return "nccl" if accelerator == "cuda" else "gloo"


def load_recipe(name: str) -> ModuleType:
    """``recipes/<name>/train_lightning.py`` as a module, so benchmarks use its classes rather than copies."""
    path = REPO_ROOT / "recipes" / name / "train_lightning.py"
    if not path.is_file():
        known = sorted(entry.name for entry in path.parents[1].iterdir() if (entry / path.name).is_file())
        raise FileNotFoundError(f"no recipe {name!r}: {path} does not exist; the recipes are {known}")
    spec = importlib.util.spec_from_file_location(f"_recipe_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_facts(*, backend: str, world_size: int, device_type: str, threads_per_rank: int) -> dict[str, Any]:
    import lightning

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
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
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


def report_header(args: Any, configs: Sequence[str], *, rounds: Optional[int] = None) -> dict[str, Any]:
    """The machine and the settings every launch-based benchmark records (``rounds``: ``args.rounds`` by default)."""
    return {
        "machine": machine_facts(
            backend=backend_for(args.accelerator),
            world_size=args.nproc,
            device_type=args.accelerator,
            threads_per_rank=args.threads,
        ),
        "settings": {
            "configs": list(configs),
            "rounds": args.rounds if rounds is None else rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "batch_size_per_rank": args.batch_size,
        },
    }


def apply_quick(args: Any, argv: Optional[Sequence[str]], quick: dict[str, Any]) -> None:
    """``--quick``: set the smoke-run values of ``quick`` on ``args``, except flags given explicitly."""
    if not getattr(args, "quick", False):
        return
    given = {
        a.split("=")[0].lstrip("-").replace("-", "_")
        for a in (argv if argv is not None else sys.argv[1:])
        if a.startswith("--")
    }
    for name, value in quick.items():
        if name not in given:
            setattr(args, name, value)


def write_json(path: os.PathLike[str] | str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``path`` (parents created), via a temporary file so a crash never leaves half a file."""
    from lightning_mgpu.comm.allreduce_bench import write_report

    return write_report(payload, path)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    caption: Optional[str] = None,
    console: Optional[Console] = None,
) -> None:
    """A rich table; every column but the first right-aligned (they hold numbers)."""
    table = Table(title=title, caption=caption)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # piped to a file or a log: don't squeeze into 80 columns
    console.print(table)
