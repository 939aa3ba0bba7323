"""Pipeline throughput and activation memory: our schedules against the unsplit model and torch's pipelining.

    python -m bench.pipeline                 # full run: MLP and GPT, M = 1, 2, 4, 8 (quiet machine, ~15 min on 2 cores)
    python -m bench.pipeline --quick         # smoke test
    python -m bench.pipeline --models mlp --microbatches 8 --retain-freed-memory   # the issue's targets only

(from the repository root: see ``bench/__init__.py``). Parts: :mod:`bench.pipeline_models` (the models),
:mod:`bench.pipeline_configs` (our configurations), :mod:`bench.pipeline_memory` (the activation meter),
:mod:`bench.pipeline_torch` (torch's pipelining, launched).

On this 2-core machine a "device" is one CPU core. Two models (:mod:`bench.pipeline_models`):
the 8 x ``Linear(1024)`` + GELU MLP and a GPT-2-style transformer (tied embeddings). Each
runs, with the same batch and loss:

* unsplit, one intra-op thread (the speed-up's reference: one device), and with 2 threads
  (both cores given to one device: what one would otherwise do with two cores);
* split into K = 2 stages by the plan (the MLP's layers and the GPT's blocks measured on one
  micro-batch by the one profiler, :mod:`lightning_mgpu.placement.planning.profile`), each
  stage one worker thread with one intra-op thread, for each M of ``--microbatches`` and each
  schedule, ``gpipe``, ``1f1b``, ``zero_bubble``, of the pipeline engine
  (:class:`~lightning_mgpu.placement.running.engine.Pipeline`) with the loss inside (the step
  runs per micro-batch; the GPT cut at a split point of the unmodified model), and, for the
  MLP, ``gpipe, loss outside``: the same engine and schedule with the ``nn.Sequential``
  pipelined as a module and its loss after it, as ``hybrid`` splits an ``nn.Sequential``
  (``--no-loss-outside`` leaves it out);
* ``torch gpipe`` / ``torch 1f1b``: ``torch.distributed.pipelining``'s ``ScheduleGPipe`` /
  ``Schedule1F1B`` on 2 gloo ranks of one thread each, the same stages and M
  (:mod:`bench.pipeline_torch`), launched once per round.

Throughput is samples per second of training steps; the speed-up is against the unsplit
model on one core, next to GPipe's bound ``M*K / (M + K - 1)`` and the 2-core ceiling: ``K``
times the unsplit step over ``sequential M=m, 1 core`` (the same model running the batch as
``m`` micro-batches one after another), i.e. what K cores could give if each were busy all
the time with its share of the micro-batched work. "CPU ms/step" is this process's CPU time
per step, all threads (torch's ranks are other processes: not counted). Configurations are
interleaved round by round (ABC CBA ..., the package's alternating order; torch's launch last
in each round) and each figure is the median over rounds of the median step time within a round.

Peak activation memory per stage is MEASURED for every configuration in one extra,
untimed step (:mod:`bench.pipeline_memory`: live bytes of the tensors autograd saves for
backward, per stage, through ``saved_tensors_hooks``), beside the plan's estimate (one
micro-batch's saved activations per stage, profiled, times the most micro-batches the
schedule keeps in flight on that stage: ``PlacementPlan.peak_activation_bytes``).

Micro-batching on CPU allocates large tensors per micro-batch; with glibc's defaults large
freed blocks go back to the OS and come back as page faults (the "faults/step" column).
``--retain-freed-memory`` calls :func:`bench.allocator.retain_freed_memory` first, for every
configuration alike (torch's ranks too), which is what a CPU user of the pipeline would do.

Targets (issue 16, MLP at M = 8, K = 2): ``zero_bubble`` >= 1.70x the unsplit model;
``1f1b``'s peak activation memory <= 40% of ``gpipe``'s with throughput within 5%; ours >=
torch's pipelining for the same schedule (MLP and GPT). Writes ``bench/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from bench.allocator import retain_freed_memory
from bench import RESULTS
from bench.harness import launch
from bench.harness.report import machine_facts, print_table, write_json
from bench.harness.stats import median
from bench.pipeline_configs import STAGES, configs_for, time_steps
from bench.pipeline_models import MODELS, build
from lightning_mgpu.placement.planning.plan import PlacementPlan
from lightning_mgpu.tuning.statistics import round_order

MICROBATCHES = (1, 2, 4, 8)
OUR_SCHEDULES = ("gpipe", "1f1b", "zero_bubble")
TORCH_SCHEDULES = ("gpipe", "1f1b")


# ----------------------------------------------------------------------------- torch's pipelining
def torch_config(
    args: argparse.Namespace, plans: dict[str, dict[int, PlacementPlan]], measure_memory: bool
) -> dict[str, Any]:
    return {
        "models": args.models,
        "settings": {name: model_settings(args, name) for name in args.models},
        "microbatches": args.microbatches,
        "schedules": [s for s in TORCH_SCHEDULES if s in args.torch_schedules],
        "sizes": {name: {str(m): plan.sizes for m, plan in by_m.items()} for name, by_m in plans.items()},
        "steps": args.steps,
        "measure_memory": measure_memory,
        "retain_freed_memory": args.retain_freed_memory,
    }


def run_torch_round(
    args: argparse.Namespace, config: dict[str, Any], workdir: Path, round_index: int
) -> list[dict[str, Any]]:
    path = workdir / f"torch_config_{round_index}.json"
    path.write_text(json.dumps(config))
    finished = launch.launch(
        "bench.pipeline_torch",
        ["--config", str(path)],
        nproc=STAGES,
        threads=1,
        scratch=workdir,
        label=f"torch_pipelining_round{round_index + 1}",
        timeout=args.torch_timeout,
    )
    return list(finished.report["rows"])


# ----------------------------------------------------------------------------- the run
def model_settings(args: argparse.Namespace, name: str) -> dict[str, int]:
    if name == "mlp":
        return {"width": args.mlp_width, "depth": args.mlp_depth, "batch": args.mlp_batch}
    return {
        "vocab": args.gpt_vocab,
        "context": args.gpt_context,
        "width": args.gpt_width,
        "heads": args.gpt_heads,
        "depth": args.gpt_depth,
        "batch": args.gpt_batch,
    }


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.retain_freed_memory and not retain_freed_memory():
        print("warning: could not change the C allocator's settings (not glibc?)", file=sys.stderr)
    threads_before = torch.get_num_threads()
    benches = {name: build(name, model_settings(args, name)) for name in args.models}
    configs = {name: configs_for(bench, args) for name, bench in benches.items()}
    plans = {
        name: {c.microbatches: c.plan for c in group if c.plan is not None and c.microbatches is not None}
        for name, group in configs.items()
    }
    torch.set_num_threads(threads_before)

    per_round: dict[tuple[str, str], list[float]] = {(n, c.name): [] for n, group in configs.items() for c in group}
    faults: dict[tuple[str, str], list[float]] = {key: [] for key in per_round}
    cpu: dict[tuple[str, str], list[float]] = {key: [] for key in per_round}
    torch_rows: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        for round_index in range(args.rounds):
            for name, group in configs.items():
                for config in round_order(group, round_index):
                    ms, page_faults, cpu_ms = time_steps(config.step, args.steps)
                    per_round[(name, config.name)].append(ms)
                    faults[(name, config.name)].append(page_faults)
                    cpu[(name, config.name)].append(cpu_ms)
            if args.torch_schedules:
                rows = run_torch_round(
                    args, torch_config(args, plans, measure_memory=round_index == 0), Path(tmp), round_index
                )
                for row in rows:
                    key = (row["model"], f"torch {row['schedule']} M={row['microbatches']}")
                    entry = torch_rows.setdefault(key, {**row, "rounds": []})
                    entry["rounds"].append(median(row["step_ms"]))
                    if row["peak_activation_bytes"] is not None:
                        entry["peak_activation_bytes"] = row["peak_activation_bytes"]
            if not args.quiet:
                print(
                    f"round {round_index + 1}/{args.rounds}: "
                    + ", ".join(f"{n}/{c} {v[-1]:.1f} ms" for (n, c), v in per_round.items()),
                    flush=True,
                )
        peaks = {(name, c.name): c.memory() for name, group in configs.items() for c in group}
    for group in configs.values():
        for config in group:
            config.close()
    torch.set_num_threads(threads_before)

    results: list[dict[str, Any]] = []
    for name, group in configs.items():
        base = median(per_round[(name, "unsplit, 1 core")])
        batch = benches[name].batch.shape[0]
        # What STAGES cores could give, both busy all the time with the micro-batched work (see unsplit()).
        ceilings = {
            c.microbatches: STAGES * base / median(per_round[(name, c.name)])
            for c in group
            if c.schedule is None and c.microbatches is not None
        }
        ceilings[1] = float(STAGES)
        for config in group:
            ms = median(per_round[(name, config.name)])
            results.append(
                _row(
                    name,
                    config.name,
                    "ours",
                    config.schedule,
                    config.loss,
                    config.microbatches,
                    per_round[(name, config.name)],
                    base,
                    batch,
                    config.plan,
                    peaks[(name, config.name)],
                    median(faults[(name, config.name)]),
                    median(cpu[(name, config.name)]),
                    ceilings.get(config.microbatches) if config.schedule else None,
                )
            )
            assert ms > 0
        for (model_name, label), entry in torch_rows.items():
            if model_name == name:
                m = entry["microbatches"]
                results.append(
                    _row(
                        name,
                        label,
                        "torch.distributed.pipelining",
                        entry["schedule"],
                        "inside",
                        m,
                        entry["rounds"],
                        base,
                        batch,
                        plans[name].get(m),
                        entry.get("peak_activation_bytes"),
                        None,
                        None,
                        ceilings.get(m),
                    )
                )
    payload = {
        "benchmark": "pipeline",
        "settings": vars(args),
        "models": {name: bench.description for name, bench in benches.items()},
        "machine": machine_facts(backend="gloo", world_size=1, device_type="cpu", threads_per_rank=1),
        "stages": STAGES,
        "results": results,
        "targets": targets(results),
    }
    report(payload, args)
    if args.out:
        print(f"wrote {write_json(args.out, payload)}")
    return payload


def _row(
    model: str,
    config: str,
    engine: str,
    schedule: Optional[str],
    loss: Optional[str],
    m: Optional[int],
    rounds: list[float],
    base: float,
    batch: int,
    plan: Optional[PlacementPlan],
    peak: Optional[list[int]],
    faults: Optional[float],
    cpu_ms: Optional[float],
    ceiling: Optional[float],
) -> dict[str, Any]:
    ms = median(rounds)
    return {
        "model": model,
        "config": config,
        "engine": engine,
        "schedule": schedule,
        "loss": loss,
        "microbatches": m,
        "step_ms": ms,
        "step_ms_rounds": rounds,
        "samples_per_s": batch / ms * 1e3,
        "speedup": base / ms,
        "gpipe_bound": (m * STAGES / (m + STAGES - 1)) if m and schedule else None,
        "two_core_ceiling": ceiling,
        "plan_ideal_speedup": plan.ideal_speedup if plan else None,
        "stage_sizes": plan.sizes if plan else None,
        "peak_activation_bytes": peak,
        "estimated_activation_bytes": plan.peak_activation_bytes(schedule) if plan and schedule else None,
        "page_faults_per_step": faults,
        "cpu_ms_per_step": cpu_ms,
    }


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets at M = 8 (None where this run has no M = 8)."""

    def find(model: str, engine: str, schedule: str) -> Optional[dict[str, Any]]:
        return next(
            (
                r
                for r in results
                if r["model"] == model
                and r["engine"] == engine
                and r["schedule"] == schedule
                and r["loss"] == "inside"
                and r["microbatches"] == 8
            ),
            None,
        )

    out: dict[str, Any] = {}
    zb, gp, ofob = (find("mlp", "ours", s) for s in ("zero_bubble", "gpipe", "1f1b"))
    out["zero_bubble_speedup"] = {
        "want": ">= 1.70",
        "got": zb and zb["speedup"],
        "met": bool(zb and zb["speedup"] >= 1.70),
    }
    ratio = None
    if gp and ofob and gp["peak_activation_bytes"] and ofob["peak_activation_bytes"]:
        ratio = max(ofob["peak_activation_bytes"]) / max(gp["peak_activation_bytes"])
    out["1f1b_memory_vs_gpipe"] = {"want": "<= 0.40", "got": ratio, "met": ratio is not None and ratio <= 0.40}
    speed = ofob["samples_per_s"] / gp["samples_per_s"] if gp and ofob else None
    out["1f1b_throughput_vs_gpipe"] = {
        "want": ">= 0.95",
        "got": speed,
        "met": speed is not None and speed >= 0.95,
        "per_round": per_round_speed(ofob, gp),
    }
    for model in ("mlp", "gpt"):
        for schedule in TORCH_SCHEDULES:
            ours, theirs = find(model, "ours", schedule), find(model, "torch.distributed.pipelining", schedule)
            value = ours["samples_per_s"] / theirs["samples_per_s"] if ours and theirs else None
            out[f"{model}_{schedule}_vs_torch"] = {
                "want": ">= 1.00",
                "got": value,
                "met": value is not None and value >= 1.0,
                "per_round": per_round_speed(ours, theirs),
            }
    return out


def per_round_speed(a: Optional[dict[str, Any]], b: Optional[dict[str, Any]]) -> Optional[list[float]]:
    """``a``'s throughput over ``b``'s in each round (the two ran in the same round, one after the other): how far
    the machine's drift between rounds moves the ratio that the medians give."""
    if not a or not b or len(a["step_ms_rounds"]) != len(b["step_ms_rounds"]):
        return None
    return [theirs / ours for ours, theirs in zip(a["step_ms_rounds"], b["step_ms_rounds"])]


def _sizes(values: Optional[list[int]]) -> str:
    def one(value: int) -> str:
        return f"{value / 2**20:.1f} MiB" if value >= 2**20 else f"{value / 2**10:.0f} KiB"

    return " / ".join(one(v) for v in values) if values else "-"


def report(payload: dict[str, Any], args: argparse.Namespace) -> None:
    for name, description in payload["models"].items():
        rows = [
            [
                r["config"],
                f"{r['step_ms']:.1f}",
                f"{r['samples_per_s']:.0f}",
                f"{r['speedup']:.2f}x",
                f"{r['gpipe_bound']:.2f}x" if r["gpipe_bound"] else "-",
                f"{r['two_core_ceiling']:.2f}x" if r["two_core_ceiling"] else "-",
                f"{r['cpu_ms_per_step']:.0f}" if r["cpu_ms_per_step"] is not None else "-",
                _sizes(r["peak_activation_bytes"]),
                _sizes(r["estimated_activation_bytes"]),
                f"{r['page_faults_per_step']:.0f}" if r["page_faults_per_step"] is not None else "-",
            ]
            for r in payload["results"]
            if r["model"] == name
        ]
        print_table(
            f"Pipeline, {name}: 2 stages on 2 CPU cores",
            [
                "config",
                "step ms",
                "samples/s",
                "speed-up",
                "GPipe bound",
                "2-core ceiling",
                "CPU ms/step",
                "peak activations (measured)",
                "peak activations (plan)",
                "faults/step",
            ],
            rows,
            caption=f"{description}; {args.rounds} interleaved rounds x {args.steps} steps; speed-up vs 'unsplit, 1 core'; "
            "activation peaks per stage (stage 0 / stage 1).",
        )
    lines = [
        f"{key}: want {t['want']}, got {t['got']:.2f} -> {'met' if t['met'] else 'NOT met'}"
        + (f" (per round {min(t['per_round']):.2f}-{max(t['per_round']):.2f})" if t.get("per_round") else "")
        for key, t in payload["targets"].items()
        if t["got"] is not None
    ]
    print("Targets at M=8:\n  " + ("\n  ".join(lines) if lines else "(no M=8 in this run)"))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--mlp-width", type=int, default=1024)
    parser.add_argument("--mlp-depth", type=int, default=8, help="number of Linear+GELU blocks")
    parser.add_argument(
        "--mlp-batch", type=int, default=1024, help="samples per training step (split into micro-batches)"
    )
    parser.add_argument("--gpt-width", type=int, default=256)
    parser.add_argument("--gpt-depth", type=int, default=8, help="transformer blocks")
    parser.add_argument("--gpt-heads", type=int, default=4)
    parser.add_argument("--gpt-vocab", type=int, default=256)
    parser.add_argument("--gpt-context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--gpt-batch", type=int, default=16, help="sequences per training step")
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(MICROBATCHES))
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=list(OUR_SCHEDULES),
        choices=OUR_SCHEDULES,
        help="the pipeline's schedules, the loss inside (and, for the MLP under gpipe, outside)",
    )
    parser.add_argument(
        "--no-loss-outside",
        dest="loss_outside",
        action="store_false",
        help="leave out the MLP's 'gpipe, loss outside' (the nn.Sequential pipelined as a module, as hybrid splits it)",
    )
    parser.add_argument(
        "--torch-schedules",
        nargs="*",
        default=list(TORCH_SCHEDULES),
        choices=TORCH_SCHEDULES,
        help="torch.distributed.pipelining's schedules run as the reference (none: skip it)",
    )
    parser.add_argument(
        "--torch-timeout", type=float, default=1800, help="seconds one round of torch's pipelining may take"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    parser.add_argument("--out", default=str(RESULTS / "pipeline.json"), help="JSON path ('' to skip)")
    parser.add_argument(
        "--retain-freed-memory",
        action="store_true",
        help="keep freed CPU memory for reuse (bench.allocator.retain_freed_memory), for every configuration",
    )
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.mlp_width, args.mlp_depth, args.mlp_batch = 64, 4, 64
        args.gpt_width, args.gpt_depth, args.gpt_heads, args.gpt_vocab, args.gpt_context, args.gpt_batch = (
            32,
            4,
            2,
            64,
            16,
            8,
        )
        args.rounds, args.steps, args.microbatches = 1, 2, [1, 2]
    for name in (
        "mlp_width",
        "mlp_depth",
        "mlp_batch",
        "gpt_width",
        "gpt_depth",
        "gpt_heads",
        "gpt_vocab",
        "gpt_context",
        "gpt_batch",
        "rounds",
        "steps",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(m < 1 for m in args.microbatches):
        parser.error(f"--microbatches must all be >= 1, got {args.microbatches}")
    if args.gpt_width % args.gpt_heads:
        parser.error(f"--gpt-width ({args.gpt_width}) must be a multiple of --gpt-heads ({args.gpt_heads})")
    return args


if __name__ == "__main__":
    main()
