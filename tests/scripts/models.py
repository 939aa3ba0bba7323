"""The small models the test scripts train, defined once.

Two shapes cover every script: an MLP regressor (``fit_tiny``, ``fit_profiled``, ``tune_fit``,
``tune_target``) and a three-part net, ``embed`` -> ``body`` -> ``head``, whose ``body`` is
the ``nn.Sequential`` that ``hybrid`` splits (``fit_hybrid``, ``fail_fit``). Each builder
creates its layers in a fixed order, so under the same seed the same parameters come out:
the figures the tests compare depend on it. Imported as ``tests.scripts.models`` (the
repository root is on ``PYTHONPATH`` in every child the tests start).
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

__all__ = ["MLPRegressor", "StagedNet", "mlp", "position_generator"]


def mlp(
    *,
    in_features: int,
    width: int,
    depth: int,
    out_features: int,
    activation: type[nn.Module] = nn.Tanh,
    hidden_first: bool = False,
) -> nn.Sequential:
    """``in_features -> width``, ``depth`` hidden ``width x width`` layers, ``-> out_features``.

    Every layer but the last is followed by ``activation``; indices are the same either way
    (``net[0]`` the input layer, ``net[2]`` the first hidden one). ``hidden_first`` creates
    the hidden layers before the input layer: ``fit_tiny``'s order since its first version,
    kept so that its seeded parameters (and every figure recorded from them) stay the same.
    """
    if min(in_features, width, out_features) < 1 or depth < 0:
        raise ValueError(
            f"mlp: sizes must be >= 1 and depth >= 0, got in_features={in_features}, width={width}, "
            f"depth={depth}, out_features={out_features}"
        )

    def hidden() -> list[nn.Module]:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), activation()]
        return layers

    if hidden_first:
        middle = hidden()
        first = nn.Linear(in_features, width)
    else:
        first = nn.Linear(in_features, width)
        middle = hidden()
    return nn.Sequential(first, activation(), *middle, nn.Linear(width, out_features))


class MLPRegressor(L.LightningModule):
    """``self.net = mlp(...)`` trained with MSE on ``(x, y)`` batches and SGD.

    With ``record_losses`` every loss is kept in ``losses`` (``loss.item()``: a device sync each
    step, left out where a script measures step times).
    """

    def __init__(
        self,
        *,
        in_features: int = 32,
        width: int,
        depth: int,
        out_features: int = 1,
        activation: type[nn.Module] = nn.Tanh,
        hidden_first: bool = False,
        lr: float,
        momentum: float = 0.0,
        record_losses: bool = True,
    ) -> None:
        super().__init__()
        self.net = mlp(
            in_features=in_features,
            width=width,
            depth=depth,
            out_features=out_features,
            activation=activation,
            hidden_first=hidden_first,
        )
        self.lr, self.momentum, self.record_losses = lr, momentum, record_losses
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        # self.net, not self(x): no LightningModule forward hooks run, as in the scripts' first versions
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.record_losses:
            self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class StagedNet(L.LightningModule):
    """``embed`` -> ``body`` (``blocks`` x Linear+Tanh, what ``hybrid`` splits) -> ``head``, trained with Adam.

    Layers before and after the split module test that ``hybrid`` places them too; Adam's
    per-parameter state must follow each parameter's device. ``example_input_array`` (drawn
    after the layers, from the global generator) is what ``balance="time"`` profiles with.
    Subclasses supply ``training_step`` and the data.
    """

    def __init__(
        self,
        *,
        in_features: int = 8,
        width: int,
        blocks: int,
        out_features: int,
        embed_activation: str,
        example_batch: int,
        lr: float = 1e-2,
    ) -> None:
        super().__init__()
        if embed_activation not in ("relu", "tanh"):
            raise ValueError(f"StagedNet: embed_activation must be 'relu' or 'tanh', got {embed_activation!r}")
        self.embed = nn.Linear(in_features, width)
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)))
        self.head = nn.Linear(width, out_features)
        # a name, not a module: no extra child for hybrid to place (and a plain string pickles under spawn)
        self.embed_activation = embed_activation
        self.lr = lr
        self.losses: list[float] = []
        self.example_input_array = torch.randn(example_batch, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(x)
        embedded = torch.relu(embedded) if self.embed_activation == "relu" else torch.tanh(embedded)
        return self.head(self.body(embedded))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def position_generator(seen: int, rank: int) -> torch.Generator:
    """A generator seeded by the global batch count and the rank, not by the data loader's position.

    A resumed fit then draws exactly the batches the uninterrupted one drew, whatever the
    loader does on restart.
    """
    return torch.Generator().manual_seed(1_000_003 * seen + 101 * rank)
