"""Fit a small model on 2 CPU ranks, inject one failure, checkpoint, resume: for the tests of
tests/dist/strategies/test_reliability_*.py.

    python -m tests.scripts.fail_fit --out-dir OUT --fail step --rank 1 --at 3
    python -m tests.scripts.fail_fit --out-dir OUT --strategy hybrid --fail sigkill --rank 0 --at 13 --ckpt-every 8
    python -m tests.scripts.fail_fit --out-dir OUT --start-method spawn --fail worker --rank 1
    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 -m tests.scripts.fail_fit \
        --out-dir OUT --fail sigkill --rank 1 --at 13 --once OUT/killed --ckpt-every 8 --resume latest

The model (``tests.scripts.models.StagedNet``): ``embed`` -> ``body`` (an nn.Sequential of 4
Linear+Tanh blocks, what ``hybrid`` splits over 2 CPU "devices" per process) -> ``head``, trained
with Adam. The data do not depend on the data loader's position: each batch is drawn from a
generator seeded by the global batch count and the rank, so a resumed fit sees exactly the
batches the uninterrupted one saw (the loader only yields indices; it exists to fail on demand).

Failures (``--fail``, on rank ``--rank`` at global batch ``--at``, counted from 0 over the whole fit):

  step      RuntimeError in training_step
  callback  RuntimeError in a callback's on_train_batch_end
  loader    RuntimeError in the dataset's __getitem__ (num_workers=0: in the rank's process), at its --at'th item
  worker    the same in a DataLoader worker process (num_workers=1)
  stage     RuntimeError in the split module's last layer (hybrid: in a pipeline stage thread)
  sigkill   the rank kills itself with SIGKILL
  stuck     the rank sleeps for an hour in training_step: no connection closes
  mismatch  the rank enters a barrier the others never enter: every rank waits in a collective
  sigterm   the rank sends itself SIGTERM (preemption of one rank) and goes on with its step
  sigterm_group  the rank sends SIGTERM to its whole process group (every rank, and the launcher), as
            ``kill -TERM -PGID`` or a scheduler does

``--linger-s S``: the failing rank, on its way out, stays alive ``S`` seconds after its process group
is destroyed (its connections closed): a slow exit, as on a loaded machine.

``--busy-s S``: at the failure's batch the other ranks spend ``S`` seconds in ``training_step`` first (a long
step, outside any collective): a rank killed meanwhile is seen by Lightning's child-process observer (it polls
every 5 s) before any collective fails.

``--loss-scale 1e7`` makes the gradients huge (above float16's 65504; Adam does not mind), and
``--torch-fp16-hook`` registers torch's own ``fp16_compress_hook``: tests/dist/comm/test_fp16_safety.py.

The failure is written ``injected <kind> failure`` (the rank is not in the message: the launcher and
torch must say which rank failed). With ``--once PATH`` it happens only while PATH does not exist
(it is created first): the attempt after a ``torchrun --max-restarts`` restart runs clean.

At the end of fit every rank writes ``OUT/rank<r>.json`` (losses, steps, the callbacks' and the
strategy's states, the sockets this process listens on) and ``OUT/rank<r>.pt`` (flat parameters,
optimizer state, PowerSGD memory) for exact comparisons.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mgpu import CommProfiler, HybridParallelStrategy, TunedDDPStrategy
from lightning_mgpu.callbacks.doctor import DistributedDoctor
from tests.scripts.models import StagedNet, position_generator

KINDS = (
    "none",
    "step",
    "callback",
    "loader",
    "worker",
    "stage",
    "sigkill",
    "stuck",
    "mismatch",
    "sigterm",
    "sigterm_group",
)
BATCHES_PER_EPOCH = 6  # per rank: epochs end and start inside the short fits, and step 8 is mid-epoch
BATCH, WIDTH, OUT = 16, 64, 16  # every tensor a multiple of 64 bytes: same rounding in any bucket layout
INDICES_PER_BATCH = 4


class Injected(RuntimeError):
    pass


class Plan:
    """Where and when to fail (the same object on every rank; each rank checks whether it is the one)."""

    def __init__(self, kind: str, rank: int, at: int, once: Optional[str], busy_s: float = 0.0) -> None:
        self.kind, self.rank, self.at, self.once, self.busy_s = kind, rank, at, once, busy_s

    def due(self, kind: str, rank: int, batch: int) -> bool:
        if self.kind != kind or rank != self.rank or batch != self.at:
            return False
        if self.once is not None:
            if os.path.exists(self.once):
                return False
            Path(self.once).write_text(str(os.getpid()))
        return True

    def fire(self, kind: str) -> None:
        print(f"[fail_fit] injecting {kind} (pid {os.getpid()}) at {time.time():.3f}", file=sys.stderr, flush=True)
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if kind == "sigterm_group":
            os.killpg(os.getpgrp(), signal.SIGTERM)
            return
        if kind == "stuck":
            time.sleep(3600)
        if kind == "mismatch":
            torch.distributed.barrier()  # the other ranks are in DDP's all-reduce of this step
            return
        raise Injected(f"injected {kind} failure")


class Indices(Dataset):
    """Yields indices only; fails at its ``at``-th item on the planned rank (``loader``/``worker``)."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan, self.rank, self.served = plan, rank, 0

    def __len__(self) -> int:
        return 2 * BATCHES_PER_EPOCH * INDICES_PER_BATCH

    def __getitem__(self, index: int) -> int:
        served, self.served = self.served, self.served + 1
        for kind in ("loader", "worker"):
            if self.plan.due(kind, self.rank, served):
                self.plan.fire(kind)
        return index


class Net(StagedNet):
    def __init__(self, plan: Plan, workers: int, loss_scale: float = 1.0) -> None:
        super().__init__(width=WIDTH, blocks=4, out_features=OUT, embed_activation="tanh", example_batch=BATCH)
        self.plan, self.workers, self.loss_scale = plan, workers, loss_scale
        self._arm_stage = False
        self.body[-1].register_forward_pre_hook(self._stage_hook)

    def _stage_hook(self, module: nn.Module, args: Any) -> None:
        if self._arm_stage:  # runs where the layer runs: a pipeline stage thread under hybrid
            self._arm_stage = False
            self.plan.fire("stage")

    def train_dataloader(self) -> DataLoader:
        dataset = Indices(self.plan, self.global_rank)
        return DataLoader(
            dataset, batch_size=INDICES_PER_BATCH, num_workers=self.workers, persistent_workers=self.workers > 0
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        seen = self.trainer.fit_loop.epoch_loop.batch_progress.total.ready - 1  # restored on resume
        for kind in ("step", "sigkill", "stuck", "mismatch", "sigterm", "sigterm_group"):
            if self.plan.due(kind, self.global_rank, seen):
                self.plan.fire(kind)
        if self.plan.busy_s and seen == self.plan.at and self.global_rank != self.plan.rank:
            time.sleep(self.plan.busy_s)
        self._arm_stage = self.plan.due("stage", self.global_rank, seen)
        generator = position_generator(seen, self.global_rank)
        x = torch.randn(BATCH, 8, generator=generator)
        y = torch.sin(2 * x).repeat(1, OUT // 8) * x[:, :1]
        loss = self.loss_scale * nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss


class FailingCallback(L.Callback):
    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        seen = trainer.fit_loop.epoch_loop.batch_progress.total.ready - 1
        if self.plan.due("callback", trainer.global_rank, seen):
            self.plan.fire("callback")


class Report(L.Callback):
    """Every rank's state at the end of fit (and the sockets it listens on, seen at the start)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.listening: list[dict[str, Any]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.listening = listening_sockets(os.getpid())
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is the parent: its rendezvous store
            self.listening += [{**s, "process": "torchrun agent"} for s in listening_sockets(os.getppid())]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(pl_module, Net)
        strategy = trainer.strategy
        assert isinstance(strategy, TunedDDPStrategy)
        rank = trainer.global_rank
        callbacks = {
            type(c).__name__: c.state_dict()
            for c in trainer.callbacks
            if isinstance(c, (CommProfiler, DistributedDoctor))
        }
        report: dict[str, Any] = {
            "rank": rank,
            "pid": os.getpid(),
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "losses": pl_module.losses,
            "callbacks": callbacks,
            "package_state": strategy.state_for_checkpoint(),
            "listening": self.listening,
            "doctor_findings": [
                f.as_dict() for c in trainer.callbacks if isinstance(c, DistributedDoctor) for f in c.findings
            ],
        }
        tensors: dict[str, Any] = {
            "params": torch.cat([p.detach().cpu().flatten() for p in pl_module.parameters()]),
            "optimizer": trainer.optimizers[0].state_dict(),
        }
        keeper = getattr(strategy, "powersgd_keeper", None)
        if keeper is not None:
            tensors["powersgd"] = keeper.state_dict()
        torch.save(tensors, self.out_dir / f"rank{rank}.pt")
        (self.out_dir / f"rank{rank}.json").write_text(json.dumps(report, default=str))


def listening_sockets(pid: int) -> list[dict[str, Any]]:
    """TCP sockets in LISTEN state held by process ``pid``, with their local address (Linux /proc)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append({"pid": pid, "address": _proc_address(address), "port": int(port, 16)})
    return found


def _proc_address(hex_address: str) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def latest_checkpoint(directory: Path) -> Optional[Path]:
    found = sorted(directory.glob("*.ckpt"), key=lambda p: int(p.stem.split("step=")[1].split("-")[0].split(".")[0]))
    return found[-1] if found else None


STARTUP_WAIT_S = 120.0


def wait_for_every_process_to_start(strategy: TunedDDPStrategy, out_dir: Path, processes: int) -> None:
    """With ``--timeout-s``, hold this rank's rendezvous until every process of the job has started.

    torch bounds the rendezvous by the same ``timeout`` as the collectives: with the few seconds
    these runs give it (so that a hang ends quickly), a rank that Lightning's launcher starts while
    2 busy cores import Lightning can reach the rendezvous too late, and rank 0 fails there ("1/2
    clients joined") instead of in the collective under test. Each process marks ``OUT/started/``
    once its imports are done; the rendezvous waits for all of them, so only the collectives run
    under the short timeout. Start-up is not what these runs test."""
    marks = out_dir / "started"
    marks.mkdir(parents=True, exist_ok=True)
    (marks / str(os.getpid())).touch()
    setup_distributed = strategy.setup_distributed

    def setup_when_all_started() -> None:
        deadline = time.monotonic() + STARTUP_WAIT_S
        while len(list(marks.iterdir())) < processes and time.monotonic() < deadline:
            time.sleep(0.05)
        setup_distributed()

    strategy.setup_distributed = setup_when_all_started  # type: ignore[method-assign]


def linger_if_failing_rank(plan: Plan, seconds: float) -> None:
    """Registered before the strategy's own exit handler (``atexit`` runs last-registered first): runs after the
    process group is destroyed, while the process is still alive."""
    if os.environ.get("LOCAL_RANK", "0") == str(plan.rank) and plan.kind != "none":
        print(f"[fail_fit] lingering {seconds:g} s after the process group closed", file=sys.stderr, flush=True)
        time.sleep(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--strategy", choices=("ddp_tuned", "hybrid"), default="ddp_tuned")
    parser.add_argument("--strategy-kwargs", default="{}", help="JSON, extra strategy arguments")
    parser.add_argument("--start-method", choices=("popen", "spawn"), default="popen")
    parser.add_argument("--timeout-s", type=float, default=None, help="the strategy's collective timeout")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fail", choices=KINDS, default="none")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--at", type=int, default=3, help="global batch index (from 0) at which to fail")
    parser.add_argument("--once", default=None, help="fail only while this file does not exist (it is created)")
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: 1 for --fail worker)")
    parser.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every N optimizer steps")
    parser.add_argument("--resume", default=None, help="a checkpoint, or 'latest' in OUT/ckpt (none: start afresh)")
    parser.add_argument("--profiler", action="store_true", help="CommProfiler(warmup_steps=2, every_n_steps=4)")
    parser.add_argument(
        "--doctor",
        action="store_true",
        help="DistributedDoctor(check_every_n_batches=--ckpt-every or 4), wall-clock rule off",
    )
    parser.add_argument("--wandb", action="store_true", help="WandbLogger (offline) and CSVLogger under OUT")
    parser.add_argument("--linger-s", type=float, default=0.0, help="the failing rank's slow exit (see above)")
    parser.add_argument("--busy-s", type=float, default=0.0, help="the other ranks' long step (see above)")
    parser.add_argument("--loss-scale", type=float, default=1.0, help="multiply the loss (e.g. 1e7: huge gradients)")
    parser.add_argument(
        "--torch-fp16-hook", action="store_true", help="torch's own fp16_compress_hook as ddp_comm_hook"
    )
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    L.seed_everything(7, verbose=False)
    plan = Plan(args.fail, args.rank, args.at, args.once, args.busy_s)
    if args.linger_s:
        atexit.register(linger_if_failing_rank, plan, args.linger_s)
    workers = args.workers if args.workers is not None else int(args.fail == "worker")
    model = Net(plan, workers, args.loss_scale)
    kwargs: dict[str, Any] = json.loads(args.strategy_kwargs)
    if args.torch_fp16_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        kwargs["ddp_comm_hook"] = default_hooks.fp16_compress_hook
    if args.timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=args.timeout_s)
    if args.start_method != "popen":
        kwargs["start_method"] = args.start_method
    devices = 2
    if args.strategy == "hybrid":
        kwargs = {"devices_per_replica": 2, "microbatches": 2, **kwargs}
        strategy: TunedDDPStrategy = HybridParallelStrategy(**kwargs)
        devices = 4  # 2 processes x 2 CPU stages
    else:
        strategy = TunedDDPStrategy(**kwargs)
    if args.timeout_s is not None:
        wait_for_every_process_to_start(strategy, args.out_dir, processes=2)
    callbacks: list[L.Callback] = [FailingCallback(plan), Report(args.out_dir)]
    every = args.ckpt_every or 4
    if args.profiler:
        callbacks.append(CommProfiler(warmup_steps=2, every_n_steps=4, export_dir=args.out_dir / "profile"))
    if args.doctor:
        # The resume tests compare the doctor's state bit for bit with an uninterrupted run's; "dataloader-starving"
        # judges wall-clock time (this model's steps take a few ms, so one fetch delayed by a loaded machine can
        # exceed 25% of a check's window: it fired in one CI run's resumed run and not in its reference). Every
        # other rule sees only what the run computes.
        callbacks.append(DistributedDoctor(check_every_n_batches=every, disable=("dataloader-starving",)))
    if args.ckpt_every:
        callbacks.append(
            ModelCheckpoint(dirpath=args.out_dir / "ckpt", every_n_train_steps=args.ckpt_every, save_top_k=-1)
        )
    loggers: Any = False
    if args.wandb:
        from lightning.pytorch.loggers import CSVLogger, WandbLogger

        loggers = [WandbLogger(save_dir=str(args.out_dir), offline=True, project="fail_fit"), CSVLogger(args.out_dir)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        limit_train_batches=BATCHES_PER_EPOCH,
        callbacks=callbacks,
        logger=loggers,
        log_every_n_steps=1,
        enable_checkpointing=bool(args.ckpt_every),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume: Optional[str] = args.resume
    if resume == "latest":
        found = latest_checkpoint(args.out_dir / "ckpt")
        resume = None if found is None else str(found)
        print(f"[fail_fit] resuming from {resume}", file=sys.stderr, flush=True)
    trainer.fit(model, ckpt_path=resume)
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
