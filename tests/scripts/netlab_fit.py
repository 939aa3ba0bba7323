"""Every strategy and callback of the package, one small fit each, in one process: for the lab's tests.

Run under torchrun, as two "nodes" of ``bench/labs/network.py``'s lab or on loopback::

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/scripts/netlab_fit.py \\
        --out-dir OUT --configs ddp_tuned,fp16,auto

The Trainer's ``devices`` and ``num_nodes`` come from torchrun's ``LOCAL_WORLD_SIZE`` and
``WORLD_SIZE`` (2 nodes x 1 rank in the lab, 1 node x 2 ranks on loopback), or under ``srun``
(the SLURM lab, ``bench/labs/slurm.py``) from ``SLURM_NTASKS_PER_NODE`` and ``SLURM_NNODES``; every
configuration trains the same seeded model on the same data, so a run across the lab's link
must end on exactly the parameters of the run on loopback (2 ranks: a gloo sum is a + b on
both, whatever the transport). Rank 0 writes ``OUT/<config>.json``: the final parameters,
the losses, and what the configuration is about (the hook DDP registered, the tuner's
record, the profile, the doctor's findings, the hybrid placement).

Configurations:
  ddp_tuned   TunedDDPStrategy()
  fp16/bf16   TunedDDPStrategy(compression=...)
  powersgd    TunedDDPStrategy(compression="powersgd", powersgd_start_iter=2)
  auto        TunedDDPStrategy(bucket_cap_mb="auto") with a small search that ends within the fit
  profiler    ddp_tuned + CommProfiler(export_dir=OUT/profile)
  doctor      ddp_tuned + DistributedDoctor(check_every_n_batches=2), data deliberately not
              sharded (use_distributed_sampler=False): the finding must cross the link
  hybrid      HybridParallelStrategy(devices_per_replica=2, balance=[2, 2], microbatches=2):
              2 replicas (one per node) x 2 CPU devices
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import CommProfiler, DistributedDoctor, HybridParallelStrategy, TunedDDPStrategy
from tests.scripts.models import StagedNet

CONFIGS = ("ddp_tuned", "fp16", "bf16", "powersgd", "auto", "profiler", "doctor", "hybrid")
STEPS = {"auto": 40}
DEFAULT_STEPS = 8
BATCH = 8


class Net(StagedNet):
    def __init__(self) -> None:
        super().__init__(width=48, blocks=4, out_features=1, embed_activation="tanh", example_batch=BATCH)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss


class HookProbe(L.Callback):
    """The communication hook DDP runs, read while the model is still wrapped (before teardown)."""

    def __init__(self, seen: dict[str, Any]) -> None:
        self.seen = seen

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ddp = trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel):
            self.seen["comm_hook"] = ddp._get_ddp_logging_data().get("comm_hook")


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1024, 8, generator=generator)
    return TensorDataset(x, torch.sin(x[:, :1]) * x[:, 1:2])


def strategy_for(config: str, out_dir: Path) -> Any:
    if config in ("fp16", "bf16"):
        return TunedDDPStrategy(compression=config)
    if config == "powersgd":
        return TunedDDPStrategy(compression="powersgd", powersgd_rank=1, powersgd_start_iter=2)
    if config == "auto":
        strategy = TunedDDPStrategy(bucket_cap_mb="auto", tune_candidates=[0.004, 0.016], tune_rounds=2)
        assert strategy.tuner is not None  # a search short enough for a test, whatever the run length
        strategy.tuner.settings = dataclasses.replace(
            strategy.tuner.settings, measure=2, settle=0, initial_warmup=0, min_run_multiple=1.0
        )
        return strategy
    if config == "hybrid":
        return HybridParallelStrategy(devices_per_replica=2, balance=[2, 2], microbatches=2)
    return TunedDDPStrategy()


def ranks_per_node_and_nodes() -> tuple[int, int]:
    """From torchrun's variables, or from SLURM's under ``srun``."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        return local, int(os.environ["WORLD_SIZE"]) // local
    return int(os.environ["SLURM_NTASKS_PER_NODE"]), int(os.environ["SLURM_NNODES"])


def fit(config: str, out_dir: Path) -> None:
    L.seed_everything(7, verbose=False)
    model = Net()
    strategy = strategy_for(config, out_dir)
    callbacks: list[L.Callback] = []
    if config == "profiler":
        callbacks.append(CommProfiler(warmup_steps=1, every_n_steps=2, export_dir=str(out_dir / "profile")))
    doctor = DistributedDoctor(check_every_n_batches=2) if config == "doctor" else None
    if doctor is not None:
        callbacks.append(doctor)
    seen: dict[str, Any] = {}
    callbacks.append(HookProbe(seen))
    local, nodes = ranks_per_node_and_nodes()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=local * (2 if config == "hybrid" else 1),
        num_nodes=nodes,
        strategy=strategy,
        max_steps=STEPS.get(config, DEFAULT_STEPS),
        callbacks=callbacks,
        use_distributed_sampler=config != "doctor",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data(), batch_size=BATCH))
    params = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    gathered = trainer.strategy.all_gather(params)  # every rank enters the collective
    record: dict[str, Any] = {
        "config": config,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "global_step": trainer.global_step,
        "losses": model.losses,
        "params": params.tolist(),
        "ranks_agree": bool(all(torch.equal(g, gathered[0]) for g in gathered)),
    }
    record.update(seen)
    if isinstance(strategy, TunedDDPStrategy):
        record["tuning"] = strategy.tuning
        record["bucket_cap_mb"] = strategy.bucket_cap_mb
    if isinstance(strategy, HybridParallelStrategy):
        record["plan"] = None if strategy.plan is None else list(strategy.plan.sizes)
    if doctor is not None:
        record["findings"] = sorted({f.rule for f in doctor.findings})
    if trainer.global_rank == 0:
        (out_dir / f"{config}.json").write_text(json.dumps(record))
    del trainer, model, strategy
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {CONFIGS}")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for config in configs:
        fit(config, args.out_dir)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
