"""A GPT-2-style language model split by hand over two devices: the transformer variant of the model_split recipe.

A transformer that does not fit one GPU is usually split like this: its blocks
``[0, cut)`` on the first device, the rest on the second, and the model's ``forward``
rewritten by hand with a ``.to(device1)`` where the activation crosses. The tied weight
(GPT-2's token embedding is also its output layer) lives on the first device, so the last
layer uses a copy of it on the second: the copy is differentiable, and its gradient flows
back to the one parameter. At any moment one device computes while the other waits.

``train_gpt_lightning.py`` is the same run as a ``LightningModule`` on
``HybridParallelStrategy(split_points=["model.transformer.h.2"])``: the model's own
``forward``, unmodified; the batch runs as micro-batches under the 1F1B schedule so both
devices work at once; the tied weight stays one parameter, its gradients summed over the
two stages.

    diff recipes/model_split/train_gpt_plain.py recipes/model_split/train_gpt_lightning.py

Run (two GPUs if there are; otherwise both "devices" are the CPU and the loop still runs):

    python recipes/model_split/train_gpt_plain.py

Data: token sequences drawn from a fixed random bigram table (a "language" whose next
token depends on the current one), read in order, so the Lightning script reads the same
batches. The model is GPT-2's architecture at toy size (pre-norm blocks, causal
self-attention, GELU MLP, learned positions, tied embeddings), written here with GPT-2's
attribute names (``transformer.wte``, ``transformer.h.N``, ``lm_head``), so the split points
are the ones Hugging Face's ``GPT2LMHeadModel`` takes. No dropout: the two scripts draw
no random numbers while training, so they compute the same numbers.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

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
parser.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step")
parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--epochs", type=int, default=3, help="passes over the data set")
parser.add_argument("--cut", type=int, default=None, help="first block on the second device (default: layers // 2)")
parser.add_argument("--record", default=None, help="save per-step losses and final weights here (for the tests)")


# -----------------------------------------------------------------------------
# The model: GPT-2's architecture, GPT-2's attribute names
class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, width),
                "wpe": nn.Embedding(context, width),
                "h": nn.ModuleList(Block(width, heads) for _ in range(layers)),
                "ln_f": nn.LayerNorm(width),
            }
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one parameter, used first and last
        for name, parameter in self.named_parameters():
            if name.endswith(".weight") and parameter.dim() == 2:
                nn.init.normal_(parameter, std=0.02 / (math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.transformer.wte(ids) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each token's prediction of the next one, averaged over every predicted token."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1).to(logits.device))


def make_data(num_samples: int, context: int, vocab: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    bigram = torch.softmax(3 * torch.randn(vocab, vocab, generator=generator), dim=1)  # next-token probabilities
    ids = torch.empty(num_samples, context, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (num_samples,), generator=generator)
    for t in range(1, context):
        ids[:, t] = torch.multinomial(bigram[ids[:, t - 1]], 1, generator=generator).squeeze(1)
    return TensorDataset(ids)


# -----------------------------------------------------------------------------
# The split by hand: the model's forward, rewritten with the cut in it
def forward_on_two_devices(model: GPT, ids: torch.Tensor, cut: int, device1: torch.device) -> torch.Tensor:
    positions = torch.arange(ids.shape[1], device=ids.device)
    x = model.transformer.wte(ids) + model.transformer.wpe(positions)
    for block in model.transformer.h[:cut]:
        x = block(x)
    x = x.to(device1)  # transfer the activation between the devices
    for block in model.transformer.h[cut:]:
        x = block(x)
    tied = model.lm_head.weight.to(device1)  # the embedding lives on device0: a differentiable copy
    return F.linear(model.transformer.ln_f(x), tied)


def main() -> None:
    args = parser.parse_args()
    two_gpus = torch.cuda.device_count() >= 2
    device0 = torch.device("cuda:0" if two_gpus else "cpu")
    device1 = torch.device("cuda:1" if two_gpus else "cpu")
    cut = args.layers // 2 if args.cut is None else args.cut

    # -------------------------------------------------------------------------
    # Data
    train_set = make_data(args.num_samples, args.context, args.vocab, args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size)  # in order

    # -------------------------------------------------------------------------
    # Model, placed by hand
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.context, args.width, args.heads, args.layers).to(device0)
    model.transformer.h[cut:].to(device1)
    model.transformer.ln_f.to(device1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    # -------------------------------------------------------------------------
    # Training
    losses: list[float] = []
    start_time = time.perf_counter()
    for epoch in range(args.epochs):
        for (ids,) in train_loader:
            ids = ids.to(device0)
            optimizer.zero_grad()
            loss = next_token_loss(forward_on_two_devices(model, ids, cut, device1), ids)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        epoch_loss = sum(losses[-len(train_loader) :]) / len(train_loader)
        print(f"epoch {epoch + 1}/{args.epochs}  train_loss {epoch_loss:.5f}")
    train_seconds = time.perf_counter() - start_time

    # -------------------------------------------------------------------------
    # Summary
    run = Table(title="Run")
    run.add_column("quantity")
    run.add_column("value", justify="right")
    run.add_row("optimizer steps", str(len(losses)))
    run.add_row("batch", f"{args.batch_size} sequences of {args.context} tokens (1 process)")
    run.add_row("tokens/s", f"{len(losses) * args.batch_size * args.context / train_seconds:,.0f}")
    run.add_row("train loss (first step / last epoch)", f"{losses[0]:.5f} / {epoch_loss:.5f}")
    run.add_row("devices", f"blocks 0-{cut - 1} on {device0}, blocks {cut}-{args.layers - 1} on {device1}")
    Console().print(run)

    if args.record:
        parameters = [p.detach().cpu() for p in model.parameters()]
        torch.save({"losses": losses, "parameters": parameters, "world_size": 1}, args.record)


if __name__ == "__main__":
    main()
