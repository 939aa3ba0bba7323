"""The models and data the benchmarks train, built the same way in every process and every benchmark.

Two benchmarks that say "the 8M MLP, batch 64" measure the same thing:

* :func:`make_mlp` / :func:`make_data`: the 8M-parameter MLP (:data:`MLP_WIDTHS`) and a
  synthetic regression set, both from fixed seeds, in-process (no downloads);
* :func:`build`: the three models of different shape the communication benchmarks
  (``buckets``, ``netlab --sweep``, ``whatif``) train: ``mlp`` (the 8M MLP), ``cnn`` (VGG-style)
  and ``char_lm`` (``recipes/char_lm``'s transformer), each with its data and loss;
* :func:`fit`: one of them trained by a strategy on a launch's ranks, every step timed;
* :func:`load_recipe`: a recipe's script as a module, so benchmarks use its classes rather
  than copies.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from bench import REPO_ROOT

MLP_WIDTHS: tuple[int, ...] = (1024, 2048, 2048, 1024, 256)
"""Layer widths of "the 8M MLP": 8,656,128 parameters, 33 MiB of fp32 gradients.

The narrow last layer (256 x 1024 weights, exactly 1 MiB) fills DDP's 1 MiB first
bucket on its own, so the default layout is a real "small first bucket, then 25 MiB"
one rather than a first bucket swallowed by a wide layer.
"""
MODEL_SEED = 0
DATA_SEED = 1234
MODELS = ("mlp", "cnn", "char_lm")
BATCH = {"mlp": 64, "cnn": 16, "char_lm": 2}
"""Per-rank batch of each of :data:`MODELS`."""
SEED = 0

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_mlp(widths: Sequence[int] = MLP_WIDTHS, *, seed: int = MODEL_SEED) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them (no dropout: nothing draws random numbers)."""
    if len(widths) < 2:
        raise ValueError(f"widths needs an input and an output width at least, got {tuple(widths)}")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # same initial weights in every process and every benchmark
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        if index:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    torch.random.set_rng_state(generator_state)
    return nn.Sequential(*layers)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def make_data(num_samples: int, widths: Sequence[int] = MLP_WIDTHS, *, seed: int = DATA_SEED) -> TensorDataset:
    """Inputs ~ N(0, 1) and targets from a fixed random teacher, so the loss can actually go down.

    Built with a private generator: making the data never moves torch's global RNG.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, widths[0], generator=generator)
    teacher = torch.randn(widths[0], widths[-1], generator=generator) / math.sqrt(widths[0])
    targets = torch.tanh(inputs @ teacher)
    return TensorDataset(inputs, targets)


def make_cnn(num_classes: int = 10) -> nn.Module:
    """VGG-style: 3x3 convolutions 3 -> 32 -> 128 -> 256 -> 512 -> 512 on 16x16 inputs, then 2048 -> 1024 -> 10."""

    def conv(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1), nn.ReLU()]

    return nn.Sequential(
        *conv(3, 32), nn.MaxPool2d(2),  # 8x8
        *conv(32, 128), nn.MaxPool2d(2),  # 4x4
        *conv(128, 256), *conv(256, 512), nn.MaxPool2d(2),  # 2x2
        *conv(512, 512),
        nn.Flatten(), nn.Linear(512 * 2 * 2, 1024), nn.ReLU(), nn.Linear(1024, num_classes),
    )  # fmt: skip  # one resolution per line, its size beside it


def build(model_name: str) -> tuple[nn.Module, TensorDataset, Loss]:
    """One of :data:`MODELS` (same weights in every process), a data set of 32 batches, the loss.

    ``mlp``: four Linear layers, the largest 16 MiB; ``cnn``: conv kernels from 3 KiB to 9 MiB and
    an 8 MiB FC; ``char_lm``: recipes/char_lm's CharTransformer, width 256, 4 blocks: many small
    tensors (LayerNorms, biases) between 0.25-1 MiB matrices.
    """
    generator = torch.Generator().manual_seed(SEED + 1)
    torch.manual_seed(SEED)
    batches = 32 * BATCH[model_name] if model_name in BATCH else 0
    if model_name == "mlp":
        return make_mlp(), make_data(batches), nn.functional.mse_loss
    if model_name == "cnn":
        images = torch.randn(batches, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 10, (batches,), generator=generator)
        return make_cnn(), TensorDataset(images, labels), nn.functional.cross_entropy
    if model_name == "char_lm":
        recipe = load_recipe("char_lm")  # its model and data classes, not copies
        text, vocab = recipe.load_corpus(REPO_ROOT / "recipes" / "char_lm" / "data" / "corpus.txt", None)
        ids = {c: i for i, c in enumerate(vocab)}
        windows = recipe.CharWindows(torch.tensor([ids[c] for c in text]), 64, 8)
        inputs, targets = zip(*(windows[i] for i in range(batches)))
        model = recipe.CharTransformer(len(vocab), block_size=64, width=256, layers=4, heads=4)
        return model, TensorDataset(torch.stack(inputs), torch.stack(targets)), recipe.next_char_loss
    raise ValueError(f"unknown model {model_name!r}; choose from {MODELS}")


@dataclass(frozen=True)
class Fit:
    """A finished :func:`fit`: the Trainer and module, the model with its data and loss, each step's time."""

    trainer: Any
    module: Any
    model: nn.Module
    data: TensorDataset
    loss_fn: Loss
    step_ms: list[float]


def fit(model_name: str, strategy: Any, steps: int, *, callbacks: Sequence[Any] = (), accelerator: str = "cpu") -> Fit:
    """Train :func:`build`'s ``model_name`` for ``steps`` steps with ``strategy`` (:data:`BATCH` per rank, SGD) on
    this launch's ranks; each step timed by the host clock, from the first ``on_train_batch_start`` to the first
    ``on_train_batch_end`` callback (the span ``CommProfiler`` calls a step); ``callbacks`` attached after the clock."""
    from torch.utils.data import DataLoader

    from bench.harness import worker

    model, data, loss_fn = build(model_name)
    timer = worker.StepTimer()
    clock = worker.time_each_step(timer)
    trainer = worker.trainer(
        strategy, max_steps=steps, callbacks=[clock, *callbacks], accelerator=accelerator, max_epochs=-1
    )
    module = worker.regression(model, loss_fn)
    trainer.fit(module, DataLoader(data, batch_size=BATCH[model_name]))
    return Fit(trainer, module, model, data, loss_fn, timer.step_ms())


def load_recipe(name: str, script: str = "train_lightning.py") -> ModuleType:
    """``recipes/<name>/<script>`` as a module, so benchmarks use its classes rather than copies."""
    path = REPO_ROOT / "recipes" / name / script
    if not path.is_file():
        known = sorted(entry.name for entry in path.parents[1].iterdir() if (entry / script).is_file())
        raise FileNotFoundError(f"no recipe {name!r}: {path} does not exist; the recipes with {script} are {known}")
    spec = importlib.util.spec_from_file_location(f"_recipe_{name}_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
