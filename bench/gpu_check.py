"""Every CUDA path of the package, run for real, and the first GPU figures: one call on a lent GPU.

    python -m bench.gpu_check --out DIR                 # on a machine with a CUDA device
    python -m bench.gpu_check --out DIR --device cpu --quick   # the dry run: CPU stand-ins

Parts, each its own process with its own time limit (one part's CUDA error or hang cannot take
the others down), in this order:

``selftest``
    ``lightning-mgpu doctor`` (the environment checks and NCCL's smoke test) and
    ``lightning-mgpu doctor --selftest`` (every CUDA code path: NCCL DDP, CUDA-event timing,
    AMP with each compression, a pipeline across ``cuda:0`` and the CPU, the copy streams).
``demo``
    README's main job: the flagship recipe (``recipes/char_lm``) on every GPU, as ``make demo``
    runs it, and its plain-PyTorch loop under torchrun, both recording each step's loss: wall
    time, and how far the two runs' losses and weights are apart on this device.
``unit``
    the in-process test lane (``tests/unit``) with the GPU visible: written on machines without one,
    a test or a code path that assumes none fails here first.
``overhead``
    one GPU, NCCL, world size 1, the 8M MLP of :mod:`bench.models`: Lightning's stock ``ddp``
    (twice: ``ddp-again / ddp`` is the comparison's noise floor), our ``ddp_tuned`` and
    ``ddp_tuned`` + ``CommProfiler()`` (its default schedule), fits interleaved in one process
    (order rotated every round), each step timed with CUDA events
    (:class:`bench.harness.worker.StepTimer`). Figures: ``ddp_tuned / ddp`` (median step) and
    the profiler's cost (mean iteration, re-wraps included: ``bench.profiler_overhead``'s measure);
    then one fit each of ``ddp``, ``ddp_tuned`` and ``ddp_tuned`` + ``CommProfiler()`` under cProfile
    with torch's sync debug mode (the host's Python per step by function, and every operation that
    waits for the device).
``compression``
    a ~100M-parameter MLP (6 x 4096 x 4096), AMP on: per step, our ``compression="fp16"`` /
    ``"bf16"`` against torch's ``fp16_compress_hook`` / ``bf16_compress_hook`` (each beside its
    strategy without a hook, same precision), and ``compression="powersgd"`` at rank 1 and 4
    (its compute per step, measured, and as the what-if cost model has it from
    :func:`lightning_mgpu.whatif.measure.measure_costs` on this device).
``whatif``
    the 8M MLP profiled by ``CommProfiler`` on the GPU and on this machine's CPU (gloo): the
    compute ratio GPU/CPU is the ``--compute-scale`` that turns the CPU profile into this GPU;
    ``lightning-mgpu whatif`` on the CPU profile with it, against the GPU's measured step.

Every part writes ``DIR/gpu_<part>.json``; the run writes ``DIR/gpu_check.json`` (all parts, the
card named) and ``DIR/gpu_check.log`` (every part's output), then prints a short table last.
``--device cpu`` runs the same code with gloo and CPU stand-ins (how it is checked without a GPU;
its figures mean nothing for a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

PARTS = ("selftest", "demo", "unit", "overhead", "compression", "whatif")
PART_TIMEOUT_S = {
    "selftest": 480.0,
    "demo": 300.0,
    "unit": 200.0,
    "overhead": 200.0,
    "compression": 240.0,
    "whatif": 180.0,
}
BIG_WIDTHS = (4096,) * 7  # 6 Linear(4096, 4096): 100.7M parameters
BIG_BATCH = 512
MLP_BATCH = 256
# A ratio pools the launches that measured the code it is about, from this launch's commit on: CommProfiler stopped
# reading the clock between its windows in 5a70791 (the launches before it measured that cost too).
POOLED_SINCE = {"profiler_cost": "5eaf887"}
RECORDED_FUNCTIONS = 20  # of a host profile, by cumulative time, kept in bench/results


# ----------------------------------------------------------------------------------------------- shared
def _card(device: str) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    try:
        import lightning

        facts["lightning"] = lightning.__version__
    except ImportError:  # pragma: no cover - the package needs it
        facts["lightning"] = None
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            card=props.name,
            gpus=torch.cuda.device_count(),
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            nccl=str(torch.cuda.nccl.version()),
        )
    else:
        facts.update(card=f"CPU stand-in ({os.cpu_count()} cores)", gpus=0)
    return facts


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _trainer(device: str, strategy: Any, steps: int, callbacks: list[Any], precision: str = "32-true") -> Any:
    """A world-size-1 Trainer on this device (cuda:0 + NCCL, or the CPU + gloo) that only trains."""
    import lightning as L

    return L.Trainer(
        accelerator="cuda" if device == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _strategy(name: str) -> Any:
    """A strategy of the comparisons by name (a fresh object per fit)."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_mgpu import TunedDDPStrategy

    if name in ("ddp", "ddp-again"):  # ddp-again: the same configuration twice, the comparison's noise floor
        return DDPStrategy()
    if name == "torch-fp16":
        return DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)
    if name == "torch-bf16":
        return DDPStrategy(ddp_comm_hook=default_hooks.bf16_compress_hook)
    if name in ("ddp_tuned", "ddp_tuned+profiler"):
        return TunedDDPStrategy()
    if name in ("ours-fp16", "ours-bf16", "ours-fp16-nosync"):
        return TunedDDPStrategy(compression=name.split("-")[1])  # -nosync: see _timed_fit
    if name.startswith("ours-powersgd-r"):
        return TunedDDPStrategy(
            compression="powersgd", powersgd_rank=int(name.rsplit("r", 1)[1]), powersgd_start_iter=2
        )
    raise ValueError(f"unknown configuration {name!r}")


def _timed_fit(
    device: str,
    name: str,
    widths: tuple[int, ...],
    batch: int,
    *,
    warmup: int,
    steps: int,
    precision: str = "32-true",
    extra_callbacks: Optional[list[Any]] = None,
) -> dict[str, Any]:
    """One fit of an MLP of ``widths`` under configuration ``name``; per-step times after ``warmup``."""
    import gc

    import torch

    from bench.harness.stats import median
    from bench.harness.worker import StepTimer, regression, time_each_step
    from bench.models import make_data, make_mlp

    torch_device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    timer = StepTimer(torch_device)
    model = regression(make_mlp(widths), torch.nn.functional.mse_loss)
    data = make_data(batch * 4, widths)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)
    callbacks = [time_each_step(timer), *(extra_callbacks or [])]
    if name == "ours-fp16-nosync":  # measured, not offered: the fp16 hook without its per-step read of the peaks
        callbacks.append(_without_end_step())
    trainer = _trainer(device, _strategy(name), warmup + steps, callbacks, precision)
    trainer.fit(model, loader)
    step = timer.step_ms(skip=warmup)
    iteration = timer.iteration_ms(skip=warmup)
    losses = model.losses()
    result = {
        "config": name,
        "precision": precision,
        "step_ms_median": median(step),
        "iteration_ms_mean": sum(iteration) / len(iteration) if iteration else float("nan"),
        "steps": len(step),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    if extra_callbacks:  # e.g. CommProfiler's windows: every step, to tell the steps in a window from the others
        result["step_ms_each"] = step
    del trainer, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def _without_end_step() -> Any:
    """A callback that makes the fp16 hook's ``end_step`` (its one host synchronisation a step) do nothing."""
    import lightning as L

    class WithoutEndStep(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            trainer.strategy.comm_hook.end_step = lambda: None

    return WithoutEndStep()


def _rounds(
    configs: list[tuple[str, dict[str, Any]]], rounds: int, run: Callable[[str, dict[str, Any]], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every configuration once per round (order rotated each round); round 0 is a warm-up, not kept."""
    runs = []
    for index in range(rounds + 1):
        shift = index % len(configs)
        for name, options in configs[shift:] + configs[:shift]:
            result = run(name, options)
            result["round"] = index
            print(
                f"  round {index} {name:<22} step {result['step_ms_median']:8.3f} ms  "
                f"iteration {result['iteration_ms_mean']:8.3f} ms  loss {result['first_loss']:.4f} -> "
                f"{result['last_loss']:.4f}",
                flush=True,
            )
            if index:
                runs.append(result)
    return runs


def _ratio(runs: list[dict[str, Any]], numerator: str, denominator: str, stat: str) -> dict[str, Any]:
    from bench.harness.stats import median, median_ci, paired_ratios

    ratios = paired_ratios(runs, numerator, denominator, lambda run: run[stat])
    low, high = median_ci(ratios)
    return {
        "of": f"{numerator} / {denominator}",
        "stat": stat,
        "median": median(ratios),
        "ci95": [low, high],
        "per_round": ratios,
    }


def _medians(runs: list[dict[str, Any]], stat: str) -> dict[str, float]:
    from bench.harness.stats import median

    return {
        name: median([run[stat] for run in runs if run["config"] == name]) for name in {run["config"] for run in runs}
    }


# ----------------------------------------------------------------------------------------------- parts
def part_selftest(args: argparse.Namespace) -> dict[str, Any]:
    """``lightning-mgpu doctor`` then ``lightning-mgpu doctor --selftest``, both as a user runs them."""
    out: dict[str, Any] = {}
    env = dict(os.environ)
    for key, argv in (
        ("doctor", ["doctor", "--json"]),
        (
            "selftest",
            [
                "doctor",
                "--selftest",
                "--json",
                "--selftest-device",
                args.device,
                "--timeout",
                "100",
                "--selftest-jobs",
                "4",
            ],
        ),
    ):
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_mgpu.cli", *argv], capture_output=True, text=True, env=env, timeout=460
        )
        print(proc.stderr[-3000:], file=sys.stderr)
        try:
            report = json.loads(proc.stdout)
        except json.JSONDecodeError:
            report = {"unparsed_stdout": proc.stdout[-4000:]}
        report["exit_code"] = proc.returncode
        report["wall_s"] = time.perf_counter() - started
        out[key] = report
        for check in report.get("checks", []):
            print(
                f"  {key:<9} {check.get('status', '?'):<5} {check.get('name', '?')}: {check.get('message', '')}"[:300]
            )
    return out


def part_overhead(args: argparse.Namespace) -> dict[str, Any]:
    from bench.models import MLP_WIDTHS

    from lightning_mgpu import CommProfiler

    steps, warmup = (10, 2) if args.quick else (150, 10)

    def run(name: str, _: dict[str, Any]) -> dict[str, Any]:
        extra = [CommProfiler(whatif=None)] if name == "ddp_tuned+profiler" else []
        return _timed_fit(args.device, name, MLP_WIDTHS, MLP_BATCH, warmup=warmup, steps=steps, extra_callbacks=extra)

    configs: list[tuple[str, dict[str, Any]]] = [
        ("ddp", {}),
        ("ddp_tuned", {}),
        ("ddp_tuned+profiler", {}),
        ("ddp-again", {}),
    ]
    runs = _rounds(configs, args.rounds, run)
    return {
        "model": "the 8M MLP (bench.models.MLP_WIDTHS)",
        "batch": MLP_BATCH,
        "steps": steps,
        "warmup": warmup,
        "rounds": args.rounds,
        "runs": runs,
        "median_step_ms": _medians(runs, "step_ms_median"),
        "mean_iteration_ms": _medians(runs, "iteration_ms_mean"),
        "ddp_tuned_vs_ddp": {**_ratio(runs, "ddp_tuned", "ddp", "step_ms_median"), "limit": 1.02},
        "ddp_tuned_vs_ddp_iteration": _ratio(runs, "ddp_tuned", "ddp", "iteration_ms_mean"),
        "profiler_cost": {**_ratio(runs, "ddp_tuned+profiler", "ddp_tuned", "iteration_ms_mean"), "limit": 1.03},
        "noise_floor": _ratio(runs, "ddp-again", "ddp", "step_ms_median"),
        "host": {
            name: _host_profile(args.device, name, warmup, 50 if args.quick else 300)
            for name in ("ddp", "ddp_tuned", "ddp_tuned+profiler")
        },
    }


def _host_profile(device: str, name: str, warmup: int, steps: int) -> dict[str, Any]:
    """One more fit of ``name``, its steps after ``warmup`` under cProfile (the host's Python per step, by
    function) and, on CUDA, torch's sync debug mode (each operation that waits for the device, with the
    line that asked for it): where a host-bound step's time goes."""
    import cProfile
    import pstats
    import warnings

    import lightning as L
    import torch

    from bench.harness.worker import regression
    from bench.models import MLP_WIDTHS, make_data, make_mlp

    from lightning_mgpu import CommProfiler

    profile = cProfile.Profile()
    syncs: list[warnings.WarningMessage] = []
    cuda = device == "cuda"

    class Watch(L.Callback):
        def __init__(self) -> None:
            self.catcher: Any = None
            self.seen: list[warnings.WarningMessage] = []

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == warmup and self.catcher is None:
                self.catcher = warnings.catch_warnings(record=True)
                self.seen = self.catcher.__enter__()
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                profile.enable()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            profile.disable()
            if self.catcher is not None:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                syncs.extend(m for m in self.seen if "synchroniz" in str(m.message))
                self.catcher.__exit__(None, None, None)

    model = regression(make_mlp(MLP_WIDTHS), torch.nn.functional.mse_loss)
    loader = torch.utils.data.DataLoader(make_data(MLP_BATCH * 4, MLP_WIDTHS), batch_size=MLP_BATCH)
    extra = [CommProfiler(whatif=None)] if name == "ddp_tuned+profiler" else []
    _trainer(device, _strategy(name), warmup + steps, [Watch(), *extra]).fit(model, loader)
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values())  # every function's own time: the profiled whole
    per_function = sorted(
        (
            (f"{Path(file).name}:{line}({function})", entry[0], entry[3])
            for (file, line, function), entry in stats.items()
        ),
        key=lambda row: -row[2],
    )
    where: dict[str, int] = {}
    for message in syncs:
        key = f"{message.filename}:{message.lineno}"
        where[key] = where.get(key, 0) + 1
    return {
        "steps": steps,
        "profiled_ms_per_step": 1e3 * total / steps,
        "cumulative_ms_per_step": {fn: 1e3 * cum / steps for fn, _, cum in per_function[:60]},
        "calls_per_step": {fn: calls / steps for fn, calls, _ in per_function[:60]},
        "syncs_per_step": len(syncs) / steps,
        "syncs_at": where,
    }


def part_demo(args: argparse.Namespace) -> dict[str, Any]:
    """README's main job on this machine: the flagship recipe (``recipes/char_lm``) as ``make demo`` runs it (every
    GPU, or 2 CPU processes), and its plain-PyTorch loop under torchrun, each recording every step's loss: the
    two must train the same numbers on this device too."""
    import torch

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "char_lm"
    size = ["--max-chars", "20000", "--epochs", "1"] if args.quick else []
    processes = torch.cuda.device_count() if args.device == "cuda" else 2
    out: dict[str, Any] = {"processes": processes}
    with tempfile.TemporaryDirectory() as tmp:
        for key, argv in (
            ("lightning", [str(recipe / "train_lightning.py"), "--out-dir", str(Path(tmp) / "logs")]),
            (
                "plain",
                [
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={processes}",
                    str(recipe / "train_plain.py"),
                ],
            ),  # fmt: skip
        ):
            record = Path(tmp) / f"{key}.pt"
            started = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, *argv, *size, "--record", str(record)], capture_output=True, text=True, timeout=400
            )
            print(proc.stdout[-2500:], proc.stderr[-2500:], sep="\n", flush=True)
            out[key] = {"exit_code": proc.returncode, "wall_s": time.perf_counter() - started}
            if proc.returncode == 0:
                data = torch.load(record, weights_only=True)
                out[key].update(
                    steps=len(data["losses"]),
                    first_loss=data["losses"][0],
                    last_loss=data["losses"][-1],
                    val_loss=data["val_loss"],
                    world_size=data["world_size"],
                )
                out[key]["_record"] = data
    both = [out[key].pop("_record", None) for key in ("lightning", "plain")]
    if all(record is not None for record in both):
        lightning, plain = both
        losses = [abs(a - b) for a, b in zip(lightning["losses"], plain["losses"])]
        out["same_steps"] = len(lightning["losses"]) == len(plain["losses"])
        out["max_loss_difference"] = max(losses) if losses else None
        out["max_weight_difference"] = max(
            float((lightning["state_dict"][name] - value).abs().max()) for name, value in plain["state_dict"].items()
        )
    return out


def part_unit(args: argparse.Namespace) -> dict[str, Any]:
    """The in-process test lane (``tests/unit``) with the GPU visible: the lane is written on machines without one,
    so a test (or the code) that assumes none fails here first (its first run on an H100 found two bugs)."""
    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--timeout", "60"]
    argv += ["--continue-on-collection-errors", *(["-n", str(workers)] if workers > 1 else []), "tests/unit"]
    if args.quick:
        argv += ["-k", "partition"]
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=190, cwd=Path(__file__).resolve().parent.parent)
    lines = proc.stdout.splitlines()
    print("\n".join(lines[-60:]), flush=True)
    counts = {
        word: int(number)
        for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", lines[-1] if lines else "")
    }
    return {
        "exit_code": proc.returncode,
        "wall_s": time.perf_counter() - started,
        "workers": workers,
        "counts": counts,
        "failed": [line.split(" ", 1)[1] for line in lines if line.startswith(("FAILED ", "ERROR "))],
    }


def _powersgd_model_ms(device: str, rank: int, widths: tuple[int, ...]) -> dict[str, Any]:
    """PowerSGD's compute per step as the what-if model has it: measured per matrix on this device."""
    from bench.models import make_mlp

    from lightning_mgpu.whatif.compression import plan_bucket
    from lightning_mgpu.whatif.measure import measure_costs
    from lightning_mgpu.whatif.records import Gradient

    gradients = [Gradient(shape=tuple(p.shape)) for p in make_mlp(widths).parameters()]
    costs = measure_costs(gradients, powersgd_ranks=(rank,), device=device, repeats=10, gloo_dtypes=False)
    plan = plan_bucket(
        sum(g.bytes for g in gradients), gradients, compression="powersgd", powersgd_rank=rank, costs=costs
    )
    after = sum(amount for kind, amount in plan.segments if kind == "compute")
    return {"pre_ms": plan.pre_ms, "after_ms": after, "total_ms": plan.pre_ms + after, "costs": costs.as_dict()}


def part_compression(args: argparse.Namespace) -> dict[str, Any]:
    widths = (256,) * 4 if args.quick else BIG_WIDTHS
    batch = 16 if args.quick else BIG_BATCH
    steps, warmup = (6, 3) if args.quick else (30, 8)
    half = "16-mixed" if args.device == "cuda" else "bf16-mixed"  # CPU autocast has bf16 only
    configs: list[tuple[str, dict[str, Any]]] = [
        ("ddp", {"precision": half}),
        ("torch-fp16", {"precision": half}),
        ("ddp_tuned", {"precision": half}),
        ("ours-fp16", {"precision": half}),
        ("ddp@bf16", {"precision": "bf16-mixed"}),
        ("torch-bf16", {"precision": "bf16-mixed"}),
        ("ddp_tuned@bf16", {"precision": "bf16-mixed"}),
        ("ours-bf16", {"precision": "bf16-mixed"}),
        ("ours-powersgd-r1", {"precision": half}),
        ("ours-powersgd-r4", {"precision": half}),
    ]

    configs.insert(4, ("ours-fp16-nosync", {"precision": half}))
    if args.configs:
        wanted = args.configs.split(",")
        unknown = sorted(set(wanted) - {name for name, _ in configs})
        if unknown:
            raise ValueError(f"unknown configuration(s) {unknown}; choose from {[name for name, _ in configs]}")
        configs = [(name, options) for name, options in configs if name in wanted]

    def run(name: str, options: dict[str, Any]) -> dict[str, Any]:
        result = _timed_fit(
            args.device, name.split("@")[0], widths, batch, warmup=warmup, steps=steps, precision=options["precision"]
        )
        result["config"] = name
        return result

    import math

    params = sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))
    runs = _rounds(configs, max(1, args.rounds - 2), run)  # 10 configurations: fewer rounds fit the lease
    step = _medians(runs, "step_ms_median")
    bad = [run for run in runs if not math.isfinite(run["last_loss"])]
    hooks = {}
    for ours, theirs, base_ours, base_theirs in (
        ("ours-fp16", "torch-fp16", "ddp_tuned", "ddp"),
        ("ours-bf16", "torch-bf16", "ddp_tuned@bf16", "ddp@bf16"),
    ):
        if not {ours, theirs, base_ours, base_theirs} <= set(step):
            continue
        hooks[ours.split("-")[1]] = {
            "ours_ms": step[ours],
            "torch_ms": step[theirs],
            "ours_hook_cost_ms": step[ours] - step[base_ours],
            "torch_hook_cost_ms": step[theirs] - step[base_theirs],
            "ours_vs_torch": _ratio(runs, ours, theirs, "step_ms_median"),
        }
        if ours == "ours-fp16" and "ours-fp16-nosync" in step:
            hooks["fp16"]["end_step_sync_ms"] = step["ours-fp16"] - step["ours-fp16-nosync"]
    powersgd = {}
    for rank in (1, 4):
        name = f"ours-powersgd-r{rank}"
        if name not in step or "ddp_tuned" not in step:
            continue
        powersgd[f"rank{rank}"] = {
            "step_ms": step[name],
            "measured_compute_ms": step[name] - step["ddp_tuned"],
            "whatif_model": _powersgd_model_ms(args.device, rank, widths),
        }
    return {
        "model": f"MLP {' x '.join(str(w) for w in widths)} ({params / 1e6:.1f}M parameters)",
        "parameters": params,
        "batch": batch,
        "steps": steps,
        "warmup": warmup,
        "rounds": max(1, args.rounds - 2),
        "runs": runs,
        "median_step_ms": step,
        "hooks": hooks,
        "powersgd": powersgd,
        "non_finite_losses": [run["config"] for run in bad],
    }


def _profile(device: str, directory: Path, steps: int) -> dict[str, Any]:
    import torch

    from bench.harness.worker import regression
    from bench.models import MLP_WIDTHS, make_data, make_mlp

    from lightning_mgpu import CommProfiler

    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    profiler = CommProfiler(warmup_steps=5, profile_steps=steps, profile_every=None, export_dir=directory, whatif=None)
    model = regression(make_mlp(MLP_WIDTHS), torch.nn.functional.mse_loss)
    loader = torch.utils.data.DataLoader(make_data(MLP_BATCH * 4, MLP_WIDTHS), batch_size=MLP_BATCH)
    _trainer(device, _strategy("ddp_tuned"), 5 + steps, [profiler]).fit(model, loader)
    profile = json.loads((directory / "comm_profile.json").read_text())
    return profile


def part_profile_worker(args: argparse.Namespace) -> dict[str, Any]:
    """(internal) one CommProfiler profile of the 8M MLP on ``--device``, whole."""
    with tempfile.TemporaryDirectory() as tmp:
        return _profile(args.device, Path(tmp), 6 if args.quick else 40)


def _compute_ms(run: Any) -> float:
    return float(run.forward_ms + run.backward_compute_ms + run.optimizer_ms)


def part_whatif(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_mgpu.whatif.records import load_profile

    out_dir = Path(args.out)
    profiles = {}
    for key, device in (("cpu", "cpu"), ("gpu", args.device)):
        target = out_dir / f"profile_{key}.json.tmp"
        code, _ = _run_part("profile", args, device=device, json_out=target, log=None)
        if code:
            raise RuntimeError(f"profiling the 8M MLP on {device} failed (exit {code})")
        profiles[key] = json.loads(target.read_text())
        target.unlink()
    cpu, gpu = (load_profile(profiles[key]) for key in ("cpu", "gpu"))
    scale = _compute_ms(gpu) / _compute_ms(cpu)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cpu_profile.json"
        path.write_text(json.dumps(profiles["cpu"]))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "lightning_mgpu.cli",
                "whatif",
                str(path),
                "--compute-scale",
                f"{scale:.6g}",
                "--link-gbps",
                "100",
                "--json",
                "--costs",
                "none",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    if proc.returncode:
        raise RuntimeError(f"whatif failed ({proc.returncode}): {proc.stderr[-2000:]}")
    prediction = json.loads(proc.stdout)
    predicted = _predicted_step(prediction)
    return {
        "model": "the 8M MLP, batch 256, ddp_tuned, world size 1",
        "cpu": {
            "step_ms": cpu.step_ms,
            "compute_ms": _compute_ms(cpu),
            "forward_ms": cpu.forward_ms,
            "backward_ms": cpu.backward_compute_ms,
            "optimizer_ms": cpu.optimizer_ms,
            "other_ms": cpu.other_ms,
        },
        "gpu": {
            "step_ms": gpu.step_ms,
            "compute_ms": _compute_ms(gpu),
            "forward_ms": gpu.forward_ms,
            "backward_ms": gpu.backward_compute_ms,
            "optimizer_ms": gpu.optimizer_ms,
            "other_ms": gpu.other_ms,
        },
        "cpu_threads": max(1, (os.cpu_count() or 2) // 2),  # what _profile gives the CPU run
        "compute_scale": scale,
        "predicted_gpu_step_ms": predicted,
        "measured_gpu_step_ms": gpu.step_ms,
        "error": (predicted - gpu.step_ms) / gpu.step_ms if predicted else None,
        "whatif": prediction,
    }


def _predicted_step(prediction: dict[str, Any]) -> Optional[float]:
    """The predicted step time of ``whatif --json``'s scenario."""
    step = prediction.get("predicted", {}).get("step_ms")
    return float(step) if isinstance(step, (int, float)) else None


PART_RUNNERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "selftest": part_selftest,
    "overhead": part_overhead,
    "compression": part_compression,
    "whatif": part_whatif,
    "demo": part_demo,
    "unit": part_unit,
    "profile": part_profile_worker,
}


# ----------------------------------------------------------------------------------------------- driver
def _run_part(
    part: str, args: argparse.Namespace, *, device: Optional[str] = None, json_out: Path, log: Optional[Path]
) -> tuple[int, float]:
    """``part`` in its own process group with its time limit; its output to ``log`` (appended) and to ours."""
    argv = [
        sys.executable, "-m", "bench.gpu_check", "--worker", part, "--json-out", str(json_out),
        "--out", args.out, "--device", device or args.device, "--rounds", str(args.rounds),
    ]  # fmt: skip
    if args.quick:
        argv.append("--quick")
    if args.configs:
        argv += ["--configs", args.configs]
    from lightning_mgpu.comm.distributed import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    if (device or args.device) == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    limits = dict(PART_TIMEOUT_S)
    for item in filter(None, (args.limits or "").split(",")):
        key, _, value = item.partition("=")
        limits[key.strip()] = float(value)
    limit = limits.get(part, 300.0) * (0.5 if args.quick else 1.0)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        lines.append(f"\n[gpu_check] {part}: killed after {time.perf_counter() - started:.0f} s (its time limit)\n")
        print(lines[-1], flush=True)
    reader.join(timeout=10)
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"\n===== {part} ({device or args.device}) =====\n{''.join(lines)}")
    return proc.returncode, time.perf_counter() - started


def _table(results: dict[str, Any], card: str) -> str:
    lines = [f"gpu_check on {card}"]

    def row(what: str, value: str) -> None:
        lines.append(f"  {what:<46} {value}")

    parts = results["parts"]
    st = parts.get("selftest", {}).get("result")
    if st:
        for key in ("doctor", "selftest"):
            counts = st.get(key, {}).get("counts", {})
            failed = [c["name"] for c in st.get(key, {}).get("checks", []) if c.get("status") == "fail"]
            row(
                f"doctor{' --selftest' if key == 'selftest' else ''}",
                f"{counts} {'FAILED: ' + ', '.join(failed) if failed else ''}",
            )
        for check in st.get("selftest", {}).get("checks", []):
            facts = check.get("details", {}).get("facts", {})
            if "fp16_hook_worst_relative_error" in facts:
                row(
                    f"  {check['name']}: fp16 hook, worst relative error",
                    f"{facts['fp16_hook_worst_relative_error']:.3g} ({facts['fp16_hook_path']} path)",
                )
            if "max_grad_difference" in facts:
                row(
                    f"  {check['name']}: max |grad - one device's|",
                    f"{facts['max_grad_difference']:.3g} on {facts.get('devices')}",
                )
    demo = parts.get("demo", {}).get("result")
    if demo:
        for key in ("lightning", "plain"):
            run = demo[key]
            row(
                f"char_lm recipe, {key}, {demo['processes']} process(es)",
                f"exit {run['exit_code']}, {run['wall_s']:.1f} s"
                + (f", loss {run['first_loss']:.3f} -> {run['last_loss']:.3f}" if "last_loss" in run else ""),
            )
        if "max_loss_difference" in demo:
            row(
                "char_lm: plain vs Lightning, max |d loss|, |d w|",
                f"{demo['max_loss_difference']:.3g}, {demo['max_weight_difference']:.3g} (same steps: {demo['same_steps']})",
            )
    unit = parts.get("unit", {}).get("result")
    if unit:
        row(
            f"tests/unit with the GPU visible ({unit['workers']} workers)",
            f"{unit['counts']} in {unit['wall_s']:.0f} s",
        )
        for failed in unit["failed"][:20]:
            row("  failed", failed[:110])
    ov = parts.get("overhead", {}).get("result")
    if ov:
        m = ov["median_step_ms"]
        row(
            "step ms: ddp / ddp_tuned / +CommProfiler",
            f"{m['ddp']:.3f} / {m['ddp_tuned']:.3f} / {m['ddp_tuned+profiler']:.3f}",
        )
        for key in ("ddp_tuned_vs_ddp", "profiler_cost", "noise_floor"):
            r = ov.get(key)
            if r:
                row(
                    f"{r['of']} ({r['stat']})",
                    f"{r['median']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}]"
                    + (f" limit {r['limit']}" if "limit" in r else ""),
                )
        for name, host in ov.get("host", {}).items():
            row(
                f"{name}: host Python per step (cProfile), syncs",
                f"{host['profiled_ms_per_step']:.3f} ms, {host['syncs_per_step']:.2f} syncs/step {host['syncs_at']}"[
                    :160
                ],
            )
    co = parts.get("compression", {}).get("result")
    if co:
        for kind, h in co["hooks"].items():
            row(
                f"{kind}: hook cost/step ours vs torch (ms)",
                f"{h['ours_hook_cost_ms']:+.3f} vs {h['torch_hook_cost_ms']:+.3f}; step {h['ours_ms']:.3f} vs {h['torch_ms']:.3f}",
            )
            if "end_step_sync_ms" in h:
                row(f"{kind}: of which end_step's sync (ms)", f"{h['end_step_sync_ms']:+.3f}")
        for rank, p in co["powersgd"].items():
            row(
                f"PowerSGD {rank}: compute/step measured vs model",
                f"{p['measured_compute_ms']:.3f} vs {p['whatif_model']['total_ms']:.3f} ms",
            )
    wi = parts.get("whatif", {}).get("result")
    if wi:
        row(
            "compute-scale GPU/CPU (8M MLP)",
            f"{wi['compute_scale']:.4g} (GPU {wi['gpu']['compute_ms']:.3f} ms, CPU {wi['cpu']['compute_ms']:.2f} ms)",
        )
        if wi["predicted_gpu_step_ms"] is not None:
            row(
                "whatif(CPU profile x scale) vs GPU step",
                f"{wi['predicted_gpu_step_ms']:.3f} vs {wi['measured_gpu_step_ms']:.3f} ms ({wi['error']:+.1%})",
            )
    for part, entry in parts.items():
        if entry.get("exit_code"):
            row(f"part {part}", f"FAILED (exit {entry['exit_code']}, {entry['seconds']:.0f} s): see gpu_check.log")
    return "\n".join(lines)


def record(launches: list[str], results: Path) -> list[Path]:
    """Merge launches (``DIR=LABEL@COMMIT``: a ``--out`` folder fetched from the GPU machine) into
    ``results/gpu_<part>.json``, the files the docs' GPU tables read, after the launches already there (a
    launch of the same label and commit replaces its earlier record)."""
    merged: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        path = results / f"gpu_{part}.json"
        merged[part] = json.loads(path.read_text()) if path.exists() else {"launches": []}
    changed: set[str] = set()
    for launch in launches:
        folder, _, tag = launch.partition("=")
        label, _, commit = tag.partition("@")
        run = json.loads((Path(folder) / "gpu_check.json").read_text())
        for part, entry in run["parts"].items():
            result = entry.get("result")
            if result is None:
                continue
            merged[part]["machine"] = run["machine"]  # the newest launch's machine
            result = {k: v for k, v in result.items() if k not in ("machine", "whatif")}
            if part == "selftest":
                for report in result.values():
                    for check in report.get("checks", []):
                        check.get("details", {}).pop("output_tail", None)
            if part == "overhead":  # what the docs cite: no per-step lists, each host profile's top functions
                for run in result["runs"]:
                    run.pop("step_ms_each", None)
                for host in result.get("host", {}).values():
                    for key in ("cumulative_ms_per_step", "calls_per_step"):
                        host[key] = dict(list(host[key].items())[:RECORDED_FUNCTIONS])
            kept = [old for old in merged[part]["launches"] if (old["label"], old["commit"]) != (label, commit)]
            merged[part]["launches"] = [
                *kept,
                {"label": label, "commit": commit, "seconds": entry["seconds"], **result},
            ]
            changed.add(part)
    if merged["overhead"]["launches"]:
        _pool_overhead(merged["overhead"])
    written = []
    for part in PARTS:
        if part in changed:
            path = results / f"gpu_{part}.json"
            path.write_text(json.dumps(merged[part], indent=1, default=str) + "\n")
            written.append(path)
    return written


def _pool_overhead(overhead: dict[str, Any]) -> None:
    """Each ratio's median and CI over every round of the launches that measured it (from ``POOLED_SINCE``'s
    launch on, for a ratio whose code changed between launches)."""
    from bench.harness.stats import median, median_ci

    for key in ("ddp_tuned_vs_ddp", "profiler_cost", "noise_floor"):
        measured = [launch for launch in overhead["launches"] if key in launch]
        since = [launch["commit"] for launch in measured].index(POOLED_SINCE[key]) if key in POOLED_SINCE else 0
        measured = measured[since:]
        ratios = [r for launch in measured for r in launch[key]["per_round"]]
        if not ratios:
            continue
        low, high = median_ci(ratios)
        overhead[key] = {
            "of": measured[0][key]["of"],
            "stat": measured[0][key]["stat"],
            "median": median(ratios),
            "ci95": [low, high],
            "rounds": len(ratios),
            "launches": [f"{launch['label']}@{launch['commit']}" for launch in measured],
            **({"limit": measured[0][key]["limit"]} if "limit" in measured[0][key] else {}),
        }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="directory for gpu_*.json and gpu_check.log (required unless --record)")
    parser.add_argument(
        "--record",
        nargs="+",
        metavar="DIR=LABEL@COMMIT",
        help="merge fetched --out folders into bench/results/gpu_*.json (what the docs read), then exit",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds kept per comparison (+1 warm-up)")
    parser.add_argument("--configs", default=None, help="compression part: only these configurations (comma-separated)")
    parser.add_argument(
        "--limits",
        default=None,
        help="time limits in seconds per part, e.g. selftest=140,overhead=80 (default: built in)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, measures nothing")
    parser.add_argument("--worker", choices=sorted(PART_RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record:
        from bench import RESULTS

        for path in record(args.record, RESULTS):
            print(f"wrote {path}")
        return 0
    if args.worker:
        _quiet()
        result = PART_RUNNERS[args.worker](args)
        Path(args.json_out).write_text(json.dumps(result, indent=1, default=str))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    if not args.out:
        parser.error("--out is required (or --record)")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible here (use --device cpu for the dry run)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check.log"
    card = _card(args.device)
    results: dict[str, Any] = {"machine": card, "device": args.device, "quick": args.quick, "parts": {}}
    print(f"[gpu_check] {card}", flush=True)
    for part in parts:
        target = out / f"gpu_{part}.json"
        print(f"[gpu_check] part {part} ...", flush=True)
        code, seconds = _run_part(part, args, json_out=target, log=log)
        entry: dict[str, Any] = {"exit_code": code, "seconds": seconds}
        if code == 0 and target.exists():
            entry["result"] = json.loads(target.read_text())
            data = {"machine": card, **entry["result"]}
            target.write_text(json.dumps(data, indent=1, default=str))
        results["parts"][part] = entry
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"[gpu_check] part {part}: exit {code} in {seconds:.0f} s", flush=True)
    print(_table(results, card["card"]), flush=True)
    return 0 if all(entry["exit_code"] == 0 for entry in results["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
