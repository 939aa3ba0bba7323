"""Every rank of ``lightning-mgpu tune``'s sweep: one ``fit`` that only tunes.

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m lightning_mgpu.cli.workers.tune \\
        --target recipes/x.py:make_module --out result.json

Started so by :mod:`lightning_mgpu.cli.tune`.

It builds the user's LightningModule (and data loader) from ``--target``, fits it with
``TunedDDPStrategy(bucket_cap_mb="auto")`` and stops as soon as the search is over; rank 0
writes the search's record as JSON. The steps it trains are thrown away with the process.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from lightning_mgpu._target import TargetError
from lightning_mgpu._target import load_target as load_factory


def _build(factory: Callable[[], Any]) -> tuple[Any, Optional[Any]]:
    import lightning as L

    made = factory()
    module, loader = (made[0], made[1]) if isinstance(made, tuple) else (made, None)
    if not isinstance(module, L.LightningModule):
        raise TargetError(
            f"the function must return a LightningModule or (LightningModule, DataLoader), got {type(made).__name__}"
        )
    return module, loader


def run(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--candidates", default=None, help="comma-separated MiB")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    import logging

    import lightning as L
    import torch

    from lightning_mgpu import TunedDDPStrategy
    from lightning_mgpu.tuning.tuner import FINAL_STATES

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    candidates = None if args.candidates is None else [float(c) for c in args.candidates.split(",")]
    strategy = TunedDDPStrategy(
        bucket_cap_mb="auto", tune_steps=args.steps, tune_candidates=candidates, tune_rounds=args.rounds
    )
    assert strategy.tuner is not None
    # An offline sweep: as many timed steps as asked, and no "is the run long enough" rule.
    strategy.tuner.settings = dataclasses.replace(strategy.tuner.settings, measure=args.measure, min_run_multiple=1.0)

    class StopWhenTuned(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            if strategy.tuning_status in FINAL_STATES:
                trainer.should_stop = True

    try:
        module, loader = _build(load_factory(args.target))
    except TargetError as exc:  # the user's mistake: one line, not a traceback per rank
        print(f"lightning-mgpu tune: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=local,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
        strategy=strategy,
        max_steps=10**9,
        max_epochs=-1,
        callbacks=[StopWhenTuned()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, loader)
    record = strategy.tuning
    if trainer.global_rank == 0:
        result = {
            "target": args.target,
            "world_size": trainer.world_size,
            "backend": strategy.process_group_backend,
            "device_type": strategy.root_device.type,
            "parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad),
            "steps_trained": trainer.global_step,
            "torch": torch.__version__,
            "tuning": record,
        }
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run()
