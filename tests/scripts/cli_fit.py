"""A LightningCLI ``fit`` from a YAML config, as a user would run it, on the ranks the config asks for.

    python -m tests.scripts.cli_fit CONFIG.yaml OUT_PREFIX

The model (``CliNet``: ``embed`` -> ``body`` -> ``head``, the shape ``hybrid`` splits) makes its
own data. ``Report``, itself a callback named in the YAML, notes what ran during the fit; after
``fit`` returns (teardown done) each rank writes ``OUT_PREFIX.rank{N}.json``: the strategy and
callbacks the YAML built, what the profiler and the doctor produced, ``GLOO_SOCKET_IFNAME`` when
the process group was made, during the fit and after it, and the environment variables the run
left in ``os.environ``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.scripts.models import StagedNet

SEEN: dict[str, Any] = {}


class CliNet(StagedNet):
    """A small staged net with its own data (Lightning shards it with its distributed sampler)."""

    def __init__(self, width: int = 16, batch_size: int = 8) -> None:
        super().__init__(width=width, blocks=4, out_features=1, embed_activation="tanh", example_batch=batch_size)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(256, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1] * x[:, 1:2]), batch_size=self.batch_size)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


class Report(L.Callback):
    """Notes, on each rank, what the YAML built and what ran (read back after fit)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        SEEN["strategy"] = type(trainer.strategy).__name__
        SEEN["callbacks"] = [type(c).__name__ for c in trainer.callbacks]
        SEEN["world_size"] = trainer.world_size
        SEEN["gloo_interface_during_fit"] = os.environ.get("GLOO_SOCKET_IFNAME")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        SEEN["global_step"] = trainer.global_step
        for callback in trainer.callbacks:
            name = type(callback).__name__
            if name == "CommProfiler":
                SEEN["profiler_summary"] = callback.summary  # type: ignore[attr-defined]
            if name == "DistributedDoctor":
                SEEN["doctor_checks"] = callback.checks  # type: ignore[attr-defined]
                SEEN["doctor_findings"] = [f.rule for f in callback.findings]  # type: ignore[attr-defined]
        SEEN["logged"] = sorted(trainer.logged_metrics)


def main() -> None:
    config, prefix = sys.argv[1], sys.argv[2]
    # Run as __main__, the YAML's `tests.scripts.cli_fit.Report` is this file imported again by that name.
    from tests.scripts.cli_fit import SEEN

    real_init = torch.distributed.init_process_group

    def watched_init(*args: Any, **kwargs: Any) -> Any:
        SEEN["gloo_interface_at_init"] = os.environ.get("GLOO_SOCKET_IFNAME")  # what gloo reads for the group
        return real_init(*args, **kwargs)

    torch.distributed.init_process_group = watched_init  # Lightning looks it up at the call
    before = set(os.environ)
    LightningCLI(CliNet, args=["fit", "--config", config], save_config_kwargs={"overwrite": True})
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    SEEN["added_environment"] = sorted(set(os.environ) - before)
    SEEN["gloo_interface_after_fit"] = os.environ.get("GLOO_SOCKET_IFNAME")
    with open(f"{prefix}.rank{rank}.json", "w") as fh:
        json.dump(SEEN, fh, default=str)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
