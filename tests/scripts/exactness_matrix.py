"""Per-step gradients with and without ``CommProfiler`` over DDP's options, in one launch (issue 28).

    python -m torch.distributed.run --standalone --nproc-per-node=2 \
        -m tests.scripts.exactness_matrix --out result.json [--only ddp_tuned]

Every configuration of ``static_graph`` x ``gradient_as_bucket_view`` x ``find_unused_parameters`` x
``accumulate_grad_batches`` (1, 3) x compression (none, fp16), under ``ddp_tuned`` and stock ``ddp``,
is fitted three times on the same data from the same seed: without the profiler, with
``CommProfiler()``'s default schedule (its hook in from the first step) and with a windowed schedule
(the hook goes in and out, ``ddp_tuned`` re-wrapping DDP at each switch). Then
``bucket_cap_mb="auto"`` (the tuner's own re-wraps) with and without the windowed profiler. Each
fit records the all-reduced gradients every optimizer step sees (``on_before_optimizer_step``);
rank 0 writes, per configuration and profiled run, the largest difference from the unprofiled
run: ``max |g - g0|`` and that relative to ``max |g0|`` over each step's whole gradient.

All fits run in the same two processes (torchrun's), one after another: the process group is made
once, so 200 fits cost seconds, not 200 launches.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import warnings
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import CommProfiler, TunedDDPStrategy

STEPS = 10  # optimizer steps per fit: the windowed schedule below switches 4 times in them
AUTO_STEPS = 60  # the tuner (14 steps here) starts only with 4x its steps left
BATCH = 4


class Net(L.LightningModule):
    """A small MLP (705 parameters) whose gradients are recorded at every optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)
        self.grads: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.net(x))), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters()]
        self.grads.append(torch.cat([g.detach().reshape(-1) for g in grads]).clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _strategy(kind: str, *, compression: Optional[str], auto: bool, **ddp: Any) -> Any:
    if kind == "ddp_tuned":
        if auto:
            tuning = {"tune_candidates": [0.001, 25], "tune_rounds": 1, "tune_steps": 14}
            return TunedDDPStrategy(bucket_cap_mb="auto", compression=compression, **tuning, **ddp)  # type: ignore[arg-type]
        # 0.001 MiB: several buckets even on this small net
        return TunedDDPStrategy(bucket_cap_mb=0.001, compression=compression, **ddp)  # type: ignore[arg-type]
    hook = default_hooks.fp16_compress_hook if compression == "fp16" else None  # Lightning drops it on CPU
    return DDPStrategy(bucket_cap_mb=0.001, ddp_comm_hook=hook, **ddp)


def _profiler(schedule: str) -> Optional[CommProfiler]:
    if schedule == "none":
        return None
    if schedule == "default":
        return CommProfiler(warmup_steps=1, whatif=False)
    return CommProfiler(warmup_steps=1, profile_steps=1, profile_every=4, whatif=False)  # in 2, out 2, in 3, out 1, ...


def _fit(strategy: Any, schedule: str, *, accumulate: int, steps: int) -> tuple[list[torch.Tensor], list[Any], str]:
    """The gradients of every optimizer step, the profiler's switches, and the error the fit raised ("" if none)."""
    try:
        grads, switches = _fit_or_raise(strategy, schedule, accumulate=accumulate, steps=steps)
    except Exception as error:  # the same on every rank, before any collective (e.g. torch's static_graph assert)
        return [], [], f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return grads, switches, ""


def _fit_or_raise(strategy: Any, schedule: str, *, accumulate: int, steps: int) -> tuple[list[torch.Tensor], list[Any]]:
    L.seed_everything(0, verbose=False)
    model = Net()
    generator = torch.Generator().manual_seed(1)
    n = steps * accumulate * BATCH * 2  # two ranks
    x = torch.randn(n, 8, generator=generator)
    y = torch.randn(n, 1, generator=generator)
    profiler = _profiler(schedule)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[profiler] if profiler is not None else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    switches = list(profiler.switches) if profiler is not None else []
    return model.grads, switches


def _difference(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict[str, Any]:
    if not reference or len(reference) != len(other):
        return {"steps": [len(reference), len(other)], "max_abs": float("inf"), "max_rel": float("inf")}
    worst_abs, worst_rel, first_step = 0.0, 0.0, None
    for step, (a, b) in enumerate(zip(reference, other)):
        diff = float((a - b).abs().max())
        rel = diff / max(float(a.abs().max()), 1e-30)
        if diff > 0 and first_step is None:
            first_step = step
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, rel)
    return {"steps": len(reference), "max_abs": worst_abs, "max_rel": worst_rel, "first_differing_step": first_step}


def _say(*what: Any) -> None:
    if os.environ.get("RANK", "0") == "0":
        print("fit:", *what, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=("ddp_tuned", "ddp"), default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

    rows: list[dict[str, Any]] = []
    dynamic: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # unprofiled runs with static_graph=False
    kinds = [args.only] if args.only else ["ddp_tuned", "ddp"]
    for kind, static, view, unused, accumulate, compression in itertools.product(
        kinds, (False, True), (False, True), (False, True), (1, 3), (None, "fp16")
    ):
        ddp = {"static_graph": static, "gradient_as_bucket_view": view, "find_unused_parameters": unused}
        runs = {}
        for schedule in ("none", "default", "windowed"):
            _say(kind, ddp, accumulate, compression, schedule)
            strategy = _strategy(kind, compression=compression, auto=False, **ddp)
            runs[schedule] = _fit(strategy, schedule, accumulate=accumulate, steps=STEPS)
        config = {"strategy": kind, **ddp, "accumulate_grad_batches": accumulate, "compression": compression}
        key = (kind, view, unused, accumulate, compression)
        if not static:
            dynamic[key] = runs["none"][0]
        for schedule in ("default", "windowed"):
            grads, switches, error = runs[schedule]
            rows.append(
                {
                    **config,
                    "profiler": schedule,
                    "switches": switches,
                    "error": error,
                    "error_unprofiled": runs["none"][2],
                    **_difference(runs["none"][0], grads),
                    # the unprofiled run against the same options without static_graph: what DDP should give
                    "vs_dynamic": _difference(dynamic[key], runs["none"][0]),
                }
            )
    if args.only in (None, "ddp_tuned"):
        for compression in (None, "fp16"):
            runs = {}
            for schedule in ("none", "windowed"):
                tuned = _strategy("ddp_tuned", compression=compression, auto=True)
                grads, switches, error = _fit(tuned, schedule, accumulate=1, steps=AUTO_STEPS)
                rewraps = [r["global_step"] for r in tuned.rewraps]
                runs[schedule] = (grads, switches, rewraps, tuned.tuning_status, error)
            rows.append(
                {
                    "strategy": "ddp_tuned",
                    "bucket_cap_mb": "auto",
                    "compression": compression,
                    "profiler": "windowed",
                    "switches": runs["windowed"][1],
                    "tuner_rewraps": {schedule: runs[schedule][2] for schedule in runs},
                    "tuning_status": {schedule: runs[schedule][3] for schedule in runs},
                    "error": runs["windowed"][4],
                    "error_unprofiled": runs["none"][4],
                    **_difference(runs["none"][0], runs["windowed"][0]),
                }
            )
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
