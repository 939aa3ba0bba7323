"""A small fit on N CPU ranks that hangs the way real jobs hang, for the hang watch's tests (tests/dist/watch/).

    python tests/scripts/hang_fit.py --out-dir OUT --scenario barrier --hang-timeout 20
    python tests/scripts/hang_fit.py --out-dir OUT --scenario uneven --ranks 4
    python tests/scripts/hang_fit.py --out-dir OUT --scenario barrier --stock   # strategy="ddp" + DistributedDoctor

Lightning's own launcher starts the ranks (``devices=--ranks``); the strategy is ``ddp_tuned`` with
``hang_timeout=--hang-timeout`` and torch's 30-minute collective timeout, so that nothing but the
watch ends a hang. Each scenario is written as a user would write the mistake; the line the
report must name is :data:`SITES`' (the tests find its number with :func:`site_line`). The odd rank
prints ``[hang_fit] rank R stalls (SCENARIO) at TIME`` when it goes wrong: the stall the watch must
report within seconds (``uneven``: the short rank at its fit's end; ``validation``: the other rank
back in training).

Scenarios (the odd rank is ``--rank``, default 0 for a collective only it calls, else 1):

  none        a clean fit (with ``--slow-step S``: one step of the odd rank takes S seconds of work)
  (any)       with ``--sigterm-after S``: S seconds after the stall the job gets SIGTERM (a preemption)
  barrier     ``trainer.strategy.barrier()`` under ``if self.global_rank == ...`` in training_step
  sync_dist   ``self.log(..., sync_dist=True)`` under a rank condition
  uneven      the odd rank's loader has half the batches; after fit every rank saves a checkpoint
  sleep       the odd rank sleeps an hour in training_step
  validation  the odd rank validates on 200 batches (the whole set), the others on 2 (their share)
  sigkill     the odd rank is killed (SIGKILL, as the OOM killer does) in training_step
  loader      the odd rank's dataset blocks for an hour in ``__getitem__``

At the end of a fit that ends, each rank writes ``OUT/rank<r>.json``; the report, if any, is
``OUT/hang_report.json`` (the log directory is ``OUT``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mgpu import DistributedDoctor, TunedDDPStrategy

SCENARIOS = ("none", "barrier", "sync_dist", "uneven", "sleep", "validation", "sigkill", "loader")
BATCHES = 6
BATCH = 4
STUCK_AT = 2  # the batch at which the odd rank goes wrong
SITES = {
    "barrier": "self.trainer.strategy.barrier()",
    "sync_dist": 'self.log("odd_loss", loss, sync_dist=True)',
    "sleep": "e.g. waiting for a lock",
    "sigkill": "its last moments",
    "loader": "a read from a file system that never answers",
    "validation": "an evaluation step",
    "uneven": 'trainer.save_checkpoint(args.out_dir / "final.ckpt")',
}
"""The line of this file each scenario's report must name (a piece of it)."""


def site_line(scenario: str) -> int:
    """The number of the line of this file that holds ``SITES[scenario]``."""
    lines = Path(__file__).read_text().splitlines()
    return next(
        number for number, line in enumerate(lines, 1) if SITES[scenario] in line and not line.lstrip().startswith('"')
    )


def stalled(scenario: str, rank: int) -> None:
    print(f"[hang_fit] rank {rank} stalls ({scenario}) at {time.time():.3f}", file=sys.stderr, flush=True)


class Numbers(Dataset):
    """``BATCHES * BATCH`` numbers; on the odd rank of ``loader``, item ``STUCK_AT * BATCH`` never comes."""

    def __init__(self, length: int, *, stuck: bool, rank: int) -> None:
        self.length, self.stuck, self.rank = length, stuck, rank

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.stuck and index == STUCK_AT * BATCH:
            stalled("loader", self.rank)
            time.sleep(3600)  # a read from a file system that never answers
        return torch.full((8,), float(index) / self.length)


class Net(L.LightningModule):
    def __init__(self, scenario: str, odd: int, slow_step_s: float, sigterm_after_s: float) -> None:
        super().__init__()
        self.scenario, self.odd, self.slow_step_s = scenario, odd, slow_step_s
        self.sigterm_after_s = sigterm_after_s
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        if batch_idx == STUCK_AT:
            self.go_wrong(loss)
        return loss

    def go_wrong(self, loss: torch.Tensor) -> None:
        odd = self.global_rank == self.odd
        if odd and self.scenario in ("barrier", "sync_dist", "sleep", "sigkill"):
            stalled(self.scenario, self.global_rank)
            if self.sigterm_after_s:
                preempt_later(self.sigterm_after_s, self.global_rank)
        if self.scenario == "barrier":
            if self.global_rank == self.odd:
                self.trainer.strategy.barrier()  # only this rank waits here
        elif self.scenario == "sync_dist":
            if self.global_rank == self.odd:
                self.log("odd_loss", loss, sync_dist=True)  # a value only this rank logs
        elif self.scenario == "sleep" and odd:
            time.sleep(3600)  # e.g. waiting for a lock another process holds
        elif self.scenario == "sigkill" and odd:
            time.sleep(3)  # its last moments (then the OOM killer, say): the watch publishes where it is
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.scenario == "none" and odd and self.slow_step_s:
            busy_for(self.slow_step_s)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.scenario == "validation":
            time.sleep(0.2)  # an evaluation step (the odd rank has 100 times the others' batches)

    def on_validation_end(self) -> None:
        if self.scenario == "validation" and self.global_rank != self.odd:
            stalled("validation", self.global_rank)  # back to training while the odd rank still validates

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        batches = BATCHES // 2 if self.scenario == "uneven" and self.global_rank == self.odd else BATCHES
        stuck = self.scenario == "loader" and self.global_rank == self.odd
        return DataLoader(Numbers(batches * BATCH, stuck=stuck, rank=self.global_rank), batch_size=BATCH)

    def val_dataloader(self) -> DataLoader:
        batches = 200 if self.global_rank == self.odd else 2
        return DataLoader(Numbers(batches * BATCH, stuck=False, rank=self.global_rank), batch_size=BATCH)


def preempt_later(seconds: float, rank: int) -> None:
    """SIGTERM to the whole job ``seconds`` from now, as a scheduler preempts it (every rank blocked by then)."""

    def preempt() -> None:
        time.sleep(seconds)
        print(f"[hang_fit] rank {rank} sends SIGTERM to the job at {time.time():.3f}", file=sys.stderr, flush=True)
        os.killpg(os.getpgrp(), signal.SIGTERM)

    threading.Thread(target=preempt, daemon=True).start()


def busy_for(seconds: float) -> None:
    """A step that works (a third of a core) for ``seconds``: legitimately slow, never stuck."""
    end = time.monotonic() + seconds
    a = torch.randn(96, 96)
    while time.monotonic() < end:
        started = time.monotonic()
        while time.monotonic() - started < 0.05:
            a = torch.tanh(a @ a)
        time.sleep(0.1)


class Report(L.Callback):
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        report = {"rank": trainer.global_rank, "pid": os.getpid(), "global_step": trainer.global_step}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--scenario", choices=SCENARIOS, default="none")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--rank", type=int, default=None, help="the odd rank (default: 0 for barrier/sync_dist, else 1)"
    )
    parser.add_argument("--hang-timeout", type=float, default=20.0)
    parser.add_argument("--slow-step", type=float, default=0.0, help="none: seconds of one slow step of the odd rank")
    parser.add_argument(
        "--sigterm-after", type=float, default=0.0, help="SIGTERM to the job this long after the stall (preemption)"
    )
    parser.add_argument("--stock", action="store_true", help='strategy="ddp" with DistributedDoctor(hang_timeout=...)')
    parser.add_argument("--wandb", action="store_true", help="a WandbLogger (offline) under OUT")
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    odd = args.rank if args.rank is not None else (0 if args.scenario in ("barrier", "sync_dist") else 1)

    L.seed_everything(3, verbose=False)
    callbacks: list[L.Callback] = [Report(args.out_dir)]
    strategy: Any
    if args.stock:
        strategy = "ddp"
        callbacks.append(DistributedDoctor(hang_timeout=args.hang_timeout))
    else:
        strategy = TunedDDPStrategy(hang_timeout=args.hang_timeout)
    logger: Any = False
    if args.wandb:
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(save_dir=str(args.out_dir), offline=True, project="hang_fit")
    validating = args.scenario == "validation"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.ranks // args.num_nodes,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=1,
        callbacks=callbacks,
        logger=logger,
        default_root_dir=str(args.out_dir),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # every rank's loader is its own (the scenarios make them differ)
        limit_val_batches=None if validating else 0,
        val_check_interval=3 if validating else None,
        num_sanity_val_steps=0,
    )
    print(f"[hang_fit] rank {trainer.global_rank} pid {os.getpid()} starts at {time.time():.3f}", file=sys.stderr)
    trainer.fit(Net(args.scenario, odd, args.slow_step, args.sigterm_after))
    if args.scenario == "uneven":
        if trainer.global_rank == odd:
            stalled("uneven", trainer.global_rank)  # out of batches, while the others still train
        trainer.save_checkpoint(args.out_dir / "final.ckpt")  # every rank saves after fit
    print(f"[hang_fit] rank {trainer.global_rank} done at {time.time():.3f}", file=sys.stderr)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
