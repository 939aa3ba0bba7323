"""What does ``CommProfiler`` cost per training step?

The 8M-parameter MLP of ``bench/common.py`` (the one ``bench/overhead.py`` uses), 2 ranks,
``strategy="ddp_tuned"`` with and without ``CommProfiler(every_n_steps=50)``. Every launch
is measured the way ``bench/overhead.py`` measures (same launcher, model, data, warm-up
and statistics; see its docstring); the two configurations alternate in one run, in an
order rotated each round, and each figure is the median over rounds of per-launch medians.

Target: the profiler adds at most 3% to the step time.

The verdict uses the *iteration* time (one step's start to the next): the profiler's own
work at the end of a batch (resolving the step's stamps, and every 50 steps a gather
across ranks) runs after the benchmark's step-end stamp, so the step span alone would
miss part of its cost.

    python bench/profiler_overhead.py               # 5 rounds x 2 launches, 100 timed steps each
    python bench/profiler_overhead.py --quick       # smoke run
    python bench/profiler_overhead.py --accelerator cuda --nproc 2
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import overhead  # noqa: E402
from bench.common import print_table, write_json  # noqa: E402

CONFIGS = ("ddp_tuned", "ddp_tuned+profiler")
LIMITS = {("ddp_tuned+profiler", "ddp_tuned"): 1.03}
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "profiler_overhead.json"


def main(argv: Optional[list[str]] = None) -> None:
    # Launches run bench/overhead.py's worker, which knows the "+profiler" configuration.
    args = overhead.parse_args(argv, description=__doc__.split("\n\n")[0], default_out=DEFAULT_OUT)
    print(
        f"8M MLP, batch {args.batch_size} per rank, {args.nproc} ranks on {args.accelerator}; "
        f"{args.rounds} round(s) x {len(CONFIGS)} launches, {args.warmup} warm-up + {args.steps} timed steps each\n"
    )
    started = time.perf_counter()
    launches = overhead.run_rounds(CONFIGS, args)
    buckets = overhead.check_same_buckets(launches)
    summary = overhead.summarize_rounds(launches, CONFIGS)
    targets = overhead.compare(summary, launches, LIMITS, measure="iteration")
    elapsed = time.perf_counter() - started
    header = overhead.report_header(args, CONFIGS)
    payload: dict[str, Any] = {
        "benchmark": "profiler_overhead",
        "machine": header["machine"],
        "settings": {
            **header["settings"],
            "profiler": "CommProfiler(warmup_steps=--warmup, every_n_steps=50)",
            "measure": "iteration: one step start to the next (rank 0)",
        },
        "bucket_layout": buckets,
        "launches": launches,
        "summary": summary,
        "targets": targets,
        "wall_s": elapsed,
    }
    out = write_json(args.out, payload)
    rows = []
    base = summary["ddp_tuned"]
    for config in CONFIGS:
        entry = summary[config]
        rows.append(
            [
                config,
                f"{entry['iteration_ms_median']:.2f}",
                f"{entry['step_ms_median']:.2f}",
                f"{entry['step_ms_spread'][0]:.2f}–{entry['step_ms_spread'][1]:.2f} ({entry['relative_spread']:.1%})",
                f"{entry['iteration_ms_median'] / base['iteration_ms_median']:.3f}",
            ]
        )
    print()
    print_table(
        "CommProfiler cost (median over rounds of per-launch medians)",
        ["configuration", "iteration ms", "step ms", "step spread (min–max)", "× without profiler"],
        rows,
    )
    for name, target in targets.items():
        verdict = "met" if target["met"] else "NOT met"
        noise = " (within noise: a spread is wider than the margin)" if target["within_noise"] else ""
        print(f"{name}: iteration {target['ratio']:.3f} (limit {target['limit']:.2f}) -> {verdict}{noise}; "
              f"step {target['step_ratio']:.3f}")
    print(f"\n{elapsed:.0f} s in all; wrote {out}")


if __name__ == "__main__":
    main()
