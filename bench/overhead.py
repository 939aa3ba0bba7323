"""What does Lightning, and our ``ddp_tuned`` strategy, cost per training step over plain torch DDP?

Three configurations train the same 8M-parameter MLP (``bench/models.py``) on the same
synthetic data, batch and bucket layout (DDP's default: a 1 MiB first bucket, then
25 MiB), with 2 processes:

    raw        a hand-written loop: DistributedDataParallel + DistributedSampler + SGD
    ddp        Lightning's stock ``Trainer(strategy="ddp")``
    ddp_tuned  ours, ``Trainer(strategy="ddp_tuned")`` (TunedDDPStrategy, default arguments)

Targets: ddp_tuned <= 1.02 x ddp and <= 1.05 x raw (median step time).

Run it on a quiet machine (anything else on the cores shows up as noise):

    python -m bench.overhead                        # 5 rounds x 3 launches, 100 timed steps each
    python -m bench.overhead --quick                # smoke run: 1 round, 10 steps (the test runs this)
    python -m bench.overhead --rounds 9 --steps 200 --out bench/results/overhead_long.json
    python -m bench.overhead --accelerator cuda --nproc 2    # 2 GPUs, NCCL, CUDA-event timing

(from the repository root: see ``bench/__init__.py``). The training loops are
:mod:`bench.training`'s, the rounds of launches :mod:`bench.harness.interleave`'s.

How it is measured, and why that way:

* Every configuration is its own launch of ``python -m torch.distributed.run --standalone
  --nproc-per-node=2 -m bench.overhead --worker <config>``, the Lightning ones included
  (Lightning sees torchelastic's environment and does not start processes itself). One
  launcher for all three is the fair choice: identical process start, environment
  (``OMP_NUM_THREADS`` pinned to cores / ranks for every launch) and rendezvous, and the
  Lightning code under test (strategy setup, DDP wrapping, training loop) runs unchanged;
  only its process launching is skipped, and that is never timed. With Lightning's own
  launcher rank 0 would be the parent of rank 1, unlike the raw loop's ranks.
* The timed span is one training step: forward + loss, ``zero_grad``, backward (with
  DDP's all-reduce) and ``optimizer.step()``. In Lightning it runs from the first
  ``on_train_batch_start`` callback to the first ``on_train_batch_end`` callback, i.e.
  Lightning's hooks, closure and result bookkeeping around the step included; the raw
  loop times the same operations in the same order (Lightning zeroes gradients after the
  forward, inside its closure). Fetching the batch and moving it to the device are
  outside the span in all three. Lightning's loop also works *between* steps: with more
  than one process it broadcasts a "SIGTERM received?" flag from rank 0 before every
  batch. The "iteration" column (one step start to the next) holds that part; read it
  too, because that collective also lines the ranks up before each step, which moves
  waiting for a late rank out of Lightning's step span (the raw loop waits inside its
  span, in the all-reduce).
* Progress bar, logger, checkpointing and model summary are off in the Lightning runs:
  we compare training loops, not console output or disk writes.
* The first ``--warmup`` steps are not timed (DDP rebuilds its buckets at the start of
  the second step; allocators and caches settle). Then ``--steps`` steps are timed on
  rank 0 with no barrier in the loop: host clock on CPU, CUDA events on GPUs.
* Rounds: each of ``--rounds`` rounds runs every configuration once, in an order rotated
  by one each round, so drift in machine load does not favour one configuration.
  Per configuration: the median over rounds of the per-launch median step time (and of
  the per-launch p90), and the spread (min-max) of the per-launch medians. When that
  spread is wider than the margin being tested, the ratios are noise.
* Every launch reports the bucket layout DDP built (sizes and parameters per bucket);
  the script stops with an error if the three configurations differ.

Writes ``--out`` (default bench/results/overhead.json): machine facts, settings, every
launch's per-step times, the summary and whether each target is met.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Optional

from bench import RESULTS, training
from bench.harness import interleave, launch
from bench.harness.report import print_table, report_header, write_json
from bench.harness.worker import backend_for
from bench.models import MLP_WIDTHS, count_parameters, make_mlp

MODULE = "bench.overhead"  # what its launches run: this script's worker
CONFIGS = ("raw", "ddp", "ddp_tuned")
TARGETS = {  # (numerator, denominator): the largest acceptable ratio of median step times
    ("ddp_tuned", "ddp"): 1.02,
    ("ddp_tuned", "raw"): 1.05,
}
DEFAULT_OUT = RESULTS / "overhead.json"


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        training.run_worker(args)
        return

    parameters = count_parameters(make_mlp())
    print(
        f"8M MLP {' -> '.join(map(str, MLP_WIDTHS))}: {parameters:,} parameters "
        f"({parameters * 4 / 2**20:.1f} MiB of fp32 gradients); batch {args.batch_size} per rank, "
        f"{args.nproc} ranks on {args.accelerator} ({backend_for(args.accelerator)}), {args.threads} thread(s) per rank"
    )
    print(f"{args.rounds} round(s) x {len(CONFIGS)} launches, {args.warmup} warm-up + {args.steps} timed steps each\n")

    started = time.perf_counter()
    launches = interleave.run_rounds(MODULE, CONFIGS, args)
    buckets = interleave.check_same_buckets(launches)
    summary = interleave.summarize_rounds(launches, CONFIGS)
    targets = interleave.compare(summary, launches, TARGETS)
    # Same model, data, order and arithmetic: every launch should end on the very same loss.
    final_losses = {launch["label"]: launch["final_loss"] for launch in launches}
    elapsed = time.perf_counter() - started

    header = report_header(args, CONFIGS)
    payload = {
        "benchmark": "overhead",
        "machine": header["machine"],
        "settings": {
            **header["settings"],
            "learning_rate": training.LEARNING_RATE,
            "mlp_widths": list(MLP_WIDTHS),
            "parameters": parameters,
            "quick": args.quick,
            "launcher": launch.describe(args.nproc),
            "timed_span": "forward+loss, zero_grad, backward, optimizer.step (Lightning: first on_train_batch_start "
            "callback to first on_train_batch_end callback)",
            "iteration": "one step start to the next (adds data fetch and the loop's work between steps)",
            "clock": "torch.cuda.Event pairs" if args.accelerator == "cuda" else "time.perf_counter_ns on rank 0",
        },
        "bucket_layout": buckets,
        "final_losses": final_losses,
        "same_final_loss": len(set(final_losses.values())) == 1,
        "launches": launches,
        "summary": summary,
        "targets": targets,
        "wall_s": elapsed,
    }
    out = write_json(args.out, payload)
    print_report(summary, targets, buckets, final_losses, elapsed, out)


def print_report(
    summary: dict[str, dict[str, Any]],
    targets: dict[str, dict[str, Any]],
    buckets: dict[str, Any],
    final_losses: dict[str, float],
    elapsed: float,
    out: Path,
) -> None:
    rows = []
    for config in CONFIGS:
        entry = summary[config]
        low, high = entry["step_ms_spread"]
        rows.append(
            [
                config,
                f"{entry['step_ms_median']:.2f}",
                f"{entry['step_ms_p90']:.2f}",
                f"{low:.2f}–{high:.2f} ({entry['relative_spread']:.1%})",
                f"{entry['iteration_ms_median']:.2f}",
                f"{entry['step_ms_median'] / summary['raw']['step_ms_median']:.3f}",
                f"{entry['step_ms_median'] / summary['ddp']['step_ms_median']:.3f}",
            ]
        )
    sizes = ", ".join(f"{size / 2**20:.2f}" for size in buckets["bucket_bytes"])
    print()
    print_table(
        "Step time per configuration (median over rounds of per-launch medians)",
        ["configuration", "step ms", "p90 ms", "spread ms (min–max, % of median)", "iteration ms", "× raw", "× ddp"],
        rows,
        caption=f"DDP buckets in all launches: [{sizes}] MiB",
    )
    if len(set(final_losses.values())) == 1:
        print(f"Final loss {next(iter(final_losses.values())):.6f} in every launch: the same computation in all three.")
    else:
        print(f"WARNING: final losses differ, the configurations do not compute the same thing: {final_losses}")
    for name, target in targets.items():
        verdict = "met" if target["met"] else "NOT met"
        noise = {
            None: "  (one launch per configuration: no noise estimate)",
            True: "  (within noise: a spread is wider than the margin)",
            False: "",
        }[target["within_noise"]]
        print(
            f"{name}: step {target['ratio']:.3f} (limit {target['limit']:.2f}) -> {verdict}{noise}; "
            f"iteration {target['iteration_ratio']:.3f}"
        )
    print(f"\n{elapsed:.0f} s in all; wrote {out}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    return interleave.parse_args(argv, doc=__doc__, default_out=DEFAULT_OUT, workers=training.CONFIGS)


if __name__ == "__main__":
    main()
