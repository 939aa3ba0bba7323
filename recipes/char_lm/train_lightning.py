"""A character-level transformer language model, trained with Lightning on ``strategy="ddp_tuned"``.

train_plain.py is the same recipe as a hand-written DistributedDataParallel loop, and this
file is its conversion: Lightning starts the processes, creates the process group, gives
each rank its DistributedSampler and calls set_epoch, wraps the model in DDP, averages the
validation loss over the ranks and cleans up at the end. The run stays the same, step for
step (tests/dist/recipes/test_char_lm.py checks it); ``diff`` the two files to see exactly what
changed.

The model reads the notes in data/corpus.txt one character at a time and learns to predict
the next one; at the end it writes a short sample of its own.

Run it:
    # every GPU of this machine, or 2 CPU processes when there is none (this is `make demo`)
    python recipes/char_lm/train_lightning.py
    # one GPU
    python recipes/char_lm/train_lightning.py --accelerator gpu --devices 1
    # 2 machines with 4 GPUs each: run this on both
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        recipes/char_lm/train_lightning.py --devices 4 --num-nodes 2
    # SLURM, one task per GPU: Lightning reads the job's environment itself
    srun --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 \\
        python recipes/char_lm/train_lightning.py --devices 4 --num-nodes 2
    # log to Weights & Biases (offline unless WANDB_MODE=online; `wandb sync` uploads later)
    python recipes/char_lm/train_lightning.py --wandb

--batch-size is per process: the global batch is --batch-size x world size.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mgpu import DistributedDoctor  # importing lightning_mgpu registers strategy="ddp_tuned"

HERE = Path(__file__).resolve().parent
# Lightning 2.6 on a recent torch trips over torch's own LeafSpec deprecation: harmless, and not ours.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


# ----------------------------------------------------------------------------- settings


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # data: windows of --block-size characters, one starting every --stride characters
    parser.add_argument("--data", type=Path, default=HERE / "data" / "corpus.txt", help="a plain-text file")
    parser.add_argument("--max-chars", type=int, default=None, help="read only the first N characters (short tests)")
    parser.add_argument("--block-size", type=int, default=64, help="characters of context the model sees")
    parser.add_argument("--stride", type=int, default=8, help="characters between two training windows' starts")
    # model: a small decoder-only transformer
    parser.add_argument("--width", type=int, default=96, help="embedding width")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads per block")
    # training
    parser.add_argument("--batch-size", type=int, default=32, help="windows per process and step")
    parser.add_argument("--lr", type=float, default=1.0, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="largest norm of the averaged gradient")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234, help="weights, data order and the sample")
    # where to run: Lightning starts the processes on this machine itself
    parser.add_argument("--accelerator", default="auto", help="auto, gpu or cpu")
    parser.add_argument(
        "--devices",
        type=int,
        default=torch.cuda.device_count() or 2,
        help="processes per machine (default: every GPU, or 2 CPU processes when there is none)",
    )
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (torchrun or SLURM starts them)")
    # what to show at the end, and where logs go
    parser.add_argument("--prompt", default="The sampler ", help="text the sample starts from")
    parser.add_argument("--sample-chars", type=int, default=200, help="characters to generate after training")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/char_lm"), help="CSV logs (or W&B's files)")
    parser.add_argument("--wandb", action="store_true", help="log to Weights & Biases instead of CSV")
    parser.add_argument(
        "--doctor",
        action="store_true",
        help="check for the classic multi-GPU mistakes while training (DistributedDoctor(strict=True): stops on a finding)",
    )
    parser.add_argument("--record", type=Path, default=None, help="save per-step losses and final weights (tests)")
    return parser.parse_args()


# ----------------------------------------------------------------------------- data


def load_corpus(path: Path, max_chars: int | None) -> tuple[str, list[str]]:
    """The text (its first max_chars characters) and the vocabulary of the whole file."""
    text = path.read_text(encoding="utf-8")
    vocab = sorted(set(text))  # from the whole file, so --max-chars never changes the model's shape
    return text[:max_chars], vocab


class CharWindows(Dataset):
    """Windows of block_size characters, one every `stride` characters; targets are shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int) -> None:
        if len(tokens) <= block_size:
            raise ValueError(f"need more than block_size={block_size} characters, got {len(tokens)}")
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


# ----------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        # No bias: a key bias adds the same number to a whole row of scores, which softmax
        # ignores. Its gradient is zero but for rounding noise, which Adam would turn into steps.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time_, width = x.shape
        q, k, v = (
            t.view(batch, time_, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # each position sees only the past
        return self.proj(y.transpose(1, 2).reshape(batch, time_, width))


class Block(nn.Module):
    """Pre-norm transformer block. No dropout: nothing random happens during training."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(block_size, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.size(1), device=ids.device)
        x = self.token_embedding(ids) + self.position_embedding(positions)
        return self.head(self.norm(self.blocks(x)))

    @torch.no_grad()
    def generate(
        self, ids: torch.Tensor, length: int, generator: torch.Generator, temperature: float = 0.8
    ) -> torch.Tensor:
        """Append `length` sampled characters to the 1-d tensor `ids`."""
        for _ in range(length):
            logits = self(ids[None, -self.block_size :])[0, -1] / temperature
            next_id = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            ids = torch.cat([ids, next_id])
        return ids


def next_char_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ----------------------------------------------------------------------------- training


class CharLM(L.LightningModule):
    """The training and validation steps of train_plain.py's loop; Lightning runs the loop."""

    def __init__(self, model: CharTransformer, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr
        self.losses: list[torch.Tensor] = []  # loss on this rank's batch, every step
        self.train_started = self.train_seconds = 0.0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = next_char_loss(self.model(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        self.losses.append(loss.detach())
        return loss  # Lightning calls zero_grad, backward (DDP averages the gradients), clips and steps

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        # sync_dist: the epoch's mean over every rank's windows, like evaluate() in train_plain.py
        loss = next_char_loss(self.model(inputs), targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=len(inputs))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD, not AdamW: AdamW divides each gradient by its own size, so a weight whose gradient is
        # nearly zero takes a full-size step in whatever direction rounding noise points. DDP's
        # averaged gradient differs from one process's full-batch gradient in the last bits only;
        # with SGD the two runs stay together (1e-6 after dozens of steps), with AdamW they do not.
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)

    def on_train_start(self) -> None:
        self.train_started = time.perf_counter()

    def on_train_end(self) -> None:
        self.train_seconds = time.perf_counter() - self.train_started


class ProgressBar(RichProgressBar):
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | float | str]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's run number: noise next to the losses
        return metrics


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    # Seeds the weights (the same on every rank) and the DistributedSampler Lightning adds.
    L.seed_everything(args.seed, verbose=False)

    # data
    text, vocab = load_corpus(args.data, args.max_chars)
    char_to_id = {c: i for i, c in enumerate(vocab)}
    if unknown := set(args.prompt) - set(vocab):
        raise SystemExit(f"--prompt uses characters the corpus never does: {''.join(sorted(unknown))!r}")
    tokens = torch.tensor([char_to_id[c] for c in text])
    split = int(0.9 * len(tokens))  # the last 10% of the text is never trained on
    train_set = CharWindows(tokens[:split], args.block_size, args.stride)
    val_set = CharWindows(tokens[split:], args.block_size, args.block_size)
    # Lightning swaps in a DistributedSampler per rank (shuffled with seed_everything's seed for
    # training, in order for validation) and calls its set_epoch every epoch.
    # drop_last: every step sees a full batch, so a step's gradient is the global batch's mean
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)

    # model
    model = CharTransformer(len(vocab), args.block_size, args.width, args.layers, args.heads)
    lit_model = CharLM(model, args.lr)
    if args.wandb:
        os.environ.setdefault("WANDB_MODE", "offline")  # no network needed; `wandb sync` uploads later
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(project="lightning-mgpu-char-lm", save_dir=args.out_dir)
    else:
        logger = CSVLogger(args.out_dir, name="")
    logger.log_hyperparams({k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    # "auto" would pick Apple's MPS, which runs a single process: use CPU processes there.
    accelerator = "cpu" if args.accelerator == "auto" and not torch.cuda.is_available() else args.accelerator
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp_tuned",  # DDP with one process per device, on any number of devices
        max_epochs=args.epochs,
        gradient_clip_val=args.grad_clip,  # clip_grad_norm_ after DDP's average, as in train_plain.py
        logger=logger,
        # leave: one line per epoch stays on screen
        callbacks=[ProgressBar(leave=True)] + ([DistributedDoctor(strict=True)] if args.doctor else []),
        enable_checkpointing=False,
        enable_model_summary=False,  # the line printed below gives the parameter count
        log_every_n_steps=10,
    )
    if trainer.is_global_zero:
        print(
            f"{len(text):,} characters, {len(vocab)} symbols | {len(train_set):,} training windows of "
            f"{args.block_size} | {sum(p.numel() for p in model.parameters()):,} parameters | "
            f"world size {trainer.world_size} ({trainer.strategy.root_device.type})"
        )

    # training
    trainer.fit(lit_model, train_loader, val_loader)

    # summary (rank 0)
    if trainer.is_global_zero:
        step_losses = [loss.item() for loss in lit_model.losses]
        val_loss = trainer.callback_metrics["val_loss"].item()
        world_size, train_seconds = trainer.world_size, lit_model.train_seconds
        model.cpu().eval()  # sample on the CPU with a generator of its own: the text depends only on the weights
        prompt = torch.tensor([char_to_id[c] for c in args.prompt])
        sample = model.generate(prompt, args.sample_chars, torch.Generator().manual_seed(args.seed))
        print_summary(
            title="char_lm: Lightning + ddp_tuned",
            rows={
                "strategy": f"{type(trainer.strategy).__name__} ({trainer.strategy.process_group_backend})",
                "world size": f"{world_size} x {trainer.strategy.root_device.type}",
                "steps": f"{len(step_losses)} ({len(step_losses) // args.epochs} per epoch)",
                "global batch": f"{args.batch_size * world_size} windows x {args.block_size} characters",
                "tokens/s": f"{len(step_losses) * args.batch_size * world_size * args.block_size / train_seconds:,.0f}",
                "train loss": f"{step_losses[0]:.3f} (first step) -> {step_losses[-1]:.3f} (last step)",
                "val loss": f"{val_loss:.3f} (perplexity {math.exp(val_loss):.2f})",
                "wall time": f"{time.perf_counter() - started:.1f} s ({train_seconds:.1f} s training)",
            },
            sample="".join(vocab[i] for i in sample.tolist()),
        )
        if args.record:  # for the tests: what this run did, step by step, and where it ended
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            record = {"losses": step_losses, "state_dict": state, "world_size": world_size, "val_loss": val_loss}
            torch.save(record, args.record)


def print_summary(title: str, rows: dict[str, str], sample: str) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows.items():
        table.add_row(name, value)
    console = Console()
    console.print(table)
    console.print(Panel(Text(sample), title="sample", title_align="left", expand=False))


if __name__ == "__main__":
    main()
