"""Benchmark figures, read from ``bench/results/*.json``: the documentation quotes the files, never a memory of them.

One function per results file (or per table of one); each returns Markdown with the table and
the sentence that judges it against its target, both computed from the file. Nothing is
measured here: re-running a benchmark rewrites its JSON, and ``python -m docs.generate`` then
rewrites these tables.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from docs.markdown import code, table

__all__ = [
    "RESULTS",
    "bench_comm",
    "buckets",
    "doctor_overhead",
    "headlines",
    "overhead",
    "pipeline",
    "planner_models",
    "planner_random",
    "planner_timing",
    "profiler_breakdown",
    "profiler_overhead",
    "soak",
    "watch_overhead",
]

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"

_MODELS = {"mlp": "8M MLP", "cnn": "CNN", "char_lm": "char_lm transformer"}
_CONFIGS = {
    "raw": "raw torch DDP loop",
    "ddp": "Lightning `ddp`",
    "ddp_tuned": "`ddp_tuned`",
    "ddp_tuned+hook": "`ddp_tuned` + the profiler's hook alone (nothing timed)",
    "ddp_tuned+profiler": "`+ CommProfiler()` (20 of every 200 steps)",
    "ddp_tuned+profiler_all": "`+ CommProfiler(profile_every=None)` (every step)",
}
_PLANNERS = {
    "ours": "`partition` (ours)",
    "blockpartition": "block partition (torchgpipe's heuristic, re-implemented)",
    "ds_params": "parameter balance (DeepSpeed's `partition_balanced`, re-implemented)",
    "params_minmax": "exact balance of parameter counts",
    "uniform": "equal layer counts",
}


def load(name: str) -> Any:
    """``bench/results/NAME.json``."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def _mark(met: bool) -> str:
    return "✓" if met else "✗"


def _signed_percent(fraction: float) -> str:
    return f"{'+' if fraction >= 0 else '−'}{abs(100 * fraction):.1f}%"


def _ci(bounds: list[float]) -> str:
    return f"{bounds[0]:.3f}–{bounds[1]:.3f}"


def _machine(result: dict[str, Any]) -> str:
    """Where the figures come from, as the file records it."""
    m = result.get("machine", {})
    parts = [f"{m['cpu_count']} CPU cores" if "cpu_count" in m else None]
    if m.get("world_size", 1) > 1:
        threads = m.get("threads_per_rank")
        each = "one thread" if threads == 1 else f"{threads} threads"
        parts.append(f"{m['world_size']} {m.get('backend', '')} ranks, {each} each")
    versions = [f"{name} {m[key]}" for name, key in (("torch", "torch"), ("Lightning", "lightning")) if key in m]
    parts.append(", ".join(versions) or None)
    return "; ".join(p for p in parts if p)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def overhead() -> str:
    """``bench/overhead.py``: raw DDP loop, Lightning ``ddp`` and ``ddp_tuned``."""
    r = load("overhead")
    s = r["summary"]
    rows = []
    for key in ("raw", "ddp", "ddp_tuned"):
        c = s[key]
        lo, hi = c["step_ms_spread"]
        rows.append(
            (
                _CONFIGS[key],
                f"{c['step_ms_median']:.2f}",
                f"{c['step_ms_p90']:.2f}",
                f"{lo:.2f}–{hi:.2f} ({100 * c['relative_spread']:.1f}%)",
                f"{c['iteration_ms_median']:.2f}",
                f"{c['step_ms_median'] / s['raw']['step_ms_median']:.3f}",
                f"{c['step_ms_median'] / s['ddp']['step_ms_median']:.3f}",
            )
        )
    header = (
        "configuration",
        "step ms",
        "p90 ms",
        "spread of launch medians",
        "iteration ms",
        "× raw",
        "× Lightning `ddp`",
    )
    t = r["targets"]
    vs_ddp, vs_raw = t["ddp_tuned/ddp"], t["ddp_tuned/raw"]
    both = "both met" if vs_ddp["met"] and vs_raw["met"] else "not both met"
    verdict = (
        f"Targets: `ddp_tuned` ≤ {vs_ddp['limit']:.2f} × Lightning `ddp` (measured {vs_ddp['ratio']:.2f} by step, "
        f"{vs_ddp['iteration_ratio']:.2f} by iteration) and ≤ {vs_raw['limit']:.2f} × the raw loop "
        f"({vs_raw['ratio']:.2f} by step, {vs_raw['iteration_ratio']:.2f} by iteration): {both}. "
        f"Final loss identical in every launch: {'yes' if r['same_final_loss'] else 'no'}. "
        f"{_machine(r)}; {r['settings']['rounds']} rounds × {r['settings']['steps']} timed steps; "
        f"{r['wall_s'] / 60:.0f} minutes."
    )
    return f"{table(header, rows, right=(1, 2, 4, 5, 6))}\n\n{verdict}"


def _profiler_rows(r: dict[str, Any], configs: list[str]) -> list[tuple[str, ...]]:
    s = r["summary"]
    rows: list[tuple[str, ...]] = []
    for key in configs:
        pair = f"{key}/ddp_tuned"
        if key == "ddp_tuned":
            ratio, ci, cpu = "1.000", "", "1.000"
        elif pair in r["targets"]:
            t = r["targets"][pair]
            ratio, ci, cpu = f"**{t['ratio']:.3f}**", _ci(t["ci95"]), f"{t['cpu_ratio']:.3f}"
        else:
            b = r["breakdown"][pair]
            ratio, ci, cpu = (
                f"{b['iteration']['ratio']:.3f}",
                _ci(b["iteration"]["ci95"]),
                f"{b['cpu_iteration']['ratio']:.3f}",
            )
        rows.append((_CONFIGS[key], f"{s[key]['iteration_ms_mean']:.2f}", ratio, ci, cpu))
    return rows


def profiler_overhead() -> str:
    """``bench/profiler_overhead.py``: ``ddp_tuned`` with and without ``CommProfiler``."""
    r = load("profiler_overhead")
    configs = ["ddp_tuned", "ddp_tuned+profiler", "ddp_tuned+profiler_all"]
    header = ("configuration", "iteration ms (mean)", "× without", "95% CI", "rank 0 CPU time")
    t = r["targets"]["ddp_tuned+profiler/ddp_tuned"]
    verdict = (
        f"Target ≤ {100 * (t['limit'] - 1):.0f}% with the default configuration: **{'met' if t['met'] else 'not met'}**"
        + (
            " (the whole interval is under it)"
            if t["conclusive"]
            else " (the interval reaches past it: not conclusive)"
        )
        + f". {_machine(r)}; {r['settings']['launches']} launches × {r['settings']['rounds']} rounds of "
        f"{r['settings']['steps']} timed steps per fit; {r['wall_s'] / 60:.0f} minutes."
    )
    return f"{table(header, _profiler_rows(r, configs), right=(1, 2, 4))}\n\n{verdict}"


def profiler_breakdown() -> str:
    """``bench/profiler_overhead.py --breakdown``: the profiler's hook alone against the profiler on top of it."""
    r = load("profiler_overhead_breakdown")
    rows = []
    for pair, b in r["breakdown"].items():
        with_, without = pair.split("/")
        rows.append(
            (f"{_CONFIGS[with_]} / {_CONFIGS[without]}", f"{b['iteration']['ratio']:.3f}", _ci(b["iteration"]["ci95"]))
        )
    for pair, t in r["targets"].items():
        with_, without = pair.split("/")
        rows.append((f"{_CONFIGS[with_]} / {_CONFIGS[without]}", f"{t['ratio']:.3f}", _ci(t["ci95"])))
    note = f"{_machine(r)}; {r['settings']['launches']} launch × {r['settings']['rounds']} rounds."
    return f"{table(('with / without', '× iteration time', '95% CI'), rows, right=(1,))}\n\n{note}"


def buckets() -> str:
    """``bench/buckets.py``: every distinct bucket layout as a fixed size, DDP's default and ``"auto"``."""
    r = load("buckets")
    params = r["settings"]["parameters"]
    rows = []
    for m in r["models"]:
        default = m["default"]["step_ms"]
        others = ", ".join(
            f"{s['cap_mb']:g} MiB {s['step_ms']:.2f} ({_signed_percent(s['step_ms'] / default - 1)})"
            for s in m["sweep"]
            if not s["is_default"]
        )
        a, t = m["auto"], m["targets"]
        rows.append(
            (
                f"{_MODELS.get(m['model'], m['model'])} ({params[m['model']] / 1e6:.2f}M)",
                f"{default:.2f} ms",
                others,
                ", ".join(f"{c:g}" for c in a["chosen_mb"]),
                f"{a['tuned_step_ms']:.2f} ms: {t['tuned_vs_best']['ratio']:.3f} {_mark(t['tuned_vs_best']['met'])}",
                f"{a['total_s']:.1f} s / {m['default']['total_s']:.1f} s = {t['total_vs_default']['ratio']:.3f} "
                f"{_mark(t['total_vs_default']['met'])}",
            )
        )
    header = (
        "model (parameters)",
        "DDP default 25 MiB",
        "other layouts (step ms, vs default)",
        '`"auto"` chose (round 1, 2)',
        "tuned step / best fixed",
        f"{r['settings']['run_steps']}-step total: auto / default",
    )
    limits = r["settings"]["targets"]
    near = [f"{m['targets']['tuned_vs_best']['ratio']:.3f}" for m in r["models"]]
    total = [f"{m['targets']['total_vs_default']['ratio']:.3f}" for m in r["models"]]
    widest = max(r["models"], key=lambda m: m["sweep_gap"])
    gap = widest["sweep_gap"]
    verdict = (
        f"Targets: step time after tuning within {100 * (limits['tuned_vs_best_limit'] - 1):.0f}% of the best fixed "
        f"size ({', '.join(near)}); total time of a {r['settings']['run_steps']}-step run, tuning included, no worse "
        f"than DDP's default ({', '.join(total)}); better wherever the sweep shows DDP's default "
        f"≥ {100 * limits['gap_for_must_be_better']:.0f}% slower than the best size — the widest gap here is "
        f"{_MODELS.get(widest['model'], widest['model'])}'s, {100 * gap:.1f}% (best: {widest['best']['cap_mb']:g} MiB)"
        + (', so there was nothing for `"auto"` to win.' if gap < limits["gap_for_must_be_better"] else ".")
        + f" {_machine(r)}; {r['settings']['rounds']} rounds; {r['wall_s']:.0f} s."
    )
    return f"{table(header, rows, right=(1,))}\n\n{verdict}"


def pipeline() -> str:
    """``bench/pipeline.py``, with glibc's default allocator settings and with ``--retain-freed-memory``."""
    plain, retain = load("pipeline"), load("pipeline_retain")
    if "targets" in plain:
        return _pipeline_schedules(plain, retain)
    kept = {row["config"]: row for row in retain["results"]}
    target_m = plain["target"]["microbatches"]
    rows = []
    for row in plain["results"]:
        other = kept.get(row["config"], {})
        bold = "**" if row["microbatches"] == target_m else ""
        bound = "–" if row["gpipe_bound"] is None else f"{row['gpipe_bound']:.2f}×"
        rows.append(
            (
                row["config"],
                f"{row['step_ms']:.0f}",
                f"{bold}{row['speedup']:.2f}×{bold}",
                f"{other['step_ms']:.0f}" if other else "–",
                f"{bold}{other['speedup']:.2f}×{bold}" if other else "–",
                bound,
                f"{row['page_faults_per_step']:,.0f}",
            )
        )
    header = (
        "configuration",
        "step ms",
        "speed-up",
        "step ms (retain)",
        "speed-up (retain)",
        "GPipe bound M·K/(M+K−1)",
        "page faults per step",
    )
    t, tr = plain["target"], retain["target"]
    verdict = (
        f"Target at M = {target_m}: at least {t['min_speedup']:.1f}× the unsplit model: "
        f"{'met' if t['met'] else 'not met'}, **{t['speedup']:.2f}×** with glibc's default allocator settings and "
        f"{tr['speedup']:.2f}× with `retain_freed_memory()`. K = {plain['stages']} stages; "
        f"{plain['settings']['rounds']} interleaved rounds × {plain['settings']['steps']} steps, medians; "
        f"{_machine(plain)}."
    )
    return f"{table(header, rows, right=(1, 2, 3, 4, 5, 6))}\n\n{verdict}"


def _mib_per_stage(values: Any) -> str:
    return " / ".join(f"{v / 2**20:.1f}" for v in values) if values else "–"


def _pipeline_schedules(plain: Any, retain: Any) -> str:
    """The schedules' run (issue 16): both models, ours and torch's pipelining, measured activation peaks."""
    kept = {(row["model"], row["config"]): row for row in retain.get("results", [])} if "targets" in retain else {}
    rows = []
    for row in plain["results"]:
        other = kept.get((row["model"], row["config"]), {})
        bold = "**" if row["microbatches"] == 8 else ""
        rows.append(
            (
                row["model"],
                row["config"],
                f"{row['step_ms']:.0f}",
                f"{bold}{row['speedup']:.2f}×{bold}",
                f"{other['speedup']:.2f}×" if other else "–",
                "–" if row["gpipe_bound"] is None else f"{row['gpipe_bound']:.2f}×",
                "–" if row.get("two_core_ceiling") is None else f"{row['two_core_ceiling']:.2f}×",
                "–" if row.get("cpu_ms_per_step") is None else f"{row['cpu_ms_per_step']:.0f}",
                _mib_per_stage(row["peak_activation_bytes"]),
                _mib_per_stage(row["estimated_activation_bytes"]),
            )
        )
    header = (
        "model",
        "configuration",
        "step ms",
        "speed-up",
        "speed-up (retain)",
        "GPipe bound M·K/(M+K−1)",
        "2-core ceiling",
        "CPU ms per step",
        "peak activations MiB, measured (stage 0 / 1)",
        "plan's estimate",
    )
    verdicts = "; ".join(
        f"{key.replace('_', ' ')} {t['want']}: {t['got']:.2f} {_mark(t['met'])}"
        + (f" (rounds {min(t['per_round']):.2f}–{max(t['per_round']):.2f})" if t.get("per_round") else "")
        for key, t in plain["targets"].items()
        if t["got"] is not None
    )
    verdict = (
        f"Targets at M = 8 (K = {plain['stages']}): {verdicts or 'no M = 8 in this run'}. "
        f"{plain['settings']['rounds']} interleaved rounds × {plain['settings']['steps']} steps, medians; "
        f"{_machine(plain)}."
    )
    return f"{table(header, rows, right=(2, 3, 4, 5, 6, 7, 8, 9))}\n\n{verdict}"


def _pipeline_headline(pipe: Any) -> str:
    speedup = pipe["targets"]["zero_bubble_speedup"]["got"] if "targets" in pipe else pipe["target"]["speedup"]
    return "–" if speedup is None else f"{speedup:.2f}× the unsplit model"


def planner_random() -> str:
    """``bench/planner.py``: random cost vectors, each method's bottleneck against the exact optimum."""
    r = load("planner")
    overall = r["random"]["overall"]
    rows = [
        (
            label,
            f"{100 * overall[key]['optimal_share']:.1f}%",
            f"{overall[key]['mean_ratio']:.3f}",
            f"{overall[key]['worst_ratio']:.3f}",
        )
        for key, label in _PLANNERS.items()
    ]
    header = ("method", "optimal", "mean bottleneck / optimum", "worst")
    return table(header, rows, right=(1, 2, 3))


def planner_models() -> str:
    """``bench/planner.py``: per-layer costs of real models (measured) and of GPU-scale shapes (synthetic)."""
    r = load("planner")
    keys = ("ours", "blockpartition", "ds_params", "uniform")
    header = ("model", "source", "L", "K", "optimum ms", "ours", "block partition", "parameter balance", "equal counts")
    rows = [
        (
            m["model"],
            m["source"],
            m["layers"],
            m["k"],
            f"{m['optimum_ms']:.2f}",
            *(f"{m['ratio'][k]:.3f}" for k in keys),
        )
        for m in r["models"]
    ]
    return table(header, rows, right=(2, 3, 4, 5, 6, 7, 8))


def planner_timing() -> str:
    """``bench/planner.py``: how long ``partition`` takes on a large model."""
    t = load("planner")["timing"]
    slowest = max(case["median_s"] for case in t["inputs"].values())
    return (
        f"Planning L = {t['layers']:,} layers on k = {t['k']} stages takes at most {1000 * slowest:.0f} ms "
        f"(median of {t['runs']} runs, over {len(t['inputs'])} kinds of input; target: under {t['target_s']:g} s, "
        f"{'met' if t['met'] else 'not met'}); the exact O(k·L²) dynamic programme it is checked against takes "
        f"{t['dp_reference_s']:.2f} s."
    )


def bench_comm() -> str:
    """``lightning-mgpu bench-comm --json``: the all-reduce sweep of this project's machine."""
    r = load("bench_comm_cpu")
    rows = [
        (
            _size(row["bytes"]),
            f"{row['time_us']:.1f}",
            f"{row['algbw_gbps']:.3f}",
            f"{row['busbw_gbps']:.3f}",
            row["wrong"],
        )
        for row in r["rows"]
    ]
    at_25 = [row["busbw_gbps"] for row in r["rows"] if 16 << 20 <= row["bytes"] <= 32 << 20]
    summary = (
        f"Peak bus bandwidth {r['peak_busbw_gbps']:.2f} GB/s at {_size(r['peak_busbw_bytes'])}; "
        f"{min(at_25):.1f}–{max(at_25):.1f} GB/s around DDP's 25 MiB bucket size (16 and 32 MiB); "
        f"latency {r['latency_us'] / 1000:.1f} ms at {_size(r['latency_bytes'])}; {r['wrong_total']} wrong results. "
        f"{r['world_size']} {r['backend']} ranks on {r['device_type']}, torch {r['machine']['torch']}, "
        f"{r['machine']['cpu_count']} CPUs."
    )
    header = ("size", "time µs", "algbw GB/s", "busbw GB/s", "#wrong")
    return f"{summary}\n\n{table(header, rows, right=(1, 2, 3, 4))}"


def doctor_overhead() -> str:
    """``bench/doctor_overhead.py``: ``ddp_tuned`` with and without ``DistributedDoctor``."""
    r = load("doctor_overhead")
    pairs = r["ratio_iteration_per_pair"]
    hooks = r["hook_us_per_batch"]
    hook_us = sum(hooks.values())
    step_ms = r["summary"]["ddp_tuned"]["step_ms_median"]
    iteration_ms = r["summary"]["ddp_tuned"]["iteration_ms_median"]
    checks = r["check_ms"]
    # The file records the doctor's settings as text, e.g. "DistributedDoctor() (every_n_steps=100)".
    match = re.search(r"every_n_\w+=(\d+)", r["settings"]["doctor"])
    every = int(match.group(1)) if match else 100
    rows = [
        (f"with / without, iteration (median over {len(pairs)} pairs)", f"**{r['ratio_iteration']:.3f}**"),
        ("per pair", ", ".join(f"{p:.3f}" for p in pairs)),
        ("with / without, step (median)", f"{r['ratio_step']:.3f}"),
        (
            "per-batch hooks",
            f"{hook_us:.0f} µs ({100 * hook_us / 1000 / step_ms:.2f}% of a step: "
            + ", ".join(f"{name} {us:.1f}" for name, us in hooks.items())
            + ")",
        ),
        (
            "one check (median)",
            ", ".join(f"{name.replace('_', ' ')} {c['median']:.1f} ms" for name, c in checks.items()),
        ),
        (
            f"periodic checks, one per {every} batches",
            f"≈ {100 * checks['periodic']['median'] / every / iteration_ms:.2f}% of the iteration time",
        ),
    ]
    note = (
        f"Limit {r['limit']:.2f}: {'met' if r['met'] else 'not met'}. {r['settings']['schedule']}, "
        f"{r['settings']['pairs']} pairs × {r['settings']['steps']} timed steps; {_machine(r)}."
    )
    return f"{table(('measure', 'value'), rows)}\n\n{note}"


def soak() -> str:
    """``bench/soak.py``: memory of a long run with both callbacks."""
    r = load("soak")
    rows = []
    for rank in r["ranks"]:
        by_step = {s["step"]: s["rss_mib"] for s in rank["samples"]}
        middle = by_step.get(rank["window"]["from_step"])
        rows.append(
            (
                f"rank {rank['rank']} RSS",
                f"{rank['start_rss_mib']:.1f} MiB",
                f"{middle:.1f} MiB" if middle is not None else "–",
                f"{rank['end_rss_mib']:.1f} MiB",
                f"{rank['window_growth_mib']:+.2f} MiB, {rank['window_gc_objects_growth']:+,} objects",
            )
        )
    window = r["ranks"][0]["window"]
    header = (
        "",
        "start",
        f"step {window['from_step']:,}",
        "end",
        f"steps {window['from_step']:,}–{window['to_step']:,}",
    )
    note = (
        f"{r['steps']:,} steps on {len(r['ranks'])} ranks with "
        + ", ".join(f"{code(name)}: {how}" for name, how in r["callbacks"].items())
        + f"; {r['elapsed_s']:.0f} s; verdict: {r['verdict']}. {_machine(r)}."
    )
    watch = r.get("watch")  # runs from before the hang watch have no such entry
    if watch is not None:
        note += (
            f" The hang watch ran at its default (`hang_timeout={watch['hang_timeout_s'][0]:g}`, "
            f"{min(watch['beats']):,}+ beats published per rank) through a checkpoint save every "
            f"{watch['checkpoint_every_steps']:,} steps and a validation every {watch['validation_every_steps']:,}: "
            f"{watch['hang_reports']} hang report(s)."
        )
    return f"{table(header, rows)}\n\n{note}"


def watch_overhead() -> str:
    """``bench/doctor_overhead.py --subject watch``: ``ddp_tuned`` with and without the hang watch."""
    command = "`python -m bench.doctor_overhead --subject watch`"
    if not (RESULTS / "watch_overhead.json").exists():
        return (
            f"Not measured on a quiet machine yet: {command} writes `bench/results/watch_overhead.json`, "
            "from which this table is made."
        )
    r = load("watch_overhead")
    pairs = r["ratio_iteration_per_pair"]
    low, high = r["ratio_iteration_ci95"]
    rows = [
        (
            f"with / without, mean iteration (median over {len(pairs)} pairs)",
            f"**{r['ratio_iteration']:.4f}** (95% CI {low:.3f}–{high:.3f})",
        ),
        ("per pair", ", ".join(f"{p:.3f}" for p in pairs)),
        ("with / without, step (median)", f"{r['ratio_step']:.4f}"),
    ]
    quick = " A smoke run (`--quick`): not a measurement." if r["settings"].get("quick") else ""
    note = (
        f"Limit {r['limit']:.2f}: {'met' if r['met'] else 'not met'}"
        f"{'' if high <= r['limit'] else ' (the interval reaches past it: not conclusive)'}. "
        f"{r['settings']['schedule']}, "
        f"{r['settings']['pairs']} pairs × {r['settings']['steps']} timed steps; {_machine(r)}; {command}.{quick}"
    )
    return f"{table(('measure', 'value'), rows)}\n\n{note}"


def headlines() -> str:
    """One line per benchmark, for the front page."""
    over, prof, doc = load("overhead"), load("profiler_overhead"), load("doctor_overhead")
    pipe, plan, comm = load("pipeline"), load("planner"), load("bench_comm_cpu")
    vs_ddp = over["targets"]["ddp_tuned/ddp"]
    p = prof["targets"]["ddp_tuned+profiler/ddp_tuned"]
    ours, block = plan["random"]["overall"]["ours"], plan["random"]["overall"]["blockpartition"]
    rows = [
        (
            "`ddp_tuned` step time / Lightning `ddp`",
            f"{vs_ddp['ratio']:.2f}×",
            "[overhead](docs/benchmarks.md#overhead-ddp_tuned-against-ddp-and-a-raw-loop)",
        ),
        (
            "`CommProfiler()` cost (default schedule)",
            f"×{p['ratio']:.3f} (95% CI {_ci(p['ci95'])}"
            + ("" if p["ci95"][1] <= p["limit"] else f"; reaches past the ×{p['limit']} limit: not conclusive")
            + ")",
            "[profiler](docs/benchmarks.md#what-commprofiler-costs)",
        ),
        (
            "`DistributedDoctor()` cost",
            f"×{doc['ratio_iteration']:.3f}",
            "[doctor](docs/benchmarks.md#what-distributeddoctor-costs)",
        ),
        (
            f"`hybrid` pipeline, M = 8, K = {pipe['stages']} on CPU cores"
            + (", zero-bubble" if "targets" in pipe else ""),
            _pipeline_headline(pipe),
            "[pipeline](docs/benchmarks.md#pipeline-throughput)",
        ),
        (
            f"`partition` optimal ({plan['random']['cases']:,} random cases)",
            f"{100 * ours['optimal_share']:.0f}% (torchgpipe's heuristic: {100 * block['optimal_share']:.1f}%)",
            "[planner](docs/benchmarks.md#the-planner)",
        ),
        (
            f"all-reduce peak, {comm['world_size']} {comm['backend']} ranks",
            f"{comm['peak_busbw_gbps']:.2f} GB/s busbw",
            "[bench-comm](docs/benchmarks.md#all-reduce-bandwidth-bench-comm)",
        ),
    ]
    machine = _machine(over)
    gpu = load("gpu_selftest")["machine"].get("card", "a GPU")
    return (
        f"{table(('measured', 'figure', 'details'), rows)}\n\nAll measured on {machine}. On one {gpu}: the "
        "self-test and first figures in [benchmarks](docs/benchmarks.md#on-a-gpu-one-h100)."
    )


def _gpu_card(machine: dict[str, Any]) -> str:
    return (
        f"{machine.get('card', '?')} ({machine.get('memory_gib', '?')} GiB, {machine.get('gpus', '?')} GPU), "
        f"torch {machine.get('torch')} (CUDA {machine.get('cuda')}, NCCL {machine.get('nccl')}), "
        f"Lightning {machine.get('lightning')}"
    )


def gpu_selftest() -> str:
    """``bench/gpu_check.py``'s self-test part: ``lightning-mgpu doctor --selftest`` on a lent GPU, per launch."""
    r = load("gpu_selftest")
    launches = r["launches"]
    names = [c["name"] for c in launches[-1]["selftest"]["checks"]]
    rows = []
    for name in names:
        cells = []
        for launch in launches:
            check = next((c for c in launch["selftest"]["checks"] if c["name"] == name), None)
            if check is None:
                cells.append("–")
            elif check["status"] == "fail":
                value = check["value"]
                cells.append("✗ " + value[value.find("exit code") :][:110] if "exit code" in value else value[:110])
            elif check["value"].startswith("skipped"):
                cells.append(check["value"])
            else:
                cells.append("✓ " + check["value"].split(": ", 1)[-1][:160])
        rows.append((f"`{name}`", *cells))
    doctor = launches[0]["doctor"]["counts"]
    header = ("path", *(f"{launch['label']} ({launch['commit']})" for launch in launches))
    note = (
        f"{_gpu_card(r['machine'])}. `lightning-mgpu doctor` (the machine checks and NCCL's all-reduce smoke test): "
        f"{doctor['ok']} ok, {doctor['warn']} warn, {doctor['fail']} fail. "
        "`python -m bench.gpu_check --out DIR` runs both, then the figures below."
    )
    return f"{table(header, rows)}\n\n{note}"


def gpu_figures() -> str:
    """``bench/gpu_check.py``'s figures: overhead, profiler, compression hooks, PowerSGD, whatif's compute scale."""
    over, comp, wi = load("gpu_overhead"), load("gpu_compression"), load("gpu_whatif")
    rows = []
    titles = {
        "ddp_tuned_vs_ddp": ("`ddp_tuned` / Lightning `ddp`, step (8M MLP, batch 256)", "≤ 1.02"),
        "profiler_cost": ("`+ CommProfiler()` / `ddp_tuned`, mean iteration (CUDA events)", "≤ 1.03"),
        "noise_floor": ("Lightning `ddp` / Lightning `ddp` again, step: the comparison's noise floor", "–"),
    }
    for key, (title, goal) in titles.items():
        ratio = over.get(key)
        if ratio is None:
            continue
        pooled = {tag.rsplit("@", 1)[-1] for tag in ratio.get("launches", [])}
        per_launch = ", ".join(
            f"{launch[key]['median']:.3f} ({launch['commit']}{'' if launch['commit'] in pooled else ', not pooled'})"
            for launch in over["launches"]
            if key in launch
        )
        verdict = ""
        if "limit" in ratio:
            conclusive = ratio["ci95"][1] <= ratio["limit"] or ratio["ci95"][0] > ratio["limit"]
            verdict = _mark(ratio["median"] <= ratio["limit"]) + ("" if conclusive else " (not conclusive)")
        rows.append(
            (
                title,
                f"**{ratio['median']:.3f}** (95% CI {_ci(ratio['ci95'])}, {ratio['rounds']} rounds pooled; per "
                f"launch {per_launch})",
                goal,
                verdict,
            )
        )
    for launch in over["launches"]:
        host = launch.get("host")
        if host:
            rows.append(
                (
                    f"host Python per step under cProfile; waits for the GPU per step ({launch['commit']})",
                    "; ".join(
                        f"`{name}` {h['profiled_ms_per_step']:.2f} ms, {h['syncs_per_step']:.2f} waits"
                        for name, h in host.items()
                    ),
                    "–",
                    "",
                )
            )
    for launch in load("gpu_demo")["launches"]:
        lightning, plain = launch["lightning"], launch["plain"]
        rows.append(
            (
                f"README's main job (`recipes/char_lm`, {launch['processes']} GPU): Lightning vs its plain loop "
                f"({launch['commit']})",
                f"{lightning['steps']} steps, loss {lightning['first_loss']:.3f} → {lightning['last_loss']:.3f}; "
                f"largest difference in a step's loss {launch['max_loss_difference']:.3g}, in a weight "
                f"{launch['max_weight_difference']:.3g}; {lightning['wall_s']:.1f} s vs {plain['wall_s']:.1f} s",
                "the same numbers",
                _mark(
                    launch["same_steps"] and launch["max_loss_difference"] == 0 and launch["max_weight_difference"] == 0
                ),
            )
        )
    for launch in comp["launches"]:
        for kind, h in launch.get("hooks", {}).items():
            rows.append(
                (
                    f"{kind} hook cost per step, ours vs torch's `{kind}_compress_hook` ({launch['label']}, "
                    f"{launch['commit']})",
                    f"{h['ours_hook_cost_ms']:+.2f} ms vs {h['torch_hook_cost_ms']:+.2f} ms "
                    f"(step {h['ours_ms']:.2f} vs {h['torch_ms']:.2f} ms)",
                    "–",
                    "",
                )
            )
        for rank, p in launch.get("powersgd", {}).items():
            rows.append(
                (
                    f"PowerSGD rank {rank[4:]} compute per step, measured (vs the what-if cost model)",
                    f"{p['measured_compute_ms']:.2f} ms ({p['whatif_model']['total_ms']:.2f} ms)",
                    "–",
                    "",
                )
            )
    for launch in wi["launches"]:
        rows.append(
            (
                "`whatif --compute-scale`: GPU / CPU compute of the 8M MLP (same machine; CPU: "
                f"{launch.get('cpu_threads', 'half its cores as')} threads)",
                f"{launch['compute_scale']:.3f} (GPU {launch['gpu']['compute_ms']:.2f} ms, "
                f"CPU {launch['cpu']['compute_ms']:.2f} ms)",
                "–",
                "",
            )
        )
        rows.append(
            (
                "`whatif` on the CPU profile × that scale vs the GPU's measured step",
                f"{launch['predicted_gpu_step_ms']:.2f} vs {launch['measured_gpu_step_ms']:.2f} ms "
                f"({_signed_percent(launch['error'])})",
                "–",
                "",
            )
        )
    first = comp["launches"][0]
    note = (
        f"{_gpu_card(over['machine'])}; world size 1 (one GPU: NCCL's all-reduce is a copy, so these are the "
        f"costs of our hooks and checks, not of a link). Compression: {first['model']}, batch {first['batch']}, "
        "AMP (`16-mixed`; `bf16-mixed` for the bf16 rows), each hook's cost against its strategy without a hook. "
        "Fits interleaved in one process, order rotated every round, medians; each launch's first round not kept."
    )
    return f"{table(('measure', 'value', 'goal', 'met'), rows)}\n\n{note}"
