"""What does ``DistributedDoctor`` cost per training step?

The 8M-parameter MLP of ``bench/common.py`` (the one ``bench/overhead.py`` uses), 2 ranks,
``strategy="ddp_tuned"`` with and without ``DistributedDoctor()`` (default settings:
a check after the first batch and every 100 batches, each epoch start and each epoch's
first batch, and at the end). The two configurations alternate in one run, in an order
rotated each round; every launch is ``torch.distributed.run`` on this script, as in
``bench/overhead.py``, and each figure is the median over rounds of per-launch medians.

The verdict uses the *iteration* time (one step's start to the next): the doctor's work at
the end of a batch (and its checks, which gather from every rank) runs after the
benchmark's step-end stamp, so the step span alone would miss it. The worker also times
every check the doctor makes (``check_ms``): one check amortised over ``every_n_steps``
batches is the periodic part of the cost.

    python bench/doctor_overhead.py                 # 5 rounds x 2 launches, 10 warm-up + 200 timed steps each
    python bench/doctor_overhead.py --quick         # smoke run
    python bench/doctor_overhead.py --model tiny    # a 2-layer MLP: the per-batch hooks' cost in relative terms
    python bench/doctor_overhead.py --accelerator cuda --nproc 2
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
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from bench import overhead  # noqa: E402
from bench.common import MLP_WIDTHS, StepTimer, make_data, make_mlp, print_table, summarize, write_json  # noqa: E402

CONFIGS = ("ddp_tuned", "ddp_tuned+doctor")
LIMITS = {("ddp_tuned+doctor", "ddp_tuned"): 1.02}
MODELS = {"mlp8m": MLP_WIDTHS, "tiny": (32, 64, 1)}
ROUNDS, STEPS, WARMUP, BATCH_SIZE = 5, 200, 10, 64
QUICK = {"rounds": 1, "steps": 10, "warmup": 2}
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "doctor_overhead.json"


# ----------------------------------------------------------------------------- one launch (every rank)
def run_worker(args: argparse.Namespace) -> None:
    import logging

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_mgpu.callbacks.doctor import DistributedDoctor

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    cuda = args.accelerator == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    total_steps = args.warmup + args.steps
    widths = MODELS[args.model]
    dataset = make_data(total_steps * args.batch_size * world_size, widths)  # one epoch, no boundary inside
    timer = StepTimer(device)
    check_ms: list[tuple[str, float]] = []  # (kind, ms) of every check on this rank
    hook_us: dict[str, list[float]] = {"on_train_batch_start": [], "on_after_backward": [], "on_train_batch_end": []}

    class MLPRegression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp(widths)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return nn.functional.mse_loss(self.net(inputs), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class TimeEachStep(L.Callback):
        # First in the list: its batch-end stamp comes before the doctor's batch-end work.
        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            timer.start()

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            timer.stop()

    callbacks: list[L.Callback] = [TimeEachStep()]
    doctor: Optional[DistributedDoctor] = None
    if args.worker.endswith("+doctor"):
        doctor = DistributedDoctor()
        original = doctor._check

        def timed_check(trainer: Any, pl_module: Any, kind: str) -> None:
            started = time.perf_counter()
            original(trainer, pl_module, kind)
            check_ms.append((kind, 1e3 * (time.perf_counter() - started)))

        doctor._check = timed_check  # type: ignore[method-assign]

        def timed_hook(name: str) -> None:
            # The hook's own time, checks excluded (they are timed above): the per-batch cost.
            hook = getattr(doctor, name)

            def wrapper(*hook_args: Any) -> None:
                started, checks_before = time.perf_counter(), sum(ms for _, ms in check_ms)
                hook(*hook_args)
                hook_us[name].append(1e6 * (time.perf_counter() - started) - 1e3 * (sum(ms for _, ms in check_ms)
                                                                                   - checks_before))

            setattr(doctor, name, wrapper)

        for name in ("on_train_batch_start", "on_after_backward", "on_train_batch_end"):
            timed_hook(name)
        callbacks.append(doctor)
    trainer = L.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=local_world_size,
        num_nodes=world_size // local_world_size,
        strategy="ddp_tuned",
        max_steps=total_steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(MLPRegression(), DataLoader(dataset, batch_size=args.batch_size))
    if trainer.global_step != total_steps:
        raise RuntimeError(f"{args.worker}: ran {trainer.global_step} steps, expected {total_steps}")
    if int(os.environ["RANK"]) == 0:
        step_ms, iteration_ms = timer.step_ms(skip=args.warmup), timer.iteration_ms(skip=args.warmup)
        result = {
            "config": args.worker,
            "world_size": world_size,
            "step_ms": step_ms,
            "iteration_ms": iteration_ms,
            "step": summarize(step_ms),
            "iteration": summarize(iteration_ms),
            "check_ms": check_ms,
            "hook_us": {name: summarize(values[args.warmup:]) for name, values in hook_us.items() if values},
            "doctor_findings": None if doctor is None else [f.rule for f in doctor.findings],
            "doctor_checks": None if doctor is None else doctor._checks,
        }
        Path(args.worker_out).write_text(json.dumps(result))
    del trainer
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver
def launch(config: str, args: argparse.Namespace, scratch: Path, label: str) -> dict[str, Any]:
    worker_out = scratch / f"{label}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        str(Path(__file__).resolve()), "--worker", config, "--worker-out", str(worker_out),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
        "--accelerator", args.accelerator, "--threads", str(args.threads), "--model", args.model,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
    except subprocess.TimeoutExpired as error:
        tail = overhead._tail(error.stdout, error.stderr)
        raise SystemExit(f"{label}: timed out after {args.launch_timeout} s\n{tail}") from None
    if done.returncode != 0 or not worker_out.exists():
        raise SystemExit(f"{label}: failed (exit code {done.returncode})\n{overhead._tail(done.stdout, done.stderr)}")
    report: dict[str, Any] = json.loads(worker_out.read_text())
    report["launch_wall_s"] = time.perf_counter() - started
    return report


def run_rounds(args: argparse.Namespace) -> list[dict[str, Any]]:
    launches: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_doctor_") as scratch:
        for round_index in range(args.rounds):
            order = CONFIGS[round_index % 2 :] + CONFIGS[: round_index % 2]
            for position, config in enumerate(order):
                label = f"round{round_index + 1}_{config}"
                report = launch(config, args, Path(scratch), label)
                report.update(label=label, round=round_index, position=position)
                launches.append(report)
                print(
                    f"round {round_index + 1}/{args.rounds}  {config:<17} step {report['step']['median']:7.2f} ms  "
                    f"iteration {report['iteration']['median']:7.2f} ms  ({report['launch_wall_s']:.1f} s)"
                )
    return launches


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per launch")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps first (>= 2)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="per rank")
    parser.add_argument("--model", choices=tuple(MODELS), default="mlp8m")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given explicitly")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (cores // nproc)")
    parser.add_argument("--launch-timeout", type=float, default=900.0)
    parser.add_argument("--worker", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:]) if a.startswith("--")}
        for name, value in QUICK.items():
            if name not in given:
                setattr(args, name, value)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.nproc)
    for name in ("rounds", "steps", "batch_size", "nproc", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 2 or args.steps < 2:
        parser.error("--warmup and --steps must be >= 2")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    print(f"{args.model} MLP, batch {args.batch_size} per rank, {args.nproc} ranks on {args.accelerator}; "
          f"{args.rounds} round(s) x 2 launches, {args.warmup} warm-up + {args.steps} timed steps each\n")
    started = time.perf_counter()
    launches = run_rounds(args)
    summary = overhead.summarize_rounds(launches, CONFIGS)
    targets = overhead.compare(summary, launches, LIMITS, measure="iteration")
    checks: dict[str, list[float]] = {}
    for launch in launches:
        for kind, ms in launch["check_ms"]:
            checks.setdefault(kind, []).append(ms)
    findings = sorted({rule for launch in launches for rule in (launch["doctor_findings"] or [])})
    hooks: dict[str, list[float]] = {}
    for launch in launches:
        for name, stats in launch.get("hook_us", {}).items():
            hooks.setdefault(name, []).append(stats["median"])
    hook_us = {name: summarize(values)["median"] for name, values in hooks.items()}
    header = overhead.report_header(args, CONFIGS)
    payload: dict[str, Any] = {
        "benchmark": "doctor_overhead",
        "machine": header["machine"],
        "settings": {**header["settings"], "model": args.model, "doctor": "DistributedDoctor() (every_n_steps=100)",
                     "measure": "iteration: one step start to the next (rank 0)"},  # fmt: skip
        "launches": launches,
        "summary": summary,
        "targets": targets,
        # Each check's time on rank 0, by kind. It includes waiting in the gather for the other rank;
        # "epoch_start" and the first "periodic" run once at start-up, right after set-up.
        "check_ms": {kind: summarize(values) for kind, values in checks.items()},
        # Median time of each hook per batch (its checks excluded), median over launches, microseconds.
        "hook_us_per_batch": hook_us,
        "checks_per_launch": [launch["doctor_checks"] for launch in launches if launch["doctor_checks"] is not None],
        "doctor_findings": findings,
        "wall_s": time.perf_counter() - started,
    }
    out = write_json(args.out, payload)
    base = summary["ddp_tuned"]
    rows = [
        [
            config,
            f"{summary[config]['iteration_ms_median']:.2f}",
            f"{summary[config]['step_ms_median']:.2f}",
            f"{summary[config]['step_ms_spread'][0]:.2f}–{summary[config]['step_ms_spread'][1]:.2f} "
            f"({summary[config]['relative_spread']:.1%})",
            f"{summary[config]['iteration_ms_median'] / base['iteration_ms_median']:.4f}",
        ]
        for config in CONFIGS
    ]
    print()
    print_table("DistributedDoctor cost (median over rounds of per-launch medians)",
                ["configuration", "iteration ms", "step ms", "step spread (min–max)", "× without doctor"], rows)
    for name, target in targets.items():
        verdict = "met" if target["met"] else "NOT met"
        print(f"{name}: iteration {target['ratio']:.4f} (limit {target['limit']:.2f}) -> {verdict}; per round "
              f"{', '.join(f'{r:.3f}' for r in target['ratio_per_round'])}")
    for kind, c in payload["check_ms"].items():
        print(f"check '{kind}' (gather + rules, rank 0): median {c['median']:.2f} ms, max {c['max']:.2f} ms, "
              f"{c['n'] // max(1, args.rounds)} per launch of {args.warmup + args.steps} steps")
    if hook_us:
        total = sum(hook_us.values())
        per_step = total / 1e3 / base["iteration_ms_median"]
        print(f"the doctor's hooks per batch (checks excluded): {total:.1f} us "
              f"({', '.join(f'{k} {v:.1f}' for k, v in hook_us.items())}) = {per_step:.3%} of an iteration")
    print(f"doctor findings on this (correct) run: {findings or 'none'}")
    print(f"\n{time.perf_counter() - started:.0f} s in all; wrote {out}")


if __name__ == "__main__":
    main()
