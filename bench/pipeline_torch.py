"""``bench.pipeline``'s reference: the same models, batch and M under ``torch.distributed.pipelining`` on 2 gloo ranks.

Launched by :mod:`bench.pipeline` through :func:`bench.harness.launch.launch` (one launch per
round, so torch's configurations are interleaved with ours round by round)::

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m bench.pipeline_torch \\
        --config CONFIG.json --worker-out REPORT.json

Each rank is one stage (one process, one intra-op thread, like one of our stage threads):
``PipelineStage`` on the stage module of :func:`bench.pipeline_models.torch_stage` (the
MLP's layers by the same plan as ours, the GPT's two halves at the same block), and
``ScheduleGPipe`` / ``Schedule1F1B`` with ``n_microbatches=M``, the same loss and its
reduction (``scale_grads`` for a mean); ``Schedule1F1B`` refuses M < 2, so it has no M = 1
row. A step is timed between two barriers, so it is
the slower rank's step. With ``measure_memory``, two more untimed steps run each stage
under :class:`bench.pipeline_memory.ActivationMeter` (the first, where a new stage infers
its shapes, is not counted) and rank 0 gathers the peaks.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from bench.allocator import retain_freed_memory
from bench.pipeline_memory import ActivationMeter, Metered
from bench.pipeline_models import BenchModel, build, torch_stage

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
NUM_STAGES = 2


def _step_fn(bench: BenchModel, stage_module: torch.nn.Module, schedule: str, m: int, rank: int) -> Callable[[], None]:
    stage = PipelineStage(stage_module, rank, NUM_STAGES, torch.device("cpu"))
    runner = SCHEDULES[schedule](
        stage, n_microbatches=m, loss_fn=bench.loss, scale_grads=bench.loss_reduction == "mean"
    )
    batch = bench.batch

    def step() -> None:
        stage_module.zero_grad(set_to_none=True)
        if rank == 0:
            runner.step(batch)
        else:
            runner.step(target=batch, losses=[])

    return step


def _timed(step: Callable[[], None], steps: int) -> list[float]:
    step()  # warm-up (and torch's shape inference)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run(config: dict[str, Any]) -> Optional[dict[str, Any]]:
    rank = dist.get_rank()
    torch.set_num_threads(1)
    rows = []
    for name in config["models"]:
        bench = build(name, config["settings"][name])
        for m in config["microbatches"]:
            sizes: list[int] = config["sizes"][name][str(m)]
            for schedule in config["schedules"]:
                if schedule == "1f1b" and m < NUM_STAGES:
                    continue  # torch's Schedule1F1B refuses fewer micro-batches than stages
                stage_module = torch_stage(bench, rank, sizes)
                times = _timed(_step_fn(bench, stage_module, schedule, m, rank), config["steps"])
                peaks: Optional[list[int]] = None
                if config["measure_memory"]:
                    meter = ActivationMeter(1, [*bench.model.parameters(), bench.batch])
                    metered = _step_fn(bench, Metered(stage_module, meter, 0), schedule, m, rank)
                    metered()  # a new PipelineStage infers its shapes in its first step: not counted
                    meter.reset_peak()
                    metered()
                    gathered: list[Any] = [None] * NUM_STAGES
                    dist.all_gather_object(gathered, meter.peak[0])
                    peaks = [int(value) for value in gathered]
                rows.append(
                    {
                        "model": name,
                        "schedule": schedule,
                        "microbatches": m,
                        "step_ms": times,
                        "peak_activation_bytes": peaks,
                    }
                )
    return {"rows": rows} if rank == 0 else None


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="JSON written by bench.pipeline")
    parser.add_argument("--worker-out", required=True, help="where rank 0 writes its report")
    args = parser.parse_args(argv)
    config = json.loads(Path(args.config).read_text())
    if config.get("retain_freed_memory"):
        retain_freed_memory()
    dist.init_process_group("gloo")
    try:
        report = run(config)
        if report is not None:
            Path(args.worker_out).write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
