"""A character-level transformer language model, trained with hand-written DistributedDataParallel.

This is the loop people arrive with: the process group, the DistributedSampler and its
set_epoch, the DDP wrapper, a validation loss all-reduced by hand, rank-0 printing and the
clean-up at the end. train_lightning.py is the same recipe as a LightningModule on
``strategy="ddp_tuned"``; ``diff`` the two files to see exactly what the conversion removes.

The model reads the notes in data/corpus.txt one character at a time and learns to predict
the next one; at the end it writes a short sample of its own.

Run it:
    # one process (CPU, or the first GPU): a world of 1, no launcher needed
    python recipes/char_lm/train_plain.py
    # every GPU of this machine (or 2 CPU processes with --nproc-per-node=2)
    torchrun --standalone --nproc-per-node=gpu recipes/char_lm/train_plain.py
    # 2 machines with 4 GPUs each: run this on both
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        recipes/char_lm/train_plain.py
    # SLURM, one task per GPU (MASTER_ADDR: the first node of the job)
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) \\
        srun --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 python recipes/char_lm/train_plain.py

--batch-size is per process: the global batch is --batch-size x world size.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

HERE = Path(__file__).resolve().parent


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
    # what to show at the end
    parser.add_argument("--prompt", default="The sampler ", help="text the sample starts from")
    parser.add_argument("--sample-chars", type=int, default=200, help="characters to generate after training")
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Mean loss per window over every rank's share of the validation set."""
    model.eval()
    total = torch.zeros(2, device=device)  # [sum of losses x windows, windows]
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        total[0] += next_char_loss(model(inputs), targets) * len(inputs)
        total[1] += len(inputs)
    dist.all_reduce(total)  # sum over ranks first, then divide: right even if shares differ
    model.train()
    return (total[0] / total[1]).item()


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them

    # torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*; under srun alone SLURM says who we are;
    # started as plain `python`, this process is a world of 1.
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ.update(
            RANK=os.environ["SLURM_PROCID"],
            WORLD_SIZE=os.environ["SLURM_NTASKS"],
            LOCAL_RANK=os.environ["SLURM_LOCALID"],
        )
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()) if os.environ["WORLD_SIZE"] == "1" else "29500")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    is_main = rank == 0
    torch.manual_seed(args.seed)  # the same initial weights on every rank

    # data
    text, vocab = load_corpus(args.data, args.max_chars)
    char_to_id = {c: i for i, c in enumerate(vocab)}
    if unknown := set(args.prompt) - set(vocab):
        raise SystemExit(f"--prompt uses characters the corpus never does: {''.join(sorted(unknown))!r}")
    tokens = torch.tensor([char_to_id[c] for c in text])
    split = int(0.9 * len(tokens))  # the last 10% of the text is never trained on
    train_set = CharWindows(tokens[:split], args.block_size, args.stride)
    val_set = CharWindows(tokens[split:], args.block_size, args.block_size)
    # Every rank must compute the same permutation (same seed) and keep its own slice of it
    # (its own rank): with rank=0 everywhere, every process would train on the same batches.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    # drop_last: every step sees a full batch, so a step's gradient is the global batch's mean
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler)

    # model
    model = CharTransformer(len(vocab), args.block_size, args.width, args.layers, args.heads).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    # SGD, not AdamW: AdamW divides each gradient by its own size, so a weight whose gradient is
    # nearly zero takes a full-size step in whatever direction rounding noise points. DDP's
    # averaged gradient differs from one process's full-batch gradient in the last bits only;
    # with SGD the two runs stay together (1e-6 after dozens of steps), with AdamW they do not.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if is_main:
        print(
            f"{len(text):,} characters, {len(vocab)} symbols | {len(train_set):,} training windows of "
            f"{args.block_size} | {sum(p.numel() for p in model.parameters()):,} parameters | "
            f"world size {world_size} ({device.type})"
        )

    # training
    losses: list[torch.Tensor] = []  # loss on this rank's batch, every step
    train_started = time.perf_counter()
    for epoch in range(args.epochs):
        # The sampler mixes the epoch into its seed. Forget set_epoch and every epoch
        # replays the first one's order.
        train_sampler.set_epoch(epoch)
        for inputs, targets in train_loader:
            inputs, targets = inputs.to(device), targets.to(device)
            loss = next_char_loss(ddp_model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over all ranks here
            nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)  # after the average: same on every rank
            optimizer.step()
            losses.append(loss.detach())
        val_loss = evaluate(model, val_loader, device)
        if is_main:
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {losses[-1].item():.3f}, val loss {val_loss:.3f}")
    train_seconds = time.perf_counter() - train_started

    # summary (rank 0)
    if is_main:
        step_losses = [loss.item() for loss in losses]
        model.cpu().eval()  # sample on the CPU with a generator of its own: the text depends only on the weights
        prompt = torch.tensor([char_to_id[c] for c in args.prompt])
        sample = model.generate(prompt, args.sample_chars, torch.Generator().manual_seed(args.seed))
        print_summary(
            title="char_lm: hand-written DDP",
            rows={
                "strategy": f"DistributedDataParallel ({dist.get_backend()})",
                "world size": f"{world_size} x {device.type}",
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

    # A process that exits still holding DDP and its process group can abort at exit (gloo).
    # DDP sits in reference cycles: `del` alone does not free it, the collector does.
    del ddp_model
    gc.collect()
    dist.destroy_process_group()


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
