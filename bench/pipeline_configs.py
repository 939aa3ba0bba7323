"""``bench.pipeline``'s configurations of ours: the unsplit model (whole batch, or micro-batches one after
another), the fill-drain ``nn.Sequential`` pipeline and the staged pipeline under each schedule, each with its
timed step and its untimed, metered step.

Each :class:`Config` carries ``step()`` (one training step, timed by :func:`time_steps`) and ``memory()``
(one more step under :class:`~bench.pipeline_memory.ActivationMeter`, returning each stage's peak of saved
activations). Plans come from :func:`make_plan`: K = 2 stages balanced by time measured on one micro-batch.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Callable, Optional

import torch

from bench.pipeline_memory import ActivationMeter, Metered
from bench.pipeline_models import BenchModel
from lightning_mgpu.placement.planning.block_profile import profile_blocks
from lightning_mgpu.placement.running.microbatch import scatter
from lightning_mgpu.placement.pipeline import Pipeline
from lightning_mgpu.placement.planning.plan import PlacementPlan, plan_stages
from lightning_mgpu.placement.planning.profile import profile_layers
from lightning_mgpu.placement.planning.split_points import points_from_sizes

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
    ) -> None:
        self.name, self.step, self.memory, self.close = name, step, memory, close
        self.schedule, self.microbatches, self.plan = schedule, microbatches, plan


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
    chunks = scatter(x, microbatches)  # cut as the pipelines cut it (tensor_split: equal sizes within one sample)
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


def fill_drain(bench: BenchModel, plan: PlacementPlan, m: int) -> Config:
    model, x = bench.model, bench.batch

    def stages(meter: Optional[ActivationMeter] = None) -> list[torch.nn.Module]:
        out, start = [], 0
        for j, size in enumerate(plan.sizes):
            part = model[start : start + size]  # type: ignore[index]
            out.append(part if meter is None else Metered(part, meter, j))
            start += size
        return out

    pipe = Pipeline(stages(), ["cpu"] * STAGES, microbatches=m, threads_per_stage=1)

    def run(engine: Pipeline) -> None:
        torch.set_num_threads(1)
        model.zero_grad(set_to_none=True)
        engine.forward(x).sum().backward()
        engine.backward()

    def memory() -> list[int]:
        meter = ActivationMeter(STAGES, [*model.parameters(), x])
        metered = Pipeline(stages(meter), ["cpu"] * STAGES, microbatches=m, threads_per_stage=1)
        try:
            run(metered)  # the stages wrapped: the nn.Linear fast path is off here (same saved tensors)
        finally:
            metered.close()
        return meter.peak

    return Config(
        f"fill-drain M={m}",
        lambda: run(pipe),
        memory,
        schedule="fill-drain",
        microbatches=m,
        plan=plan,
        close=pipe.close,
    )


def staged(bench: BenchModel, plan: PlacementPlan, schedule: str, m: int) -> Config:
    from lightning_mgpu.placement.running.engine import StagedStep

    model, fn, x = bench.model, bench.step_fn(), bench.batch
    points = points_from_sizes(candidates_of(bench), plan.sizes)
    engine = StagedStep(
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
        engine.accumulate()

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
            engine.accumulate()
        finally:
            for handle in handles:
                handle.remove()
        return meter.peak

    return Config(f"{schedule} M={m}", step, memory, schedule=schedule, microbatches=m, plan=plan, close=engine.close)


def configs_for(bench: BenchModel, args: argparse.Namespace) -> list[Config]:
    configs = [unsplit(bench, 1), unsplit(bench, 2)]
    for m in args.microbatches:
        plan = make_plan(bench, m)
        if m > 1:
            configs.append(unsplit(bench, 1, m))
        for schedule in args.schedules:
            if schedule == "fill-drain":
                if bench.name == "mlp":  # the nn.Sequential pipeline takes an nn.Sequential only
                    configs.append(fill_drain(bench, plan, m))
            else:
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
    return statistics.median(times) * 1e3, per_step_faults, statistics.median(cpu) * 1e3
