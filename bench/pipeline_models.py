"""The two models ``bench.pipeline`` splits, built the same way in every process: how each is cut and trained.

* ``mlp``: ``depth`` x (``nn.Linear(width, width)`` + GELU), an ``nn.Sequential``; the loss
  is the output's sum (no target).
* ``gpt``: the GPT-2-style model of ``recipes/model_split/train_gpt_plain.py`` (GPT-2's
  architecture and attribute names, tied embeddings), the next-token cross-entropy as its
  loss. Ours cuts the unmodified model at a split point (the block where the plan's
  second stage begins); torch's pipelining gets the same two halves as stage modules
  (:func:`torch_stage`), where, as torch's pipelining does, the tied weight is a separate
  copy in each stage's process.

A :class:`BenchModel` carries the model, the batch, the loss and the pieces each engine
needs, so the in-process engines and the torch-pipelining worker
(:mod:`bench.pipeline_torch`) run the same model, batch and loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from bench.models import load_recipe

MODELS = ("mlp", "gpt")


@dataclass
class BenchModel:
    """One benchmark model: the module, one batch, and how the engines cut and train it."""

    name: str
    model: nn.Module
    batch: torch.Tensor  # the input (and, for the GPT, the target too)
    loss_reduction: str  # "sum" (mlp) or "mean" (gpt): how the micro-batch losses make the batch's
    description: str

    def loss(self, output: torch.Tensor, target: Optional[torch.Tensor]) -> torch.Tensor:
        if self.name == "mlp":
            return output.sum()
        assert target is not None
        return next_token_loss(output, target)

    def step_fn(self) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
        """``fn(model, batch) -> loss``: what the staged pipeline runs per micro-batch (and the unsplit model per step)."""
        return lambda net, batch: self.loss(net(batch), batch)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def make_mlp(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def gpt_module() -> Any:
    """``recipes/model_split/train_gpt_plain.py`` as a module (its ``GPT`` class, not a copy)."""
    return load_recipe("model_split", "train_gpt_plain.py")


def build(name: str, settings: dict[str, int], *, seed: int = 0) -> BenchModel:
    """The model ``name`` (see :data:`MODELS`) with ``settings`` (the parsed ``--mlp-*`` / ``--gpt-*`` flags)."""
    if name == "mlp":
        width, depth, batch = settings["width"], settings["depth"], settings["batch"]
        model = make_mlp(width, depth, seed)
        generator = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(batch, width, generator=generator)
        text = f"{depth} x (Linear {width} + GELU), batch {batch}, loss = sum of the output"
        return BenchModel("mlp", model, x, "sum", text)
    if name == "gpt":
        recipe = gpt_module()
        vocab, context, width, layers, batch = (
            settings["vocab"],
            settings["context"],
            settings["width"],
            settings["depth"],
            settings["batch"],
        )
        torch.manual_seed(seed)
        model = recipe.GPT(vocab, context, width, settings["heads"], layers)
        generator = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(0, vocab, (batch, context), generator=generator)
        text = (
            f"GPT-2-style, {layers} blocks of width {width}, {settings['heads']} heads, vocab {vocab}, tied embeddings, "
            f"batch {batch} x {context} tokens, next-token cross-entropy"
        )
        return BenchModel("gpt", model, ids, "mean", text)
    raise ValueError(f"unknown model {name!r}: one of {MODELS}")


class _GPTFirstHalf(nn.Module):
    def __init__(self, model: nn.Module, cut: int) -> None:
        super().__init__()
        self.wte, self.wpe = model.transformer.wte, model.transformer.wpe
        self.h = nn.ModuleList(model.transformer.h[:cut])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return x


class _GPTSecondHalf(nn.Module):
    def __init__(self, model: nn.Module, cut: int) -> None:
        super().__init__()
        self.h = nn.ModuleList(model.transformer.h[cut:])
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def torch_stage(bench: BenchModel, stage: int, sizes: list[int]) -> nn.Module:
    """Stage ``stage`` of 2 as a module of its own, for ``torch.distributed.pipelining.PipelineStage``, cut
    where ours is by the plan's ``sizes``: the MLP's layers, the GPT's blocks (embeddings with the first,
    the final norm and the tied output layer with the second)."""
    if bench.name == "mlp":
        start = sum(sizes[:stage])
        return bench.model[start : start + sizes[stage]]  # type: ignore[index]
    cut = sizes[0]
    return _GPTFirstHalf(bench.model, cut) if stage == 0 else _GPTSecondHalf(bench.model, cut)
