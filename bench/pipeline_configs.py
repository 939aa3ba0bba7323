"""``bench.pipeline``'s configurations of ours: the unsplit model (whole batch, or micro-batches one after
another) and the pipeline under each schedule, the loss inside (the step runs per micro-batch), and, for the MLP,
under GPipe with the loss outside (the ``nn.Sequential`` pipelined as a module, as ``hybrid`` splits one), each with
its timed step and its untimed, metered step.

Each :class:`Config` carries ``step()`` (one training step, timed by :func:`time_steps`) and ``memory()``
(one more step under :class:`~bench.pipeline_memory.ActivationMeter`, returning each stage's peak of saved
activations). Plans come from :func:`make_plan`: K = 2 stages balanced by time measured on one micro-batch.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Callable, Optional

import torch

from bench.harness.stats import median
from bench.pipeline_memory import ActivationMeter
from bench.pipeline_models import BenchModel
from lightning_mgpu.placement.planning.plan import PlacementPlan, plan_stages
from lightning_mgpu.placement.planning.profile import profile_blocks, profile_layers
from lightning_mgpu.placement.planning.split_points import points_from_sizes
from lightning_mgpu.placement.running.engine import Pipeline
from lightning_mgpu.placement.running.microbatch import split_batch

STAGES = 2


class Config:
    """One timed configuration of ours: its step, how to measure its memory, its plan."""

    def __init__(
        self,
        name: str,
        step: Callable[[], None],
        memory: Callable[[], list[int]],
        *,
        schedule: Optional[str] = None,
        microbatches: Optional[int] = None,
        plan: Optional[PlacementPlan] = None,
        close: Callable[[], None] = lambda: None,
        loss: Optional[str] = None,
    ) -> None:
        self.name, self.step, self.memory, self.close = name, step, memory, close
        self.schedule, self.microbatches, self.plan = schedule, microbatches, plan
        self.loss = loss  # "inside" (the step runs per micro-batch) or "outside" (the module only), for pipelines


# ----------------------------------------------------------------------------- plans
def candidates_of(bench: BenchModel) -> list[str]:
    if bench.name == "mlp":
        return [name for name, _ in bench.model.named_children()]
    return [f"transformer.h.{i}" for i in range(len(bench.model.transformer.h))]  # type: ignore[union-attr, arg-type]


def make_plan(bench: BenchModel, microbatches: int) -> PlacementPlan:
    """K = 2 stages balanced by time measured on one micro-batch (layers of the MLP, blocks of the GPT)."""
    torch.set_num_threads(1)
    micro = bench.batch[: max(1, bench.batch.shape[0] // microbatches)]
    if bench.name == "mlp":
        layers = profile_layers(bench.model, micro, repeats=3, warmup=1)  # type: ignore[arg-type]
    else:
        step = bench.step_fn()
        layers = profile_blocks(bench.model, candidates_of(bench), lambda: step(bench.model, micro), repeats=3)
    return plan_stages(layers, ["cpu"] * STAGES, "time", microbatches=microbatches)


# ----------------------------------------------------------------------------- configurations
def unsplit(bench: BenchModel, threads: int, microbatches: int = 1) -> Config:
    """The unsplit model on ``threads`` intra-op threads; with ``microbatches`` > 1 (one thread), the batch run as
    that many micro-batches one after another: the work a pipeline of them has to do, without any pipeline (its
    cost over ``unsplit, 1 core`` is what smaller matrix products and gradient accumulation cost on this CPU)."""
    model, fn, x = bench.model, bench.step_fn(), bench.batch
    chunks, _ = split_batch(x, microbatches)  # cut as the pipeline cuts it (equal sizes within one sample)
    weights = [len(c) / len(x) if bench.loss_reduction == "mean" else 1.0 for c in chunks]

    def step() -> None:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
        for chunk, weight in zip(chunks, weights):
            (fn(model, chunk) * weight).backward()

    def memory() -> list[int]:
        meter = ActivationMeter(1, [*model.parameters(), x])
        with meter.recording(0):
            loss = fn(model, chunks[0])
        loss.backward()
        model.zero_grad(set_to_none=True)
        return meter.peak

    if microbatches == 1:
        return Config(f"unsplit, {threads} {'core' if threads == 1 else 'threads'}", step, memory)
    return Config(f"sequential M={microbatches}, 1 core", step, memory, microbatches=microbatches)


def loss_outside(bench: BenchModel, plan: PlacementPlan, m: int) -> Config:
    """GPipe with the loss outside the pipeline: the MLP's layers as the plan's stages (the ``hybrid`` strategy's
    split of an ``nn.Sequential``), its output's loss after the forwards, the stages' backward after that loss's."""
    model, x = bench.model, bench.batch
    chunks, start = [], 0
    for size in plan.sizes:
        chunks.append(torch.nn.Sequential(*list(model)[start : start + size]))  # type: ignore[call-overload]
        start += size
    stages = torch.nn.Sequential(*chunks)
    engine = Pipeline(stages, ["1"], ["cpu"] * STAGES, microbatches=m, threads_per_stage=1)

    def run(forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        torch.set_num_threads(1)
        model.zero_grad(set_to_none=True)
        engine.forward(forward, x).sum().backward()
        engine.backward()

    def memory() -> list[int]:
        meter = ActivationMeter(STAGES, [*model.parameters(), x])
        handle = stages[1].register_forward_pre_hook(lambda *_: meter.set_stage(1))

        def metered(batch: torch.Tensor) -> torch.Tensor:
            with meter.recording(0):
                return stages(batch)  # type: ignore[no-any-return]

        try:
            run(metered)
        finally:
            handle.remove()
        return meter.peak

    return Config(
        f"gpipe, loss outside M={m}",
        lambda: run(stages),
        memory,
        schedule="gpipe",
        microbatches=m,
        plan=plan,
        close=engine.close,
        loss="outside",
    )


def staged(bench: BenchModel, plan: PlacementPlan, schedule: str, m: int) -> Config:
    model, fn, x = bench.model, bench.step_fn(), bench.batch
    points = points_from_sizes(candidates_of(bench), plan.sizes)
    engine = Pipeline(
        model,
        points,
        ["cpu"] * STAGES,
        schedule=schedule,
        microbatches=m,
        threads_per_stage=1,
        loss_reduction=bench.loss_reduction,
    )

    def step() -> None:
        torch.set_num_threads(1)
        model.zero_grad(set_to_none=True)
        engine.run(fn, model, x).backward()
        engine.backward()

    def memory() -> list[int]:
        meter = ActivationMeter(STAGES, [*model.parameters(), x])
        handles = [
            model.get_submodule(point).register_forward_pre_hook(lambda *_, j=j: meter.set_stage(j))
            for j, point in enumerate(points, start=1)
        ]

        def metered(net: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
            with meter.recording(0):
                return fn(net, batch)

        try:
            model.zero_grad(set_to_none=True)
            engine.run(metered, model, x).backward()
            engine.backward()
        finally:
            for handle in handles:
                handle.remove()
        return meter.peak

    return Config(
        f"{schedule} M={m}",
        step,
        memory,
        schedule=schedule,
        microbatches=m,
        plan=plan,
        close=engine.close,
        loss="inside",
    )


def configs_for(bench: BenchModel, args: argparse.Namespace) -> list[Config]:
    configs = [unsplit(bench, 1), unsplit(bench, 2)]
    for m in args.microbatches:
        plan = make_plan(bench, m)
        if m > 1:
            configs.append(unsplit(bench, 1, m))
        for schedule in args.schedules:
            if schedule == "gpipe" and bench.name == "mlp" and args.loss_outside:  # an nn.Sequential's pipeline
                configs.append(loss_outside(bench, plan, m))
            configs.append(staged(bench, plan, schedule, m))
    return configs


def time_steps(step: Callable[[], None], steps: int) -> tuple[float, float, float]:
    """Median step ms, page faults per step, and median CPU ms per step (all of this process's threads)."""
    step()  # warm-up
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    per_step_faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    return median(times) * 1e3, per_step_faults, median(cpu) * 1e3
