"""What one rank of ``bench/whatif.py`` runs: timed fits (some profiled).

Launched by ``bench.whatif`` through :func:`bench.harness.launch.launch_plan`, on loopback
(``torch.distributed.run --standalone``) or as two nodes of the network lab::

    python -m torch.distributed.run ... -m bench.whatif_worker --worker-plan PLAN.json --worker-out OUT.json

``PLAN.json`` is a list of items, run in order:

* ``{"kind": "fit", "model": "mlp", "bucket_cap_mb": null | MiB, "compression": null | "fp16" |
  "bf16" | "powersgd", "powersgd_rank": 1, "steps": N, "warmup": W, "profile_dir": null | DIR}``:
  ``TunedDDPStrategy`` trains ``W + N`` steps of one of bench/models.py's models
  (``mlp``, ``cnn``, ``char_lm``); step time from ``on_train_batch_start`` to
  ``on_train_batch_end`` on rank 0 (the span ``CommProfiler`` calls a step); with
  ``profile_dir``, ``CommProfiler`` profiles every step after the warm-up and writes
  ``comm_profile.json`` there. Every fit also records the gradients of each bucket DDP built
  (name, shape, dtype, in DDP's order), read from ``strategy.bucket_layout`` before teardown:
  what the replay model re-buckets and PowerSGD compresses, and the layout the prediction of
  another bucket size must match.

The all-reduce sweep over the link is ``lightning-mgpu bench-comm`` itself, started across the lab
as a user starts it (:func:`bench.whatif.bench_comm_sweep`).

Rank 0 writes the list of results to ``--worker-out``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from bench.harness import worker
from bench.harness.stats import median
from bench.models import fit

WHATIF_SEED = 0


def fit_once(item: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    from torch.nn.parallel import DistributedDataParallel

    from lightning_mgpu import CommProfiler, TunedDDPStrategy

    options: dict[str, Any] = {"bucket_cap_mb": item.get("bucket_cap_mb"), "compression": item.get("compression")}
    if item.get("compression") == "powersgd":
        options.update(powersgd_rank=int(item.get("powersgd_rank", 1)), powersgd_start_iter=2)
    strategy = TunedDDPStrategy(**options)
    warmup, steps = int(item["warmup"]), int(item["steps"])
    record: dict[str, Any] = {"gradients": None}

    class Gradients(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            ddp = trainer.strategy.model
            layout = trainer.strategy.bucket_layout  # type: ignore[attr-defined]  # None after teardown: read it now
            if layout is None or not isinstance(ddp, DistributedDataParallel):
                return
            params = dict(ddp.module.named_parameters())
            record["gradients"] = [
                {"bucket": b.index, "name": name, "shape": list(params[name].shape), "dtype": str(params[name].dtype)}
                for b in layout
                for name in b.param_names
            ]
            record["built_bytes"] = [b.bytes for b in layout]

    callbacks: list[L.Callback] = [Gradients()]
    if item.get("profile_dir"):
        callbacks.append(
            CommProfiler(
                warmup_steps=warmup,
                profile_steps=steps,
                profile_every=None,
                every_n_steps=10_000,
                timeline_steps=1,
                export_dir=item["profile_dir"],
            )
        )
    done = fit(item["model"], strategy, warmup + steps, callbacks=callbacks)
    timed = done.step_ms[warmup:]
    result = {
        **item,
        "world_size": done.trainer.world_size,
        "step_ms": done.step_ms,
        "median_ms": median(timed) if timed else float("nan"),
        "losses": done.module.losses(),
        "gradients": record["gradients"],
        "built_bytes": record.get("built_bytes"),
        "profile": None,
    }
    if item.get("profile_dir") and done.trainer.global_rank == 0:
        path = Path(item["profile_dir"]) / "comm_profile.json"
        result["profile"] = json.loads(path.read_text()) if path.is_file() else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker-plan", type=Path, required=True)
    parser.add_argument("--worker-out", type=Path, required=True)
    args = parser.parse_args()
    worker.start(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(WHATIF_SEED)

    def run(item: dict[str, Any]) -> dict[str, Any]:
        return fit_once(item)

    def describe(item: dict[str, Any], result: dict[str, Any], _: float) -> str:
        label = f"{item['model']} cap={item.get('bucket_cap_mb')} {item.get('compression') or 'plain'}"
        return f"  {label:<32} {result['median_ms']:9.1f} ms/step"

    worker.run_plan(args, run, describe)


if __name__ == "__main__":
    main()
