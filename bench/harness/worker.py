"""What every rank of a benchmark's launch runs around its fits: the clock, the Trainer, the end.

* :class:`StepTimer`: per-step wall time of a span marked with ``start()``/``stop()``: host
  clock on CPU, CUDA events on GPUs (no synchronisation inside the loop);
* :func:`time_each_step`: the callback that marks one Lightning training step, from the first
  ``on_train_batch_start`` to the first ``on_train_batch_end`` callback (first in the list:
  callback hooks run before the module's and the strategy's own hooks of the same name, so the
  span holds all of Lightning's per-step work), optionally reading the DDP buckets at the end;
* :func:`regression`: a LightningModule around a model and its loss, plain SGD, its losses kept
  (detached, read after the fit: no synchronisation per step);
* :func:`trainer`: a Trainer on the launch's ranks (``devices`` and ``num_nodes`` from
  torchrun's ``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE``) with nothing but training switched on: no
  progress bar, logger, checkpoints or model summary (we compare training loops, not console
  output or disk writes);
* :func:`start` and :func:`finish`: a worker's quiet start (threads pinned, Lightning's advice
  silenced) and its end (rank 0 writes the report to ``--worker-out``; the Lightning objects
  and the process group are freed before the interpreter exits, which could otherwise abort);
  :func:`run_plan`: a worker that runs a plan of fits, one after another.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

LEARNING_RATE = 0.01


def start(threads: int) -> None:
    """A worker's start: ``threads`` torch threads, warnings and Lightning's info lines off (not what we measure)."""
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(threads)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def finish(out: Optional[str | Path], report: Any) -> None:
    """Rank 0 writes ``report`` as JSON to ``out``; then free the (cyclic) Lightning objects and the group."""
    if rank() == 0 and out is not None:
        Path(out).write_text(json.dumps(report))
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_plan(
    args: Any,
    fit: Callable[[Any], dict[str, Any]],
    describe: Optional[Callable[[Any, dict[str, Any], float], str]] = None,
) -> None:
    """Every item of the plan file ``args.worker_plan`` (:func:`bench.harness.launch.launch_plan`) through ``fit``,
    in order, with ``args.threads`` torch threads (:func:`start`; if ``args`` has them); rank 0 prints
    ``describe(item, result, seconds)`` after each and writes the list of results to ``args.worker_out``."""
    if getattr(args, "threads", None) is not None:
        start(args.threads)
    results = []
    for item in json.loads(Path(args.worker_plan).read_text()):
        started = time.perf_counter()
        results.append(fit(item))
        gc.collect()  # the finished Trainer's (cyclic) objects, before the next fit
        if describe is not None and rank() == 0:
            print(describe(item, results[-1], time.perf_counter() - started), flush=True)
    finish(args.worker_out, results)


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


class StepTimer:
    """Wall time of each marked span, and of each whole iteration (one ``start`` to the next).

    On CPU it reads the host clock. On CUDA it records a pair of events per step and
    reads them once, after the loop: no ``synchronize`` inside the loop, which would stop
    the host from queueing the next step while the device works. An event pair measures
    the device timeline between the two points, host gaps included when the device is
    starved, so Python overhead in a loop still shows up.
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device or torch.device("cpu")
        self._cuda = self.device.type == "cuda"
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


def time_each_step(timer: StepTimer, *, layout: Optional[dict[str, Any]] = None) -> Any:
    """The callback that times each training step with ``timer``; with ``layout``, it stores the DDP
    buckets the fit ended with there (``layout["buckets"]``, read at train end: a strategy may release
    its DDP wrapper at teardown)."""
    import lightning as L

    class TimeEachStep(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            timer.start()

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            timer.stop()

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if layout is None:
                return
            ddp_model = trainer.strategy.model
            if not isinstance(ddp_model, DistributedDataParallel):
                raise RuntimeError(f"expected a DDP-wrapped model, got {type(ddp_model).__name__}")
            layout["buckets"] = ddp_bucket_layout(ddp_model)

    return TimeEachStep()


def regression(
    model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, lr: float = LEARNING_RATE
) -> Any:
    """A LightningModule training ``model`` (as ``self.net``) on ``(inputs, targets)`` batches with SGD;
    ``losses()`` gives every step's loss after the fit."""
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model
            self.step_losses: list[torch.Tensor] = []

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            loss = loss_fn(self.net(inputs), targets)
            self.step_losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr)

        def losses(self) -> list[float]:
            return [float(loss) for loss in self.step_losses]

    return Regression()


def trainer(
    strategy: Any, *, max_steps: int, callbacks: Sequence[Any], accelerator: str = "cpu", **options: Any
) -> Any:
    """A Trainer on this launch's ranks that trains ``max_steps`` steps and does nothing else."""
    import lightning as L

    local = int(os.environ["LOCAL_WORLD_SIZE"])
    settings: dict[str, Any] = dict(
        accelerator="cuda" if accelerator == "cuda" else "cpu",
        devices=local,
        num_nodes=int(os.environ["WORLD_SIZE"]) // local,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**settings, **options})


def quick_tuning(strategy: Any) -> None:
    """Smoke runs only: make ``bucket_cap_mb="auto"``'s search fit a few steps (never for real figures)."""
    assert strategy.tuner is not None
    strategy.tuner.settings = dataclasses.replace(
        strategy.tuner.settings, rounds=1, measure=1, settle=0, initial_warmup=0, min_run_multiple=1.0, extra_steps=0
    )
