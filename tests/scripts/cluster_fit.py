"""A small fit under SLURM (``srun``, one task per rank) that records every attempt of a requeued job.

    srun --nodes=2 --ntasks-per-node=1 python -m tests.scripts.cluster_fit --out-dir OUT --strategy ddp_tuned \\
        --steps 60 --slow-after 10 --step-sleep 0.2

Lightning reads the job's environment (``SLURMEnvironment``: ranks from ``SLURM_PROCID``, the first node
as the rendezvous) and, with ``auto_requeue`` (its default), resumes by itself from the newest
``hpc_ckpt_N.ckpt`` in ``default_root_dir`` (``OUT/root``) when the job is started again. The batches
do not depend on the loader's position: each is drawn from a generator seeded by the global step
and the rank, so an attempt that resumed at step S takes exactly the steps S+1.. of an uninterrupted
run. SGD with momentum: the optimizer's state must come back too.

``--slow-after K --step-sleep S``: from step K on, every step of the attempts ``--slow-attempts``
(``0``: the first) sleeps S seconds, so that a signal sent after the marker lands in the middle of
training, or that a job preempted by its time limit cannot finish before the limit's signal;
rank 0 creates ``OUT/reached-<attempt>`` once step K is done.

A SLURM signal that came while the script is still starting (slurmctld checks time limits every
30 s, so ``--signal=USR1@T`` may come up to 30 s before T seconds are left, and starting a rank
on a loaded 2-core machine has taken 20 s) would end the process with the signal's default action
before any handler exists. So the script blocks SIGUSR1 in its first line and unblocks it when the
first batch starts: a signal that came meanwhile stays pending and reaches the handlers then, as if
it came at that moment (``early_signal`` in the record says so).

Every rank writes ``OUT/attempt<a>-rank<r>.json`` when its fit ends, however it ends (a requeued
job's attempt ``a`` is ``SLURM_RESTART_COUNT``): the step it started at and ended at, its loss at
every step it took, and how it ended (``completed``, or the exit status / exception). A rank killed
by SIGKILL writes nothing.
"""

from __future__ import annotations

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # before the slow imports: see the docstring

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import lightning_mgpu  # noqa: E402, F401  (registers strategy="ddp_tuned")


class Indices(Dataset[int]):
    def __len__(self) -> int:
        return 1_000_000  # one epoch covers any run: no epoch boundary to resume across

    def __getitem__(self, index: int) -> int:
        return index


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        generator = torch.Generator().manual_seed(1000 * step + self.trainer.global_rank)
        x = torch.randn(8, 16, generator=generator)
        y = torch.sin(x[:, :1]) * x[:, 1:2]
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[step] = loss.item()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Pace(L.Callback):
    """Slow steps from ``slow_after`` on; rank 0 marks that the step was reached; SIGUSR1 unblocked at the first batch."""

    def __init__(self, out_dir: Path, slow_after: int, sleep_s: float, attempt: int) -> None:
        self.marker = out_dir / f"reached-{attempt}"
        self.slow_after, self.sleep_s = slow_after, sleep_s
        self.early_signal = False

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, []):  # the first batch: every handler is in
            self.early_signal = signal.SIGUSR1 in signal.sigpending()
            if self.early_signal:
                print(f"rank {trainer.global_rank}: SIGUSR1 came while starting; delivered now", flush=True)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.slow_after:
            if trainer.global_rank == 0 and not self.marker.exists():
                self.marker.touch()
            time.sleep(self.sleep_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--strategy", choices=("ddp_tuned", "ddp"), default="ddp_tuned")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow-after", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--slow-attempts", default="0", help="comma-separated attempts that sleep (0)")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a stuck rank's stacks: scancel --signal=USR2
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    slow = str(attempt) in args.slow_attempts.split(",")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(5, verbose=False)
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["SLURM_NTASKS"]) // int(os.environ["SLURM_NNODES"]),
        num_nodes=int(os.environ["SLURM_NNODES"]),
        strategy=args.strategy,
        max_steps=args.steps,
        default_root_dir=args.out_dir / "root",
        callbacks=[pace := Pace(args.out_dir, args.slow_after, args.step_sleep if slow else 0.0, attempt)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    record: dict[str, Any] = {"attempt": attempt, "rank": int(os.environ["SLURM_PROCID"]), "start_step": None}
    record["started"] = time.time()

    class Start(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            record["start_step"] = trainer.global_step
            record["resumed_from"] = None if trainer.ckpt_path is None else os.path.basename(trainer.ckpt_path)

    trainer.callbacks.insert(0, Start())
    outcome = "completed"
    try:
        trainer.fit(model, DataLoader(Indices(), batch_size=1))
    except SystemExit as stop:
        outcome = f"exit {stop.code}"
        raise
    except BaseException as error:
        outcome = f"{type(error).__name__}: {str(error)[:300]}"
        raise
    finally:
        record.update(end_step=trainer.global_step, losses=model.losses, outcome=outcome, ended=time.time())
        record["early_signal"] = pace.early_signal
        path = args.out_dir / f"attempt{attempt}-rank{record['rank']}.json"
        path.write_text(json.dumps(record))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
