"""Pipeline throughput: a compute-bound ``nn.Sequential`` split in 2 stages, M micro-batches.

    python -m bench.pipeline                 # full run (about 3 minutes on 2 cores)
    python -m bench.pipeline --quick         # smoke test
    python -m bench.pipeline --retain-freed-memory   # glibc keeps freed blocks (see below)

(from the repository root: see ``bench/__init__.py``).

On this 2-core machine a "device" is one CPU core: the unsplit model runs one training
step (forward + backward) with 1 intra-op thread; the pipeline runs the same model split
into K = 2 balanced stages (:func:`lightning_mgpu.placement.partition` on profiled
per-layer times), each stage in its own worker thread with 1 intra-op thread, for
M = 1, 2, 4, 8 micro-batches, under each schedule (``--schedules``): ``fill-drain`` (the
``nn.Sequential`` pipeline, loss outside it) and the staged pipeline's ``gpipe``, ``1f1b``
and ``zero_bubble`` (loss inside, :class:`lightning_mgpu.placement.staged.StagedStep`). Throughput is samples per second of training steps; the
speed-up is against the unsplit model, next to GPipe's bound ``M*K / (M + K - 1)``
(perfect balance, no overheads). The unsplit model with 2 intra-op threads (both cores
given to one device) is printed too, for honesty: it is what one would otherwise do with
two cores.

Micro-batching on CPU allocates large tensors per micro-batch (boundary activations and
their gradients; weight gradients too, for layers other than plain ``nn.Linear``, which
accumulate in place); with glibc's default settings large freed blocks go back to the OS and
come back as page faults (the "faults/step" column). ``--retain-freed-memory`` calls
:func:`bench.allocator.retain_freed_memory` first (for every
configuration alike), which is what a CPU user of the hybrid strategy would do.

Configurations are interleaved round by round (ABC ABC ...) and each figure is the median
over rounds of the median step time within a round. Writes ``bench/results/pipeline.json``.
Target (issue 5): at M = 8 at least 1.4x the unsplit model.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from bench.common import machine_facts, print_table, write_json
from bench.allocator import retain_freed_memory
from lightning_mgpu.placement.pipeline import Pipeline
from lightning_mgpu.placement.plan import plan_stages
from lightning_mgpu.placement.profile import profile_layers
from lightning_mgpu.placement.split_points import points_from_sizes
from lightning_mgpu.placement.staged import StagedStep

ROOT = Path(__file__).resolve().parents[1]

STAGES = 2
MICROBATCHES = (1, 2, 4, 8)


def make_model(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def split(model: nn.Sequential, sample: torch.Tensor, microbatches: int) -> tuple[list[int], Any]:
    torch.set_num_threads(1)
    micro = sample[: max(1, sample.shape[0] // microbatches)]
    plan = plan_stages(
        profile_layers(model, micro, repeats=3, warmup=1), ["cpu"] * STAGES, "time", microbatches=microbatches
    )
    return plan.sizes, plan


def stages_of(model: nn.Sequential, sizes: list[int]) -> list[nn.Sequential]:
    out, start = [], 0
    for size in sizes:
        out.append(model[start : start + size])
        start += size
    return out


def time_steps(step: Callable[[], None], steps: int) -> tuple[float, float]:
    step()  # warm-up
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.retain_freed_memory and not retain_freed_memory():
        print("warning: could not change the C allocator's settings (not glibc?)", file=sys.stderr)
    model = make_model(args.width, args.depth)
    x = torch.randn(args.batch, args.width)
    threads_before = torch.get_num_threads()

    def unsplit(threads: int) -> Callable[[], None]:
        def step() -> None:
            torch.set_num_threads(threads)
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

        return step

    configs: dict[str, Callable[[], None]] = {"unsplit, 1 core": unsplit(1), "unsplit, 2 threads": unsplit(2)}
    pipelines: dict[str, Any] = {}
    plans = {}
    names = [name for name, _ in model.named_children()]
    for m in args.microbatches:
        sizes, plan = split(model, x, m)
        plans[m] = plan
        for schedule in args.schedules:
            if schedule == "fill-drain":  # the nn.Sequential pipeline, loss outside it
                pipe: Any = Pipeline(stages_of(model, sizes), ["cpu"] * STAGES, microbatches=m, threads_per_stage=1)

                def step(pipe: Any = pipe) -> None:
                    torch.set_num_threads(1)
                    model.zero_grad(set_to_none=True)
                    pipe.forward(x).sum().backward()
                    pipe.backward()

            else:  # the staged pipeline (any module, loss inside): gpipe, 1f1b, zero_bubble
                pipe = StagedStep(
                    model, points_from_sizes(names, sizes), ["cpu"] * STAGES, schedule=schedule, microbatches=m,
                    threads_per_stage=1, loss_reduction="sum",
                )

                def step(pipe: Any = pipe) -> None:
                    torch.set_num_threads(1)
                    model.zero_grad(set_to_none=True)
                    pipe.run(lambda net, batch: net(batch).sum(), model, x).backward()
                    pipe.accumulate()

            configs[f"{schedule} M={m}"] = step
            pipelines[f"{schedule} M={m}"] = pipe
    torch.set_num_threads(threads_before)

    per_round: dict[str, list[float]] = {name: [] for name in configs}
    faults: dict[str, list[float]] = {name: [] for name in configs}
    for round_index in range(args.rounds):
        order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        for name in order:
            ms, page_faults = time_steps(configs[name], args.steps)
            per_round[name].append(ms)
            faults[name].append(page_faults)
        if not args.quiet:
            print(
                f"round {round_index + 1}/{args.rounds}: "
                + ", ".join(f"{n} {per_round[n][-1]:.1f} ms" for n in configs),
                flush=True,
            )
    for pipe in pipelines.values():
        pipe.close()
    plans = {m: plan for m, plan in plans.items()}

    base = statistics.median(per_round["unsplit, 1 core"])
    results = []
    for name in configs:
        ms = statistics.median(per_round[name])
        m = int(name.split("=")[1]) if " M=" in name else None
        results.append(
            {
                "config": name,
                "schedule": name.split(" M=")[0] if m else None,
                "microbatches": m,
                "step_ms": ms,
                "step_ms_rounds": per_round[name],
                "samples_per_s": args.batch / ms * 1e3,
                "speedup": base / ms,
                "gpipe_bound": (m * STAGES / (m + STAGES - 1)) if m else None,
                "plan_ideal_speedup": plans[m].ideal_speedup if m else None,
                "stage_sizes": plans[m].sizes if m else None,
                "page_faults_per_step": statistics.median(faults[name]),
            }
        )
    m8 = next((r for r in results if r["microbatches"] == 8 and r["schedule"] == "fill-drain"), None)
    payload = {
        "benchmark": "pipeline",
        "settings": vars(args),
        "machine": machine_facts(backend="none", world_size=1, device_type="cpu", threads_per_rank=1),
        "stages": STAGES,
        "results": results,
        "target": {
            "microbatches": 8,
            "min_speedup": 1.4,
            "speedup": m8 and m8["speedup"],
            "met": bool(m8 and m8["speedup"] >= 1.4),
        },
    }
    rows = [
        [
            r["config"],
            f"{r['step_ms']:.1f}",
            f"{r['samples_per_s']:.0f}",
            f"{r['speedup']:.2f}x",
            f"{r['gpipe_bound']:.2f}x" if r["gpipe_bound"] else "-",
            f"{r['plan_ideal_speedup']:.2f}x" if r["plan_ideal_speedup"] else "-",
            f"{r['page_faults_per_step']:.0f}",
        ]
        for r in results
    ]
    caption = (
        f"{args.depth} x (Linear {args.width} + GELU), batch {args.batch}, {args.rounds} interleaved rounds x {args.steps} steps; "
        "speed-up vs 'unsplit, 1 core' (one device)."
    )
    if m8:
        caption += f" Target at M=8: >= 1.40x -> {m8['speedup']:.2f}x ({'met' if m8['speedup'] >= 1.4 else 'NOT met'})."
    print_table(
        "Pipeline throughput, 2 stages on 2 CPU cores",
        ["config", "step ms", "samples/s", "speed-up", "GPipe bound", "plan ideal", "faults/step"],
        rows,
        caption=caption,
    )
    if args.out:
        print(f"wrote {write_json(args.out, payload)}")
    return payload


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8, help="number of Linear+GELU blocks")
    parser.add_argument("--batch", type=int, default=1024, help="samples per training step (split into micro-batches)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(MICROBATCHES))
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["fill-drain", "gpipe", "1f1b", "zero_bubble"],
        choices=["fill-drain", "gpipe", "1f1b", "zero_bubble"],
        help="fill-drain: the nn.Sequential pipeline (loss outside); the others: the staged pipeline (loss inside)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    parser.add_argument(
        "--out", default=str(ROOT / "bench" / "results" / "pipeline.json"), help="JSON path ('' to skip)"
    )
    parser.add_argument(
        "--retain-freed-memory",
        action="store_true",
        help="keep freed CPU memory for reuse (bench.allocator.retain_freed_memory), for every configuration",
    )
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.batch, args.rounds, args.steps = 64, 4, 64, 1, 2
        args.microbatches = [1, 2]
    for name in ("width", "depth", "batch", "rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(m < 1 for m in args.microbatches):
        parser.error(f"--microbatches must all be >= 1, got {args.microbatches}")
    return args


if __name__ == "__main__":
    main()
