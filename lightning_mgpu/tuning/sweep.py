"""The worker of ``lightning-mgpu tune``: one ``fit`` that only tunes, in every rank.

Started by :mod:`lightning_mgpu.tuning.cli` through ``torch.distributed.run``::

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m lightning_mgpu.tuning.sweep \\
        --target recipes/x.py:make_module --out result.json

It builds the user's LightningModule (and data loader) from ``--target``, fits it with
``TunedDDPStrategy(bucket_cap_mb="auto")`` and stops as soon as the search is over; rank 0
writes the search's record as JSON. The steps it trains are thrown away with the process.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional, Sequence


class TargetError(ValueError):
    """``--target`` does not name a callable that can be imported."""


def parse_target(text: str) -> tuple[str, str]:
    """``"FILE.py:FUNCTION"`` or ``"package.module:FUNCTION"`` -> (where, function)."""
    where, sep, name = text.rpartition(":")
    if not sep or not where or not name or not name.isidentifier():
        raise TargetError(f"expected FILE.py:FUNCTION or MODULE:FUNCTION, got {text!r}")
    return where, name


def load_factory(text: str) -> Callable[[], Any]:
    """Import ``text``'s module (a file or a module name) and return its function."""
    where, name = parse_target(text)
    module: ModuleType
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"no such file: {where!r} (in {text!r})")
        spec = importlib.util.spec_from_file_location(f"_lightning_mgpu_tune_target_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise TargetError(f"cannot import {where!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        # Scripts import their neighbours the way `python FILE.py` would allow.
        sys.path.insert(0, str(path.resolve().parent))
        spec.loader.exec_module(module)
    else:
        try:
            found = importlib.util.find_spec(where)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise TargetError(f"no module named {where!r} (in {text!r}); give FILE.py:FUNCTION or an importable module")
        module = importlib.import_module(where)
    factory = getattr(module, name, None)
    if factory is None or not callable(factory):
        raise TargetError(f"{where!r} has no function {name!r}")
    return factory  # type: ignore[no-any-return]


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
