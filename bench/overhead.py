"""What does Lightning, and our ``ddp_tuned`` strategy, cost per training step over plain torch DDP?

Three configurations train the same 8M-parameter MLP (``bench/common.py``) on the same
synthetic data, batch and bucket layout (DDP's default: a 1 MiB first bucket, then
25 MiB), with 2 processes:

    raw        a hand-written loop: DistributedDataParallel + DistributedSampler + SGD
    ddp        Lightning's stock ``Trainer(strategy="ddp")``
    ddp_tuned  ours, ``Trainer(strategy="ddp_tuned")`` (TunedDDPStrategy, default arguments)

Targets: ddp_tuned <= 1.02 x ddp and <= 1.05 x raw (median step time).

Run it on a quiet machine (anything else on the cores shows up as noise):

    python bench/overhead.py                        # 5 rounds x 3 launches, 100 timed steps each
    python bench/overhead.py --quick                # smoke run: 1 round, 10 steps (the test runs this)
    python bench/overhead.py --rounds 9 --steps 200 --out bench/results/overhead_long.json
    python bench/overhead.py --accelerator cuda --nproc 2    # 2 GPUs, NCCL, CUDA-event timing

How it is measured, and why that way:

* Every configuration is its own launch of ``python -m torch.distributed.run --standalone
  --nproc-per-node=2 bench/overhead.py --worker <config>``, the Lightning ones included
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
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

# `python bench/overhead.py` puts bench/ on sys.path, not the repository root.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import (  # noqa: E402
    apply_quick,
    MLP_WIDTHS,
    StepTimer,
    count_parameters,
    ddp_bucket_layout,
    machine_facts,
    make_data,
    make_mlp,
    print_table,
    summarize,
    write_json,
)

# ----------------------------------------------------------------------------- settings
CONFIGS = ("raw", "ddp", "ddp_tuned")
# Every configuration a worker can run; "+profiler" adds CommProfiler with its default
# schedule, "+profiler_all" CommProfiler timing every step, "+hook" only the communication
# hook CommProfiler times through (bench/profiler_overhead.py).
WORKERS = (*CONFIGS, "ddp_tuned+profiler", "ddp_tuned+profiler_all", "ddp_tuned+hook")
TARGETS = {  # (numerator, denominator): the largest acceptable ratio of median step times
    ("ddp_tuned", "ddp"): 1.02,
    ("ddp_tuned", "raw"): 1.05,
}
ROUNDS = 5
STEPS = 100  # timed steps per launch
WARMUP = 10  # untimed steps first; DDP rebuilds its buckets at the start of step 2
BATCH_SIZE = 64  # per process
LEARNING_RATE = 0.01
QUICK = {"rounds": 1, "steps": 10, "warmup": 2}
LAUNCH_TIMEOUT_S = 900
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "overhead.json"


# ----------------------------------------------------------------------------- one launch (runs in every rank)
def run_worker(args: argparse.Namespace) -> None:
    """Train ``warmup + steps`` steps of one configuration; rank 0 writes its timings to ``--worker-out``."""
    warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, ...) is not what we measure
    torch.set_num_threads(args.threads)
    device = _worker_device(args.accelerator)
    world_size = int(os.environ["WORLD_SIZE"])
    total_steps = args.warmup + args.steps
    # Exactly one epoch of `total_steps` batches per rank: no epoch boundary inside the run.
    dataset = make_data(total_steps * args.batch_size * world_size)
    timer = StepTimer(device)
    if args.worker == "raw":
        result = _train_raw(args, dataset, timer, device, total_steps)
    else:
        result = _train_lightning(args, dataset, timer, device, total_steps)
    if int(os.environ["RANK"]) == 0:
        step_ms = timer.step_ms(skip=args.warmup)
        iteration_ms = timer.iteration_ms(skip=args.warmup)
        if len(step_ms) != args.steps:
            raise RuntimeError(f"{args.worker}: timed {len(step_ms)} steps, expected {args.steps}")
        result.update(
            config=args.worker,
            world_size=world_size,
            threads=torch.get_num_threads(),
            step_ms=step_ms,
            iteration_ms=iteration_ms,
            step=summarize(step_ms),
            iteration=summarize(iteration_ms),
        )
        Path(args.worker_out).write_text(json.dumps(result))
    # A DDP wrapper or gloo process group still alive at interpreter exit can abort the
    # process: free the (cyclic) Lightning objects now, then the group.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker_device(accelerator: str) -> torch.device:
    if accelerator == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _train_raw(
    args: argparse.Namespace, dataset: Any, timer: StepTimer, device: torch.device, total_steps: int
) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group(backend=_backend(args.accelerator))
    model = make_mlp().to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LEARNING_RATE)
    # The sampler Lightning puts in automatically (shuffle=True, seed 0): same batches in all three.
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    ddp_model.train()
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        timer.start()
        loss = nn.functional.mse_loss(ddp_model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        timer.stop()
    if len(loader) != total_steps:
        raise RuntimeError(f"raw loop ran {len(loader)} steps, expected {total_steps}")

    result = {"buckets": ddp_bucket_layout(ddp_model), "final_loss": loss.item(), "lightning_callbacks": None}
    del ddp_model
    return result


def _train_lightning(
    args: argparse.Namespace, dataset: Any, timer: StepTimer, device: torch.device, total_steps: int
) -> dict[str, Any]:
    import logging

    import lightning as L
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    import lightning_mgpu  # registers strategy="ddp_tuned"

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)

    class MLPRegression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()
            self.last_loss = torch.tensor(float("nan"))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            loss = nn.functional.mse_loss(self.net(inputs), targets)
            self.last_loss = loss.detach()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE)

    result: dict[str, Any] = {}

    class TimeEachStep(L.Callback):
        # Callback hooks run before the LightningModule's and the strategy's own hooks of
        # the same name, so this span holds all of Lightning's per-step work.
        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            timer.start()

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            timer.stop()

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            # Read now: TunedDDPStrategy releases its DDP wrapper at teardown.
            ddp_model = trainer.strategy.model
            if not isinstance(ddp_model, DistributedDataParallel):
                raise RuntimeError(f"{args.worker}: expected a DDP-wrapped model, got {type(ddp_model).__name__}")
            result["buckets"] = ddp_bucket_layout(ddp_model)

    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    strategy, _, extra = args.worker.partition("+")
    callbacks: list[L.Callback] = [TimeEachStep()]
    if extra == "profiler":
        # As a user's run would: default schedule (20 steps of every 200 after 5 warm-up
        # steps), logs every 50 profiled steps and at each window's end (a gather across ranks).
        callbacks.append(lightning_mgpu.CommProfiler(every_n_steps=50))
    elif extra == "profiler_all":
        # Every step after the warm-up, as before profiling windows existed.
        callbacks.append(lightning_mgpu.CommProfiler(warmup_steps=args.warmup, every_n_steps=50, profile_every=None))
    elif extra == "hook":

        class HookOnly(L.Callback):
            """DDP's all-reduce as the Python hook CommProfiler wraps, with nothing timed."""

            def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
                trainer.strategy.add_comm_hook_wrapper(lambda hook: hook)

        callbacks.append(HookOnly())
    trainer = L.Trainer(
        accelerator="cuda" if device.type == "cuda" else "cpu",
        devices=local_world_size,
        num_nodes=int(os.environ["WORLD_SIZE"]) // local_world_size,
        strategy=strategy,
        max_steps=total_steps,
        callbacks=callbacks,
        # We compare training loops: no console output, logging or checkpoint writing.
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    model = MLPRegression()
    # shuffle=False here; Lightning swaps in DistributedSampler(shuffle=True, seed=0) itself.
    trainer.fit(model, DataLoader(dataset, batch_size=args.batch_size))
    if trainer.global_step != total_steps:
        raise RuntimeError(f"{args.worker}: Lightning ran {trainer.global_step} steps, expected {total_steps}")
    result.update(
        final_loss=model.last_loss.item(),
        lightning_callbacks=[type(c).__name__ for c in trainer.callbacks],
        strategy_class=type(trainer.strategy).__name__,
    )
    return result


def _backend(accelerator: str) -> str:
    return "nccl" if accelerator == "cuda" else "gloo"


# ----------------------------------------------------------------------------- driver (runs once, starts the launches)
def launch(
    config: str,
    args: argparse.Namespace,
    scratch: Path,
    label: str,
    script: Optional[Path] = None,
    extra_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One ``torch.distributed.run`` launch of ``config`` (a ``--worker`` of ``script``, this
    file by default, given ``extra_args`` too); returns rank 0's report."""
    worker_out = scratch / f"{label}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        str(script or Path(__file__).resolve()), "--worker", config, "--worker-out", str(worker_out),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
        "--accelerator", args.accelerator, "--threads", str(args.threads), *extra_args,
    ]  # fmt: skip
    # No --nproc here: torch.distributed.run would read it as an abbreviation of its own
    # --nproc-per-node. Workers take the world size from the environment.
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    try:
        completed = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=args.launch_timeout, cwd=REPO_ROOT
        )
    except subprocess.TimeoutExpired as error:
        message = f"{label}: launch timed out after {args.launch_timeout} s\n{_tail(error.stdout, error.stderr)}"
        raise SystemExit(message) from None
    if completed.returncode != 0 or not worker_out.exists():
        raise SystemExit(
            f"{label}: launch failed (exit code {completed.returncode})\n$ {' '.join(command)}\n"
            f"{_tail(completed.stdout, completed.stderr)}"
        )
    report = json.loads(worker_out.read_text())
    report["launch_wall_s"] = time.perf_counter() - started
    return report


def _tail(stdout: Any, stderr: Any, lines: int = 40) -> str:
    def text(value: Any) -> str:
        return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")

    return "\n".join((text(stdout) + text(stderr)).splitlines()[-lines:])


def check_same_buckets(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """The bucket layout every launch reported; exits with both layouts if two differ."""
    reference = launches[0]
    for other in launches:
        if not other["buckets"]["rebuilt"]:
            raise SystemExit(f"{other['label']}: DDP has not rebuilt its buckets; use --warmup >= 2")
        if other["buckets"] != reference["buckets"]:
            raise SystemExit(
                "Bucket layouts differ, the comparison would not be like for like:\n"
                f"  {reference['label']}: {reference['buckets']}\n  {other['label']}: {other['buckets']}"
            )
    return reference["buckets"]


def summarize_rounds(launches: list[dict[str, Any]], configs: tuple[str, ...] = CONFIGS) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for config in configs:
        mine = [launch for launch in launches if launch["config"] == config]
        medians = [launch["step"]["median"] for launch in mine]
        center = summarize(medians)["median"]
        summary[config] = {
            "launches": len(mine),
            "step_ms_median": center,
            "step_ms_p90": summarize([launch["step"]["p90"] for launch in mine])["median"],
            "step_ms_spread": [min(medians), max(medians)],
            "relative_spread": (max(medians) - min(medians)) / center,
            "iteration_ms_median": summarize([launch["iteration"]["median"] for launch in mine])["median"],
        }
    return summary


def compare(
    summary: dict[str, dict[str, Any]],
    launches: list[dict[str, Any]],
    limits: Optional[dict[tuple[str, str], float]] = None,
    measure: str = "step",
) -> dict[str, dict[str, Any]]:
    """Ratios of median ``measure`` times ("step" or "iteration") against the limits, plus
    the same ratio round by round."""
    targets = {}
    for (numerator, denominator), limit in (limits or TARGETS).items():
        ratio = summary[numerator][f"{measure}_ms_median"] / summary[denominator][f"{measure}_ms_median"]
        per_round = []
        for round_index in sorted({launch["round"] for launch in launches}):
            medians = {l["config"]: l[measure]["median"] for l in launches if l["round"] == round_index}
            per_round.append(medians[numerator] / medians[denominator])
        targets[f"{numerator}/{denominator}"] = {
            "ratio": ratio,
            "measure": measure,
            "step_ratio": summary[numerator]["step_ms_median"] / summary[denominator]["step_ms_median"],
            # End to end: counts Lightning's per-batch broadcast, which the step span leaves out.
            "iteration_ratio": summary[numerator]["iteration_ms_median"] / summary[denominator]["iteration_ms_median"],
            "limit": limit,
            "met": ratio <= limit,
            "ratio_per_round": per_round,
            # The noise floor: when either spread is wider than the margin, "met" is luck.
            # One launch per configuration has no spread to judge by: None.
            "within_noise": None
            if len(per_round) < 2
            else max(summary[numerator]["relative_spread"], summary[denominator]["relative_spread"]) > limit - 1,
        }
    return targets


def report_header(args: argparse.Namespace, configs: tuple[str, ...]) -> dict[str, Any]:
    """The machine and the settings every launch-based benchmark records."""
    return {
        "machine": machine_facts(
            backend=_backend(args.accelerator),
            world_size=args.nproc,
            device_type=args.accelerator,
            threads_per_rank=args.threads,
        ),
        "settings": {
            "configs": list(configs),
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "batch_size_per_rank": args.batch_size,
        },
    }


def run_rounds(configs: tuple[str, ...], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``args.rounds`` rounds, each launching every configuration once in a rotated order."""
    launches: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_") as scratch:
        for round_index in range(args.rounds):
            order = configs[round_index % len(configs) :] + configs[: round_index % len(configs)]
            for position, config in enumerate(order):
                label = f"round{round_index + 1}_{config}"
                report = launch(config, args, Path(scratch), label)
                report.update(label=label, round=round_index, position=position)
                launches.append(report)
                check_same_buckets(launches)
                print(
                    f"round {round_index + 1}/{args.rounds}  {config:<18} step median {report['step']['median']:8.2f} ms"
                    f"  p90 {report['step']['p90']:8.2f} ms  iteration {report['iteration']['median']:8.2f} ms"
                    f"  ({report['launch_wall_s']:.1f} s)"
                )
    return launches


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return

    parameters = count_parameters(make_mlp())
    print(
        f"8M MLP {' -> '.join(map(str, MLP_WIDTHS))}: {parameters:,} parameters "
        f"({parameters * 4 / 2**20:.1f} MiB of fp32 gradients); batch {args.batch_size} per rank, "
        f"{args.nproc} ranks on {args.accelerator} ({_backend(args.accelerator)}), {args.threads} thread(s) per rank"
    )
    print(f"{args.rounds} round(s) x {len(CONFIGS)} launches, {args.warmup} warm-up + {args.steps} timed steps each\n")

    started = time.perf_counter()
    launches = run_rounds(CONFIGS, args)
    buckets = check_same_buckets(launches)
    summary = summarize_rounds(launches)
    targets = compare(summary, launches)
    # Same model, data, order and arithmetic: every launch should end on the very same loss.
    final_losses = {launch["label"]: launch["final_loss"] for launch in launches}
    elapsed = time.perf_counter() - started

    header = report_header(args, CONFIGS)
    payload = {
        "benchmark": "overhead",
        "machine": header["machine"],
        "settings": {
            **header["settings"],
            "learning_rate": LEARNING_RATE,
            "mlp_widths": list(MLP_WIDTHS),
            "parameters": parameters,
            "quick": args.quick,
            "launcher": f"python -m torch.distributed.run --standalone --nproc-per-node={args.nproc}",
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


def parse_args(
    argv: Optional[list[str]] = None,
    *,
    description: Optional[str] = None,
    default_out: Path = DEFAULT_OUT,
    workers: tuple[str, ...] = WORKERS,
    extend: Optional[Callable[[argparse.ArgumentParser], None]] = None,
    quick: Optional[dict[str, Any]] = None,
) -> argparse.Namespace:
    """The options every launch-based benchmark shares; ``extend`` adds a script's own."""
    parser = argparse.ArgumentParser(
        description=description or __doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of one launch per configuration (%(default)s)")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per launch (%(default)s)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps before them, >= 2 (%(default)s)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"per rank ({BATCH_SIZE})")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick or QUICK} unless given explicitly")
    parser.add_argument("--out", type=Path, default=default_out, help="JSON report (%(default)s)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: nccl")
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks) per launch (2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (cores // nproc)")
    parser.add_argument("--launch-timeout", type=float, default=LAUNCH_TIMEOUT_S, help="seconds per launch")
    # Internal: set by `launch` for the processes torch.distributed.run starts.
    parser.add_argument("--worker", choices=workers, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    if extend is not None:
        extend(parser)
    args = parser.parse_args(argv)

    apply_quick(args, argv, QUICK if quick is None else quick)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.nproc)
    for name in ("rounds", "steps", "batch_size", "nproc", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the iteration time needs two step starts), got {args.steps}")
    if args.warmup < 2:
        parser.error(f"--warmup must be >= 2: DDP rebuilds its buckets at the start of step 2, got {args.warmup}")
    if args.worker and not args.worker_out:
        parser.error("--worker needs --worker-out")
    return args


if __name__ == "__main__":
    main()
