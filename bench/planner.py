"""Is ``lightning_mgpu.placement.planning.partition`` optimal, how fast is it, and what do the usual heuristics cost?

A pipeline runs at the pace of its slowest stage, so a placement is judged by its
bottleneck: the largest stage time. For thousands of random per-layer cost vectors, and
for three model-shaped ones, every method below splits L layers into k contiguous stages
and we compare its bottleneck (in exact arithmetic) with the optimum:

    ours            partition(costs, k): exact bisection with snapping (the planner)
    dp              the O(k L^2) dynamic programme on exact integers: the reference optimum
    blockpartition  torchgpipe's balance_by_time: Bárány & Grinberg's block partition on the
                    costs rescaled to [0, 1] (re-implemented from the paper)
    ds_params       DeepSpeed's partition_method="parameters": its partition_balanced over
                    per-layer parameter counts (re-implemented)
    params_minmax   the smallest possible largest stage *parameter count* (our exact solver on
                    parameter counts): the best any parameter balance can do for time
    uniform         DeepSpeed's partition_method="uniform": equal layer counts

The reference optimum and the re-implemented heuristics, with their sources, are in
:mod:`bench.partition_baselines`.

Parameter counts are drawn correlated with, but not equal to, the costs (lognormal noise,
some parameter-free layers such as activations and pooling), because that is what the
parameter methods see in practice; the "ds_params" and "params_minmax" columns show what
balancing the wrong quantity does to the time bottleneck.

    python -m bench.planner                  # 3000 random cases, 3 models, timing (~10 s on one core)
    python -m bench.planner --quick          # smoke run: 100 cases, 3 timing runs (the test runs this)
    python -m bench.planner --cases 10000 --seed 1 --out bench/results/planner_10k.json

(from the repository root: see ``bench/__init__.py``).

Writes ``--out`` (default bench/results/planner.json): settings, per-distribution and
overall statistics per method (share of cases at the optimum, mean and worst ratio
bottleneck / optimum, invalid splits), per-model rows, and the planning time for
L = 1000, k = 8 (median of ``--timing-runs`` runs per input kind; target < 1 s).

The "models" section holds two kinds of cost vectors. ``"source": "profiled"``: real
per-layer forward+backward times measured on this machine's CPU with
:func:`lightning_mgpu.placement.planning.profile.profile_layers` (median of 5 after warm-up) for the
project's own three models: the char-LM transformer of ``recipes/char_lm`` (embeddings,
blocks, norm, head as one sequence), the CNN of ``recipes/image_classifier`` and the 8M MLP
of ``bench/models.py``. ``"source": "synthetic"``: GPU-scale shapes whose per-layer times
come from a FLOP / byte model (a GPT-2-medium-like transformer, a ResNet-50-like CNN and an
MLP with one huge layer), for layer counts and imbalances the small models do not have.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Optional

from bench import RESULTS
from bench.harness.report import load_average, print_table, write_json
from bench.models import load_recipe
from bench.partition_baselines import (
    block_partition,
    bottleneck,
    deepspeed_balanced,
    dp_optimum,
    exact_units,
    uniform,
)
from lightning_mgpu.placement import partition


# ----------------------------------------------------------------------------- settings
CASES = 3000  # random cases, split evenly over the distributions
QUICK_CASES = 100
LAYERS = (8, 64)  # L drawn uniformly in this range (inclusive)
STAGES = (2, 8)  # k drawn uniformly in this range, and k <= L
SEED = 0
TIMING_LAYERS, TIMING_STAGES = 1000, 8
TIMING_RUNS, QUICK_TIMING_RUNS = 7, 3
TIMING_TARGET_S = 1.0
MODEL_STAGES = (2, 4, 8)
DEFAULT_OUT = RESULTS / "planner.json"

METHODS = ("ours", "dp", "blockpartition", "ds_params", "params_minmax", "uniform")
DISTRIBUTIONS = ("uniform", "lognormal", "few_huge", "lognormal+cuts")
DISTRIBUTION_NOTES = {
    "uniform": "costs ~ U(0.5, 1.5)",
    "lognormal": "costs ~ lognormal(0, 1): heavy-tailed",
    "few_huge": "costs ~ U(0.5, 1.5), then 1-3 layers x U(10, 40)",
    "lognormal+cuts": "lognormal costs plus cut costs ~ U(0, 0.5) on both sides of each cut; the heuristics ignore cuts",
}


# ----------------------------------------------------------------------------- random cases
def draw_case(rng: random.Random, distribution: str) -> dict[str, Any]:
    num_layers = rng.randint(*LAYERS)
    k = rng.randint(STAGES[0], min(STAGES[1], num_layers))
    if distribution == "uniform":
        costs = [rng.uniform(0.5, 1.5) for _ in range(num_layers)]
    elif distribution in ("lognormal", "lognormal+cuts"):
        costs = [rng.lognormvariate(0.0, 1.0) for _ in range(num_layers)]
    elif distribution == "few_huge":
        costs = [rng.uniform(0.5, 1.5) for _ in range(num_layers)]
        for index in rng.sample(range(num_layers), rng.randint(1, 3)):
            costs[index] *= rng.uniform(10, 40)
    else:
        raise ValueError(f"unknown distribution {distribution!r}; choose from {DISTRIBUTIONS}")
    cuts = [rng.uniform(0.0, 0.5) for _ in range(num_layers - 1)] if distribution.endswith("+cuts") else None
    # Parameter counts follow the costs loosely: a layer's time is not its parameter count
    # (activation size, kernel efficiency), and ~20% of layers have no parameters at all.
    params = [0 if rng.random() < 0.2 else max(1, round(1e6 * c * rng.lognormvariate(0.0, 0.75))) for c in costs]
    return {"costs": costs, "cuts": cuts, "params": params, "k": k}


def split_with(method: str, case: dict[str, Any]) -> list[int]:
    costs, k = case["costs"], case["k"]
    if method == "ours":
        return partition(costs, k, cut_costs=case.get("cuts"))
    if method == "blockpartition":
        return block_partition(costs, k)
    if method == "ds_params":
        return deepspeed_balanced(case["params"], k)
    if method == "params_minmax":
        return partition([float(p) for p in case["params"]], k)
    if method == "uniform":
        return uniform(len(costs), k)
    raise ValueError(f"unknown method {method!r}")


def evaluate(case: dict[str, Any]) -> dict[str, Any]:
    """Every method's bottleneck, exactly, as a ratio to the DP optimum."""
    cuts = case.get("cuts")
    values = list(case["costs"]) + (list(cuts) if cuts else [])
    units, denominator = exact_units(values)
    cost_units = units[: len(case["costs"])]
    cut_units = units[len(case["costs"]) :] if cuts else None
    optimum = dp_optimum(cost_units, case["k"], cut_units)
    result: dict[str, Any] = {"optimum": optimum / denominator, "ratio": {}, "invalid": {}}
    for method in METHODS:
        if method == "dp":
            value = optimum
            valid = True
        else:
            sizes = split_with(method, case)
            valid = len(sizes) == case["k"] and all(s >= 1 for s in sizes) and sum(sizes) == len(case["costs"])
            value = bottleneck(cost_units, sizes, cut_units)
        # Exact comparison; the ratio is rounded once, for the report.
        result["ratio"][method] = 1.0 if value == optimum else float(Fraction(value, optimum))
        result["invalid"][method] = not valid
        if value < optimum:
            raise AssertionError(f"{method} beat the DP optimum ({value} < {optimum}): the reference is wrong")
    return result


def summarize_methods(evaluations: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    summary = {}
    for method in METHODS:
        ratios = [e["ratio"][method] for e in evaluations]
        summary[method] = {
            "cases": len(ratios),
            "optimal_share": sum(r == 1.0 for r in ratios) / len(ratios),
            "mean_ratio": statistics.fmean(ratios),
            "worst_ratio": max(ratios),
            "invalid": sum(e["invalid"][method] for e in evaluations),
        }
    return summary


# ----------------------------------------------------------------------------- model-shaped cost vectors
def transformer_costs() -> dict[str, Any]:
    """GPT-2-medium-like (d=1024, 24 blocks, vocab 50257), 4 x 1024 tokens per micro-batch, fp16 on a ~100 TFLOP/s GPU."""
    d, blocks, vocab, tokens = 1024, 24, 50257, 4 * 1024
    flops = 100e12

    def matmul_ms(macs: float) -> float:
        return 3 * 2 * macs / flops * 1e3  # forward + backward (2x forward)

    block_macs = tokens * (12 * d * d + 2 * 1024 * d)  # projections + MLP, attention scores
    names = ["embedding"] + [f"block{i}" for i in range(blocks)] + ["final_norm", "lm_head"]
    costs = [0.15] + [matmul_ms(block_macs)] * blocks + [0.05, matmul_ms(tokens * d * vocab) + 0.3]
    params = [vocab * d + 1024 * d] + [12 * d * d + 13 * d] * blocks + [2 * d, vocab * d]
    return {"names": names, "costs": costs, "params": params}


def cnn_costs() -> dict[str, Any]:
    """ResNet-50-like at 224 x 224, batch 32 per micro-batch: conv time from MACs (~50 TFLOP/s) plus activation traffic."""
    batch, flops, bandwidth = 32, 50e12, 2e12

    def ms(macs: float, activation_elements: float) -> float:
        compute = 3 * 2 * macs / flops
        traffic = 8 * 2 * activation_elements / bandwidth  # BN/ReLU reads and writes, fp16, fwd + bwd
        return (compute + traffic) * 1e3

    names, costs, params = ["stem"], [ms(batch * 112 * 112 * 64 * 147, batch * 112 * 112 * 64 * 2)], [9_408 + 128]
    channels_in = 64
    for stage, (width, repeats, size) in enumerate([(64, 3, 56), (128, 4, 28), (256, 6, 14), (512, 3, 7)]):
        for repeat in range(repeats):
            out = 4 * width
            weights = channels_in * width + 9 * width * width + width * out
            if repeat == 0:
                weights += channels_in * out  # projection shortcut
            names.append(f"stage{stage + 1}.block{repeat}")
            costs.append(ms(batch * size * size * weights, batch * size * size * (2 * width + 2 * out)))
            params.append(weights + 2 * (2 * width + out))
            channels_in = out
    names.append("pool+fc")
    costs.append(ms(batch * 2048 * 1000, batch * 7 * 7 * 2048))
    params.append(2048 * 1000 + 1000)
    return {"names": names, "costs": costs, "params": params}


def mlp_costs() -> dict[str, Any]:
    """MLP on 8192 rows: 24 Linear(2048, 2048) and, in the middle, one Linear(2048, 16384) + grouped max back to 2048."""
    rows, flops = 8192, 100e12
    ms = [3 * 2 * rows * 2048 * 2048 / flops * 1e3 + 0.02] * 24
    huge = 3 * 2 * rows * 2048 * 16384 / flops * 1e3 + 0.1
    costs = ms[:12] + [huge] + ms[12:]
    params = [2048 * 2048 + 2048] * 12 + [2048 * 16384 + 16384] + [2048 * 2048 + 2048] * 12
    names = [f"linear{i}" for i in range(12)] + ["huge"] + [f"linear{i}" for i in range(12, 24)]
    return {"names": names, "costs": costs, "params": params}


def _profiled(seq: Any, sample: Any) -> dict[str, Any]:
    import torch

    from lightning_mgpu.placement.planning.profile import profile_layers

    torch.manual_seed(0)
    with _threads(1):
        costs = profile_layers(seq, sample, repeats=5, warmup=2)
    return {
        "names": [f"{c.index}:{c.kind}" for c in costs],
        "costs": [c.time_ms for c in costs],
        "params": [c.param_count for c in costs],
    }


class _threads:
    def __init__(self, count: int) -> None:
        self.count = count

    def __enter__(self) -> None:
        import torch

        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.count)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.previous)


def char_lm_profiled() -> dict[str, Any]:
    """recipes/char_lm's CharTransformer (width 128, 4 blocks, 128 characters of context), batch 16, as one sequence."""
    import torch
    from torch import nn

    recipe = load_recipe("char_lm")
    model = recipe.CharTransformer(vocab_size=96, block_size=128, width=128, layers=4, heads=4)

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token, self.position = model.token_embedding, model.position_embedding

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.token(ids) + self.position(torch.arange(ids.size(1)))

    seq = nn.Sequential(Embed(), *model.blocks, model.norm, model.head)
    return _profiled(seq, torch.randint(0, 96, (16, 128)))


def cnn_profiled() -> dict[str, Any]:
    """recipes/image_classifier's ConvNet, batch 256 of 3 x 16 x 16 images."""
    import torch
    from torch import nn

    net = load_recipe("image_classifier").ConvNet()
    return _profiled(nn.Sequential(*net.features, nn.Flatten(), net.classifier), torch.randn(256, 3, 16, 16))


def mlp_profiled() -> dict[str, Any]:
    """bench/models.py's 8.66M-parameter MLP, batch 64."""
    import torch

    from bench.models import MLP_WIDTHS, make_mlp

    return _profiled(make_mlp(), torch.randn(64, MLP_WIDTHS[0]))


MODELS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    # name: (source, builder)
    "char-LM transformer (recipes/char_lm)": ("profiled", char_lm_profiled),
    "CNN (recipes/image_classifier)": ("profiled", cnn_profiled),
    "8M MLP (bench/models.py)": ("profiled", mlp_profiled),
    "transformer (GPT-2-medium-like)": ("synthetic", transformer_costs),
    "cnn (ResNet-50-like)": ("synthetic", cnn_costs),
    "mlp (one huge layer)": ("synthetic", mlp_costs),
}


def run_models() -> list[dict[str, Any]]:
    rows = []
    for name, (source, build) in MODELS.items():
        model = build()
        for k in MODEL_STAGES:
            if k > len(model["costs"]):
                continue
            case = {"costs": model["costs"], "params": model["params"], "k": k, "cuts": None}
            evaluation = evaluate(case)
            rows.append(
                {
                    "model": name,
                    "source": source,
                    "layers": len(model["costs"]),
                    "k": k,
                    "optimum_ms": evaluation["optimum"],
                    "ratio": evaluation["ratio"],
                    "sizes": {m: split_with(m, case) for m in METHODS if m != "dp"},
                }
            )
    return rows


# ----------------------------------------------------------------------------- planning time
def timing_inputs(rng: random.Random) -> dict[str, dict[str, Any]]:
    num_layers, k = TIMING_LAYERS, TIMING_STAGES
    uniform_costs = [rng.uniform(0.5, 1.5) for _ in range(num_layers)]
    heavy = [rng.lognormvariate(0.0, 2.0) for _ in range(num_layers)]
    memory = [rng.uniform(0.5, 1.5) for _ in range(num_layers)]
    return {
        "uniform": {"costs": uniform_costs},
        "lognormal(0, 2)": {"costs": heavy},
        "uniform + cut_costs": {
            "costs": uniform_costs,
            "cut_costs": [rng.uniform(0, 0.5) for _ in range(num_layers - 1)],
        },
        "uniform + memory/capacity": {
            "costs": uniform_costs,
            "memory": memory,
            # tight: 5% above an even share on 7 devices, a smaller last device
            "capacity": [sum(memory) / k * 1.05] * (k - 1) + [sum(memory) / k * 0.7],
        },
    }


def run_timing(runs: int, rng: random.Random, *, with_dp: bool) -> dict[str, Any]:
    results = {}
    for label, arguments in timing_inputs(rng).items():
        options = {key: value for key, value in arguments.items() if key != "costs"}
        seconds = []
        for _ in range(runs):
            started = time.perf_counter()
            partition(arguments["costs"], TIMING_STAGES, **options)
            seconds.append(time.perf_counter() - started)
        results[label] = {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}
    worst_median = max(entry["median_s"] for entry in results.values())
    dp_seconds = None
    if with_dp:
        # Why not just the DP: the same L = 1000, k = 8 problem through the O(k L^2) reference, once.
        units, _ = exact_units(timing_inputs(random.Random(0))["uniform"]["costs"])
        started = time.perf_counter()
        dp_optimum(units, TIMING_STAGES, None)
        dp_seconds = time.perf_counter() - started
    return {
        "layers": TIMING_LAYERS,
        "k": TIMING_STAGES,
        "runs": runs,
        "inputs": results,
        "dp_reference_s": dp_seconds,
        "target_s": TIMING_TARGET_S,
        "met": worst_median < TIMING_TARGET_S,
    }


# ----------------------------------------------------------------------------- report
def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    rng = random.Random(args.seed)

    per_distribution: dict[str, list[dict[str, Any]]] = {d: [] for d in DISTRIBUTIONS}
    for index in range(args.cases):
        distribution = DISTRIBUTIONS[index % len(DISTRIBUTIONS)]
        per_distribution[distribution].append(evaluate(draw_case(rng, distribution)))
    everything = [e for evaluations in per_distribution.values() for e in evaluations]
    random_summary = {
        "cases": len(everything),
        "by_distribution": {d: summarize_methods(e) for d, e in per_distribution.items() if e},
        "overall": summarize_methods(everything),
    }
    models = run_models()
    timing = run_timing(args.timing_runs, rng, with_dp=not args.quick)
    ours_always_optimal = random_summary["overall"]["ours"]["optimal_share"] == 1.0 and all(
        row["ratio"]["ours"] == 1.0 for row in models
    )
    elapsed = time.perf_counter() - started

    payload = {
        "benchmark": "planner",
        "machine": {
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average": load_average(),
        },
        "settings": {
            "cases": args.cases,
            "seed": args.seed,
            "layers": list(LAYERS),
            "stages": list(STAGES),
            "distributions": DISTRIBUTION_NOTES,
            "methods": list(METHODS),
            "quick": args.quick,
        },
        "random": random_summary,
        "models": models,
        "timing": timing,
        "ours_always_optimal": ours_always_optimal,
        "elapsed_s": elapsed,
    }
    write_json(args.out, payload)
    print_report(random_summary, models, timing, ours_always_optimal, elapsed, args.out)


def print_report(
    random_summary: dict[str, Any],
    models: list[dict[str, Any]],
    timing: dict[str, Any],
    ours_always_optimal: bool,
    elapsed: float,
    out: Path,
) -> None:
    rows = []
    for distribution, summary in [*random_summary["by_distribution"].items(), ("all", random_summary["overall"])]:
        for method in METHODS:
            entry = summary[method]
            rows.append(
                [
                    distribution if method == METHODS[0] else "",
                    method,
                    f"{entry['optimal_share']:.1%}",
                    f"{entry['mean_ratio']:.3f}",
                    f"{entry['worst_ratio']:.3f}",
                    str(entry["invalid"]) if entry["invalid"] else "",
                ]
            )
    print_table(
        f"Bottleneck / optimum on {random_summary['cases']} random cases (L {LAYERS[0]}-{LAYERS[1]}, k {STAGES[0]}-{STAGES[1]})",
        ["distribution", "method", "at optimum", "mean ratio", "worst ratio", "invalid splits"],
        rows,
        caption="optimum: exact O(k L^2) DP on exact integers; ratios compared exactly, rounded for display",
    )
    print_table(
        "Model cost vectors (profiled: measured on this CPU; synthetic: GPU-scale FLOP model): bottleneck / optimum",
        ["model", "L", "k", "optimum ms", *[m for m in METHODS if m != "dp"]],
        [
            [
                f"{row['model']} [{row['source']}]",
                str(row["layers"]),
                str(row["k"]),
                f"{row['optimum_ms']:.3f}",
                *[f"{row['ratio'][m]:.3f}" for m in METHODS if m != "dp"],
            ]
            for row in models
        ],
    )
    print_table(
        f"Planning time, L = {timing['layers']}, k = {timing['k']} (median of {timing['runs']} runs)",
        ["input", "median ms", "min ms", "max ms"],
        [
            [label, f"{e['median_s'] * 1e3:.1f}", f"{e['min_s'] * 1e3:.1f}", f"{e['max_s'] * 1e3:.1f}"]
            for label, e in timing["inputs"].items()
        ],
        caption=f"target < {timing['target_s']:.0f} s: {'met' if timing['met'] else 'NOT met'}",
    )
    if timing["dp_reference_s"] is not None:
        print(f"The O(k L^2) DP reference on a uniform input of the same size: {timing['dp_reference_s']:.2f} s, once.")
    verdict = "optimal in every case" if ours_always_optimal else "NOT OPTIMAL in some case: a bug"
    print(f"partition(): {verdict}. {elapsed:.1f} s in all; wrote {out}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=None, help=f"random cases ({CASES}; --quick: {QUICK_CASES})")
    parser.add_argument("--timing-runs", type=int, default=None, help=f"runs per timing input ({TIMING_RUNS})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"random seed ({SEED})")
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer cases and timing runs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report (%(default)s)")
    args = parser.parse_args(argv)
    if args.cases is None:
        args.cases = QUICK_CASES if args.quick else CASES
    if args.timing_runs is None:
        args.timing_runs = QUICK_TIMING_RUNS if args.quick else TIMING_RUNS
    if args.cases < len(DISTRIBUTIONS):
        parser.error(f"--cases must be at least {len(DISTRIBUTIONS)} (one per distribution), got {args.cases}")
    if args.timing_runs < 1:
        parser.error(f"--timing-runs must be at least 1, got {args.timing_runs}")
    return args


if __name__ == "__main__":
    main()
