"""The hand-split GPT of ``train_gpt_plain.py`` as a LightningModule on ``HybridParallelStrategy(split_points=...)``.

What changes against the plain loop:

* the model is not touched: no rewritten ``forward``, no ``.to(device1)``, no copy of the
  tied weight. ``split_points=["model.transformer.h.2"]`` names the submodule where the
  second stage begins (torch's convention, the same names for Hugging Face's
  ``GPT2LMHeadModel``); the strategy places every module on its stage's device and cuts
  the activation where that block is called;
* the tied embedding stays one parameter: the first stage uses it as the token embedding,
  the last as the output layer, and its gradient is the sum of both stages' parts;
* the batch runs as ``--microbatches`` micro-batches under ``--schedule`` (``1f1b``: each
  stage holds at most 2 micro-batches of activations; ``gpipe``; ``zero_bubble``), so
  both devices compute at once;
* ``training_step`` runs once per micro-batch inside the pipeline (the loss too, so 1F1B
  can start a backward early): ``self.log`` is combined over the micro-batches for you, and
  the step's loss (the sample-weighted mean, i.e. the full batch's) arrives in
  ``on_train_batch_end``;
* ``--devices`` counts all devices; every ``--devices-per-replica`` of them form one
  replica (one process), and DDP averages gradients across replicas.

The numbers are the plain loop's (the tests check it to 1e-5): micro-batches change only
the order of a sum, and for 2 replicas give each ``--batch-size`` / 2.

    diff recipes/model_split/train_gpt_plain.py recipes/model_split/train_gpt_lightning.py

Run:

    python recipes/model_split/train_gpt_lightning.py                          # CPU: 1 replica on 2 "devices"
    python recipes/model_split/train_gpt_lightning.py --devices 4 --batch-size 16    # CPU: 2 replicas x 2
    python recipes/model_split/train_gpt_lightning.py --accelerator gpu --devices 2  # cuda:0 + cuda:1
    python recipes/model_split/train_gpt_lightning.py --accelerator gpu --devices 8 --batch-size 8
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from train_gpt_plain import GPT, make_data, next_token_loss  # the same model, loss and data as the plain loop

from lightning_mgpu import HybridParallelStrategy

# -----------------------------------------------------------------------------
# Settings
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seed", type=int, default=0, help="seeds the data and the model's initial weights")
parser.add_argument("--num-samples", type=int, default=1024, help="sequences in the synthetic data set")
parser.add_argument("--vocab", type=int, default=32, help="tokens in the vocabulary")
parser.add_argument("--context", type=int, default=32, help="tokens per sequence")
parser.add_argument("--width", type=int, default=64, help="embedding width")
parser.add_argument("--heads", type=int, default=4, help="attention heads")
parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
parser.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step, per replica")
parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--epochs", type=int, default=3, help="passes over the data set")
parser.add_argument(
    "--split-points", default=None, help="comma-separated submodules where stages 1.. begin (default: the middle block)"
)
parser.add_argument("--record", default=None, help="save per-step losses and final weights here (for the tests)")
parser.add_argument("--accelerator", default="auto", help="cpu, gpu, ... (auto: the GPUs if there are at least 2)")
parser.add_argument(
    "--devices", type=int, default=None, help="all devices on this node (default: every GPU, else 2 CPU)"
)
parser.add_argument("--devices-per-replica", type=int, default=2, help="devices one model is split over")
parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step in the pipeline")
parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zero_bubble"], help="pipeline schedule")
parser.add_argument("--out-dir", default="runs/model_split_gpt", help="where Lightning writes its logs")


class LanguageModel(L.LightningModule):
    def __init__(self, model: GPT, train_set: TensorDataset, batch_size: int, lr: float, momentum: float) -> None:
        super().__init__()
        self.model = model  # as it is: the strategy cuts it at the split points
        self.train_set = train_set
        self.batch_size = batch_size
        self.lr = lr
        self.momentum = momentum
        self.losses: list[float] = []

    def train_dataloader(self) -> DataLoader:
        # The plain loop's order (Lightning's automatic sampler would shuffle; it is off):
        # replica r of n reads samples r, r+n, ..., so together they read the plain batch.
        sampler = DistributedSampler(
            self.train_set, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def on_train_start(self) -> None:
        self.start_time = time.perf_counter()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        # Runs once per micro-batch, inside the pipeline: no per-step bookkeeping here.
        (ids,) = batch
        loss = next_token_loss(self.model(ids), ids)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())  # the whole batch's loss, once per step

    def on_train_end(self) -> None:
        self.train_seconds = time.perf_counter() - self.start_time


def main() -> None:
    args = parser.parse_args()
    L.seed_everything(args.seed, verbose=False)
    gpus = torch.cuda.device_count()
    accelerator = args.accelerator if args.accelerator != "auto" else ("gpu" if gpus >= 2 else "cpu")
    devices = args.devices or (gpus if accelerator == "gpu" else 2)
    k = args.devices_per_replica
    split_points = (
        args.split_points.split(",")
        if args.split_points
        else [f"model.transformer.h.{args.layers * stage // k}" for stage in range(1, k)]
    )

    train_set = make_data(args.num_samples, args.context, args.vocab, args.seed)
    torch.manual_seed(args.seed)  # the plain loop seeds right before building its model
    model = GPT(args.vocab, args.context, args.width, args.heads, args.layers)
    lightning_module = LanguageModel(model, train_set, args.batch_size, args.lr, args.momentum)

    strategy = HybridParallelStrategy(
        devices_per_replica=k, split_points=split_points, schedule=args.schedule, microbatches=args.microbatches
    )
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_epochs=args.epochs,
        use_distributed_sampler=False,  # keep the plain loop's order: see train_dataloader
        logger=CSVLogger(args.out_dir),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(lightning_module)
    if trainer.global_rank != 0:
        return

    tokens = trainer.global_step * args.batch_size * trainer.world_size * args.context
    run = Table(title="Run")
    run.add_column("quantity")
    run.add_column("value", justify="right")
    run.add_row("optimizer steps", str(trainer.global_step))
    run.add_row(
        "global batch", f"{args.batch_size * trainer.world_size} ({trainer.world_size} replica(s) x {args.batch_size})"
    )
    run.add_row("tokens/s", f"{tokens / lightning_module.train_seconds:,.0f}")
    run.add_row("train loss (last epoch)", f"{trainer.callback_metrics['train_loss'].item():.5f}")
    run.add_row("stages", f"{k} per replica, beginning at {strategy.split_points}, schedule {args.schedule!r}")
    Console().print(run)

    if args.record:
        parameters = [p.detach().cpu() for p in lightning_module.model.parameters()]
        torch.save(
            {"losses": lightning_module.losses, "parameters": parameters, "world_size": trainer.world_size}, args.record
        )


if __name__ == "__main__":
    main()
