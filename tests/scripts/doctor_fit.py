"""Fit a tiny model under ``DistributedDoctor`` with chosen multi-GPU mistakes (or their fixes).

Run by tests/dist/callbacks/doctor/test_doctor.py on 2 CPU ranks, with Lightning's own launcher or under torchrun:

    python tests/scripts/doctor_fit.py --out-dir OUT --mistakes shared-data,augment --epochs 2
    python tests/scripts/doctor_fit.py --out-dir OUT --fixed --strict
    python tests/scripts/doctor_fit.py --out-dir OUT --model bert --strategy ddp

Every rank writes ``OUT/rank<r>.json``: the doctor's findings and state, or the error the fit
raised (the script then re-raises it: a non-zero exit), and the seconds from the fit's start.

Mistakes (``--mistakes``, comma-separated):
  shared-data      Trainer(use_distributed_sampler=False) and a plain DataLoader: every rank reads everything
  rank0-sampler    DistributedSampler(num_replicas=2, rank=0) on every rank
  nested-sampler   a shuffling DistributedSampler inside a custom sampler: Lightning cannot call set_epoch
  uneven           rank r has 64 + 16 r samples: different numbers of batches
  short-rank       rank r has one batch fewer than rank r - 1 (rank 1 ends its epoch first)
  short-iterable   the same through an IterableDataset (no length: the batch counts cannot be compared)
  dataparallel     the network wrapped in nn.DataParallel inside the LightningModule
  fake-gpus        the doctor is told 4 GPUs are visible (the run trains on CPU)
  batchnorm        a BatchNorm1d layer (use with a batch size below 16)
  augment          the dataset adds noise from the global generator (same seed on every rank)
  slow-data        the dataset sleeps 2 ms per sample
  diverge          rank 1 nudges a weight in place after batch 2
  find-unused-wasted  find_unused_parameters=True with every parameter used
  never-used       find_unused_parameters=True and a layer that is never called
  unused-needed    a layer that is never called, find_unused_parameters=False (DDP fails at step 2)
  unsynced-log     an epoch metric (train and validation) logged without sync_dist
  reentrant        the last layer run under checkpoint(use_reentrant=True), find_unused_parameters=True
``--model bert``: a Hugging Face BertModel from a tiny config (no download) whose pooler the loss never
uses, on random token ids, instead of the MLP (find_unused_parameters=False unless a mistake sets it).
``--fixed``: the correct counterparts where a check has something to look at: BatchNorm at batch 32,
augmentation with a per-rank seed, find_unused_parameters=True with a branch used every other step,
sync_dist=True, Lightning's distributed sampler.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, TensorDataset

from lightning_mgpu.callbacks.doctor.rules import unused_devices
from lightning_mgpu.callbacks.doctor import DistributedDoctor, DistributedDoctorError
from lightning_mgpu.strategies import TunedDDPStrategy
from lightning.pytorch.strategies import DDPStrategy

MISTAKES = {
    "shared-data",
    "rank0-sampler",
    "nested-sampler",
    "uneven",
    "dataparallel",
    "fake-gpus",
    "batchnorm",
    "augment",
    "slow-data",
    "diverge",
    "find-unused-wasted",
    "never-used",
    "unused-needed",
    "unsynced-log",
    "short-rank",
    "short-iterable",
    "reentrant",
}


class NoisyData(Dataset):
    """Adds noise from the global generator: an augmentation."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, noise: bool, sleep_s: float) -> None:
        self.x, self.y, self.noise, self.sleep_s = x, y, noise, sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        x = self.x[index]
        if self.noise:
            x = x + 0.1 * torch.randn_like(x)
        return x, self.y[index]


class Stream(IterableDataset):
    """The samples of a map-style data set, as a stream of unknown length."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return (self.dataset[i] for i in range(len(self.dataset)))  # type: ignore[arg-type]


class NestedSampler(Sampler[int]):
    """A custom sampler holding the DistributedSampler: Lightning's set_epoch never reaches it."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        self.base = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=0)

    def __iter__(self) -> Iterator[int]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


class Model(L.LightningModule):
    def __init__(self, args: argparse.Namespace, mistakes: set[str]) -> None:
        super().__init__()
        self.args, self.mistakes = args, mistakes
        layers: list[nn.Module] = [nn.Linear(8, 16)]
        if "batchnorm" in mistakes or args.fixed:
            layers.append(nn.BatchNorm1d(16))
        layers += [nn.Tanh(), nn.Linear(16, 1)]
        net: nn.Module = nn.Sequential(*layers)
        self.net = nn.DataParallel(net) if "dataparallel" in mistakes else net
        self.extra: Optional[nn.Linear] = None
        if mistakes & {"never-used", "unused-needed"} or args.fixed:
            self.extra = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if "reentrant" in self.mistakes:
            assert isinstance(self.net, nn.Sequential)
            # The last layer recomputed in backward: its input needs a gradient, or the region is left out.
            out = checkpoint(self.net[-1], self.net[:-1](x), use_reentrant=True)
        else:
            out = self.net(x)
        if self.extra is not None and self.args.fixed and batch_idx % 2 == 1:
            out = out + self.extra(x)  # a dynamic graph: find_unused_parameters=True is needed
        return out

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x, batch_idx), y)
        sync = "unsynced-log" not in self.mistakes
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=sync)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self(x, 0), y)
        self.log("val_loss", loss, sync_dist="unsynced-log" not in self.mistakes)

    def on_train_start(self) -> None:
        if self.args.fixed:
            torch.manual_seed(100 + self.global_rank)  # the fix for same-random-state

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if "diverge" in self.mistakes and self.global_rank == 1 and self.global_step == 3:
            with torch.no_grad():
                next(self.parameters()).add_(0.01)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        args, mistakes = self.args, self.mistakes
        world, rank = self.trainer.world_size, self.trainer.global_rank
        samples = args.samples + (16 * rank if "uneven" in mistakes else 0)
        samples -= args.batch_size * rank if mistakes & {"short-rank", "short-iterable"} else 0
        generator = torch.Generator().manual_seed(1000 + (rank if "uneven" in mistakes else 0))
        x = torch.randn(samples, 8, generator=generator)
        y = x[:, :1] * 2 + 0.1 * torch.randn(samples, 1, generator=generator)
        dataset = NoisyData(
            x, y, noise="augment" in mistakes or args.fixed, sleep_s=0.002 if "slow-data" in mistakes else 0.0
        )
        if "rank0-sampler" in mistakes:
            return DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, world, 0))
        if "nested-sampler" in mistakes:
            return DataLoader(dataset, batch_size=args.batch_size, sampler=NestedSampler(dataset, world, rank))
        if "short-iterable" in mistakes:
            return DataLoader(Stream(dataset), batch_size=args.batch_size)
        # shared-data / uneven / short-rank: Trainer(use_distributed_sampler=False), so this loader is used as is.
        return DataLoader(dataset, batch_size=args.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(7)
        x = torch.randn(64, 8, generator=generator)
        return DataLoader(TensorDataset(x, x[:, :1] * 2), batch_size=16)


class UnusedPoolerBert(L.LightningModule):
    """A tiny Hugging Face BERT regressing from the [CLS] token's hidden state: its pooler is never used."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        self.args = args
        config = BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
        )
        self.bert = BertModel(config)  # add_pooling_layer=True (the default): bert.pooler.dense
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, y = batch
        cls = self.bert(input_ids=ids).last_hidden_state[:, 0]
        return nn.functional.mse_loss(self.head(cls), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1000 + self.trainer.global_rank)
        ids = torch.randint(0, 64, (self.args.samples, 8), generator=generator)
        return DataLoader(TensorDataset(ids, torch.randn(self.args.samples, 1, generator=generator)), batch_size=8)


def main() -> None:
    started = time.monotonic()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--mistakes", default="")
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--check-every-n-batches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128, help="training samples per rank's data set")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--disable", default="")
    parser.add_argument("--validate", action="store_true", help="a validation loop every epoch")
    parser.add_argument("--save-every-epoch", action="store_true", help="ModelCheckpoint after every epoch")
    parser.add_argument("--resume", default=None, help="checkpoint to resume from")
    parser.add_argument("--strategy", choices=("ddp_tuned", "ddp"), default="ddp_tuned", help="ours, or Lightning's")
    parser.add_argument("--model", choices=("mlp", "bert"), default="mlp")
    parser.add_argument("--warn-fatal", action="store_true", help="DistributedDoctor(stop_on_fatal=False)")
    parser.add_argument("--check-timeout", type=float, default=None, help="DistributedDoctor(check_timeout=...)")
    args = parser.parse_args()
    mistakes = {m for m in args.mistakes.split(",") if m}
    if mistakes - MISTAKES:
        parser.error(f"unknown mistakes {sorted(mistakes - MISTAKES)}; known: {sorted(MISTAKES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    if "fake-gpus" in mistakes:
        unused_devices.cuda_device_count = lambda: 4  # stands in for a machine with 4 GPUs
    L.seed_everything(0, verbose=False)
    model: L.LightningModule = UnusedPoolerBert(args) if args.model == "bert" else Model(args, mistakes)
    find_unused = bool(mistakes & {"find-unused-wasted", "never-used", "reentrant"}) or args.fixed
    doctor = DistributedDoctor(
        strict=args.strict,
        check_every_n_batches=args.check_every_n_batches,
        disable=[d for d in args.disable.split(",") if d],
        **({"stop_on_fatal": False} if args.warn_fatal else {}),
        **({"check_timeout": args.check_timeout} if args.check_timeout is not None else {}),
    )
    callbacks: list[L.Callback] = [doctor]
    if args.save_every_epoch:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.out_dir / "ckpt", save_top_k=-1, every_n_epochs=1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=(
            TunedDDPStrategy(find_unused_parameters=find_unused)
            if args.strategy == "ddp_tuned"
            else DDPStrategy(find_unused_parameters=find_unused)
        ),
        max_epochs=args.epochs,
        use_distributed_sampler=not (
            mistakes & {"shared-data", "uneven", "short-rank", "short-iterable", "rank0-sampler", "nested-sampler"}
        ),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=args.save_every_epoch,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=None if args.validate else 0,
        num_sanity_val_steps=0,
    )
    report: dict[str, Any] = {"mistakes": sorted(mistakes)}
    try:
        trainer.fit(model, ckpt_path=args.resume)
        report["completed"] = True
    except DistributedDoctorError as error:
        report.update(completed=False, error_rules=error.rules, error=str(error), error_step=trainer.global_step)
        raise
    except BaseException as error:
        where = traceback.format_exception(error)[-12:]  # kept for the test's message: where it was raised
        report.update(completed=False, error_type=type(error).__name__, error=str(error), traceback="".join(where))
        raise
    finally:
        report.update(
            fit_s=time.monotonic() - started,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            global_step=trainer.global_step,
            findings=[f.as_dict() for f in doctor.findings],
            state=doctor.state_dict(),
        )
        (args.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
