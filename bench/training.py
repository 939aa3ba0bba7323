"""What one rank of a step-time benchmark runs: the 8M MLP trained and timed under raw DDP or Lightning.

A *configuration* names the training loop and what is attached to it:

    raw                     a hand-written loop: DistributedDataParallel + DistributedSampler + SGD
    ddp                     Lightning's stock ``Trainer(strategy="ddp")``
    ddp_tuned               ``Trainer(strategy="ddp_tuned")`` (TunedDDPStrategy, default arguments)
    ddp_tuned+profiler      with ``CommProfiler`` on its default schedule
    ddp_tuned+profiler_all  with ``CommProfiler`` timing every step after the warm-up
    ddp_tuned+hook          with only the communication hook CommProfiler times through
    ddp_tuned+unwatched     ``TunedDDPStrategy(hang_timeout=None)``: without the hang watch (on by default)

The timed span is one training step (forward + loss, ``zero_grad``, backward with DDP's
all-reduce, ``optimizer.step()``); in Lightning it runs from the first
``on_train_batch_start`` callback to the first ``on_train_batch_end`` callback. Used by
``bench.overhead``, ``bench.fp16_safety``, ``bench.profiler_overhead`` and
``bench.doctor_overhead`` (which attaches the doctor); their docstrings say why it is measured so.
:func:`compare_launches` is the driver of ``overhead``, ``fp16_safety`` and ``profiler_overhead
--method launches``: every configuration its own launch, in rounds, and the report.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from bench.harness import interleave, launch, worker
from bench.harness.report import print_table, report_header
from bench.harness.stats import summarize
from bench.harness.worker import StepTimer, backend_for, ddp_bucket_layout, worker_device
from bench.models import MLP_WIDTHS, count_parameters, make_data, make_mlp

CONFIGS = (
    "raw",
    "ddp",
    "ddp_tuned",
    "ddp_tuned+profiler",
    "ddp_tuned+profiler_all",
    "ddp_tuned+hook",
    "ddp_tuned+unwatched",
)
LEARNING_RATE = worker.LEARNING_RATE


def run_worker(args: argparse.Namespace) -> None:
    """Train ``warmup + steps`` steps of configuration ``args.worker``; rank 0 writes its timings to ``--worker-out``."""
    worker.start(args.threads)  # Lightning's advice (num_workers, ...) is not what we measure
    device = worker_device(args.accelerator)
    world_size = int(os.environ["WORLD_SIZE"])
    total_steps = args.warmup + args.steps
    # Exactly one epoch of `total_steps` batches per rank: no epoch boundary inside the run.
    dataset = make_data(total_steps * args.batch_size * world_size)
    timer = StepTimer(device)
    if args.worker == "raw":
        result = train_raw(args, dataset, timer, device, total_steps)
    else:
        result = train_lightning(args.worker, args, dataset, timer, device, total_steps)
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
    worker.finish(args.worker_out, result)


def train_raw(
    args: argparse.Namespace, dataset: Any, timer: StepTimer, device: torch.device, total_steps: int
) -> dict[str, Any]:
    """The hand-written loop; returns the bucket layout DDP built and the final loss."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group(backend=backend_for(args.accelerator))
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


def train_lightning(
    config: str,
    args: argparse.Namespace,
    dataset: Any,
    timer: StepTimer,
    device: torch.device,
    total_steps: int,
    *,
    widths: Sequence[int] = MLP_WIDTHS,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """One ``Trainer.fit`` of a Lightning ``config`` on the MLP of ``widths``, ``callbacks`` attached after
    the configuration's; returns the buckets, final loss, callbacks and strategy class."""
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_mgpu  # registers strategy="ddp_tuned"

    if config not in CONFIGS or config == "raw":
        raise ValueError(f"unknown Lightning configuration {config!r}; choose from {CONFIGS[1:]}")
    layout: dict[str, Any] = {}
    name, _, extra = config.partition("+")
    strategy: Any = lightning_mgpu.TunedDDPStrategy(hang_timeout=None) if extra == "unwatched" else name
    attached: list[L.Callback] = [worker.time_each_step(timer, layout=layout)]
    if extra == "profiler":
        # As a user's run would: default schedule (20 steps of every 200 after 5 warm-up
        # steps), logs every 50 profiled steps and at each window's end (a gather across ranks).
        attached.append(lightning_mgpu.CommProfiler(every_n_steps=50))
    elif extra == "profiler_all":
        # Every step after the warm-up, as before profiling windows existed.
        attached.append(lightning_mgpu.CommProfiler(warmup_steps=args.warmup, every_n_steps=50, profile_every=None))
    elif extra == "hook":

        class HookOnly(L.Callback):
            """DDP's all-reduce as the Python hook CommProfiler wraps, with nothing timed."""

            def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
                trainer.strategy.add_comm_hook_wrapper(lambda hook: hook)

        attached.append(HookOnly())
    attached += callbacks
    trainer = worker.trainer(strategy, max_steps=total_steps, callbacks=attached, accelerator=device.type)
    module = worker.regression(make_mlp(widths), nn.functional.mse_loss)
    # shuffle=False here; Lightning swaps in DistributedSampler(shuffle=True, seed=0) itself.
    trainer.fit(module, DataLoader(dataset, batch_size=args.batch_size))
    if trainer.global_step != total_steps:
        raise RuntimeError(f"{config}: Lightning ran {trainer.global_step} steps, expected {total_steps}")
    return {
        "buckets": layout["buckets"],
        "final_loss": module.step_losses[-1].item(),
        "lightning_callbacks": [type(c).__name__ for c in trainer.callbacks],
        "strategy_class": type(trainer.strategy).__name__,
    }


# ----------------------------------------------------------------------------- the driver: one launch per configuration
TIMED_SPAN = (
    "forward+loss, zero_grad, backward, optimizer.step (Lightning: first on_train_batch_start callback to first "
    "on_train_batch_end callback)"
)


def compare_launches(
    benchmark: str,
    module: str,
    configs: tuple[str, ...],
    args: argparse.Namespace,
    limits: Optional[dict[tuple[str, str], float]] = None,
    *,
    measure: str = "step",
) -> dict[str, Any]:
    """The 8M MLP under every configuration, each its own launch of ``module``'s worker, in rotated rounds
    (:func:`bench.harness.interleave.run_rounds`); the report: settings, every launch, the summary and the
    ratios against ``limits``."""
    parameters = count_parameters(make_mlp())
    print(
        f"8M MLP {' -> '.join(map(str, MLP_WIDTHS))}: {parameters:,} parameters "
        f"({parameters * 4 / 2**20:.1f} MiB of fp32 gradients); batch {args.batch_size} per rank, "
        f"{args.nproc} ranks on {args.accelerator} ({backend_for(args.accelerator)}), {args.threads} thread(s) per rank"
    )
    print(f"{args.rounds} round(s) x {len(configs)} launches, {args.warmup} warm-up + {args.steps} timed steps each\n")
    started = time.perf_counter()
    launches = interleave.run_rounds(module, configs, args)
    summary = interleave.summarize_rounds(launches, configs)
    # Same model, data, order and arithmetic: launches that compute the same end on the very same loss.
    final_losses = {launch["label"]: launch["final_loss"] for launch in launches}
    header = report_header(args, configs)
    return {
        "benchmark": benchmark,
        "machine": header["machine"],
        "settings": {
            **header["settings"],
            "learning_rate": LEARNING_RATE,
            "mlp_widths": list(MLP_WIDTHS),
            "parameters": parameters,
            "quick": args.quick,
            "launcher": launch.describe(args.nproc),
            "timed_span": TIMED_SPAN,
            "iteration": "one step start to the next (adds data fetch and the loop's work between steps)",
            "clock": "torch.cuda.Event pairs" if args.accelerator == "cuda" else "time.perf_counter_ns on rank 0",
        },
        "bucket_layout": interleave.check_same_buckets(launches),
        "final_losses": final_losses,
        "same_final_loss": len(set(final_losses.values())) == 1,
        "launches": launches,
        "summary": summary,
        "targets": interleave.compare(summary, launches, limits or {}, measure),
        "wall_s": time.perf_counter() - started,
    }


def print_launches(
    report: dict[str, Any],
    *,
    relative_to: dict[str, str],
    iteration: bool = True,
    measure: str = "step",
    title: str = "Step time per configuration (median over rounds of per-launch medians)",
) -> None:
    """:func:`compare_launches`' report: step median, p90 and spread per configuration (and the iteration
    time), its ``measure`` as a multiple of the configurations in ``relative_to`` (column -> config); the
    targets and their verdicts."""
    summary = report["summary"]
    rows = []
    for config, entry in summary.items():
        low, high = entry["step_ms_spread"]
        rows.append(
            [
                config,
                f"{entry['step_ms_median']:.2f}",
                f"{entry['step_ms_p90']:.2f}",
                f"{low:.2f}–{high:.2f} ({entry['relative_spread']:.1%})",
                *([f"{entry['iteration_ms_median']:.2f}"] if iteration else []),
                *(
                    f"{entry[f'{measure}_ms_median'] / summary[other][f'{measure}_ms_median']:.3f}"
                    for other in relative_to.values()
                ),
            ]
        )
    sizes = ", ".join(f"{size / 2**20:.2f}" for size in report["bucket_layout"]["bucket_bytes"])
    print()
    print_table(
        title,
        [
            "configuration",
            "step ms",
            "p90 ms",
            "spread ms (min–max, % of median)",
            *(["iteration ms"] if iteration else []),
            *relative_to,
        ],
        rows,
        caption=f"DDP buckets in all launches: [{sizes}] MiB",
    )
    other = "iteration" if measure == "step" else "step"
    for name, target in report["targets"].items():
        noise = {
            None: "  (one launch per configuration: no noise estimate)",
            True: "  (within noise: a spread is wider than the margin)",
            False: "",
        }[target["within_noise"]]
        print(
            f"{name}: {measure} {target['ratio']:.3f} (limit {target['limit']:.2f}) -> "
            f"{'met' if target['met'] else 'NOT met'}{noise}; {other} {target[f'{other}_ratio']:.3f}"
        )
