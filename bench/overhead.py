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
from typing import Optional

from bench import RESULTS, training
from bench.harness import interleave
from bench.harness.report import write_json

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
    report = training.compare_launches("overhead", MODULE, CONFIGS, args, TARGETS)
    out = write_json(args.out, report)
    final_losses = report["final_losses"]
    if report["same_final_loss"]:
        print(f"Final loss {next(iter(final_losses.values())):.6f} in every launch: the same computation in all three.")
    else:
        print(f"WARNING: final losses differ, the configurations do not compute the same thing: {final_losses}")
    training.print_launches(report, relative_to={"× raw": "raw", "× ddp": "ddp"})
    print(f"\n{report['wall_s']:.0f} s in all; wrote {out}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    return interleave.parse_args(argv, doc=__doc__, default_out=DEFAULT_OUT, workers=training.CONFIGS)


if __name__ == "__main__":
    main()
