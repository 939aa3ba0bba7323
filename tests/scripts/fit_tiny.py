"""Fit a tiny MLP with a given strategy and report what DDP actually did, as JSON.

Run by the multi-process tests (Lightning's own launcher starts the other ranks):

    python -m tests.scripts.fit_tiny --out result.json --strategy ddp_tuned --devices 2 \
        --strategy-kwargs '{"bucket_cap_mb": 0.05}'

The ``Probe`` callback writes ``--out`` from rank 0 (in the worker, so spawn works too): the comm hook DDP registered, the bucket layout it built, what
the all-reduced gradients look like (cast to fp16/bf16? low rank?), the losses and a
checksum of the final parameters from every rank.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu
from lightning_mgpu import TunedDDPStrategy
from tests.scripts.models import MLPRegressor


class TinyMLP(MLPRegressor):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__(width=width, depth=depth, hidden_first=True, lr=0.05)
        self.grad_checks: list[dict[str, Any]] = []

    def on_after_backward(self) -> None:
        # DDP has finished all-reducing by now: inspect what came back.
        grad = self.net[2].weight.grad
        assert grad is not None
        self.grad_checks.append(
            {
                "fp16_exact": bool(torch.equal(grad, grad.half().float())),
                # float16's 11 significant bits, whatever the exponent (a scaled fp16 hook keeps small values)
                "fp16_precision": bool(
                    torch.equal(torch.frexp(grad)[0], torch.round(torch.frexp(grad)[0] * 2048) / 2048)
                ),
                "bf16_exact": bool(torch.equal(grad, grad.bfloat16().float())),
                "rank": int(torch.linalg.matrix_rank(grad).item()),
            }
        )


class Probe(L.Callback):
    """Writes rank 0's report at the end of fit (in the worker process, so spawn works too)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(pl_module, TinyMLP)
        result: dict[str, Any] = {
            "strategy_class": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "losses": pl_module.losses,
            "grad_checks": pl_module.grad_checks,
            "package": lightning_mgpu.__version__,
            "pid": os.getpid(),
        }
        ddp = trainer.strategy.model
        result["is_ddp"] = isinstance(ddp, DistributedDataParallel)
        if isinstance(ddp, DistributedDataParallel):
            data = ddp._get_ddp_logging_data()
            result["comm_hook"] = data.get("comm_hook")
            result["backend"] = data.get("backend_name")
            result["ddp_flags"] = {
                "static_graph": bool(ddp.static_graph),
                "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
                "find_unused_parameters": bool(ddp.find_unused_parameters),
            }
            rebuilt = data.get("rebuilt_bucket_sizes")  # recorded by DDP from its third step on
            result["ddp_bucket_sizes"] = None if rebuilt is None else [int(v) for v in str(rebuilt).split(",")]
            result["param_ready_order_bytes"] = [
                p.numel() * p.element_size() for p in reversed(list(pl_module.parameters()))
            ]
        if isinstance(trainer.strategy, TunedDDPStrategy):
            layout = trainer.strategy.bucket_layout
            result["bucket_layout"] = None if layout is None else [b.as_dict() for b in layout]
            result["bucket_cap_mb"] = trainer.strategy.bucket_cap_mb
            result["first_bucket_cap_mb"] = trainer.strategy.first_bucket_cap_mb
        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        gathered = trainer.strategy.all_gather(flat)  # every rank enters the collective
        result["params_per_rank"] = [g.tolist() for g in gathered] if gathered.dim() == 2 else [gathered.tolist()]
        if trainer.global_rank == 0:
            with open(self.out, "w") as fh:
                json.dump(result, fh)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="ddp_tuned")
    parser.add_argument("--strategy-kwargs", default="{}", help="JSON; builds TunedDDPStrategy(**kwargs) if given")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=1, help="hidden width x width layers")
    parser.add_argument("--profiler", action="store_true", help="add CommProfiler(warmup_steps=1)")
    parser.add_argument(
        "--profile-schedule", default=None, help="STEPS,EVERY: the profiler's profile_steps, profile_every"
    )
    parser.add_argument("--ckpt", default=None, help="save a checkpoint here after fit")
    parser.add_argument("--stock", action="store_true", help="Lightning's own DDPStrategy(**strategy_kwargs)")
    args = parser.parse_args()

    L.seed_everything(7, verbose=False)
    x = torch.randn(512, 32)
    y = x[:, :1] * 2 + 0.1 * torch.randn(512, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model = TinyMLP(args.width, args.depth)
    kwargs = json.loads(args.strategy_kwargs)
    strategy: Any = args.strategy
    if args.stock:
        strategy = DDPStrategy(**kwargs)
    elif kwargs:
        strategy = TunedDDPStrategy(**kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.callbacks.append(Probe(args.out))
    if args.profiler:
        schedule = {}
        if args.profile_schedule:
            steps, every = (int(v) for v in args.profile_schedule.split(","))
            schedule = {"profile_steps": steps, "profile_every": every}
        trainer.callbacks.append(lightning_mgpu.CommProfiler(warmup_steps=1, every_n_steps=2, **schedule))
    trainer.fit(model, loader)
    if args.ckpt:
        trainer.save_checkpoint(args.ckpt)
    # With --stock (Lightning's own DDPStrategy) nobody destroys the process group before the
    # interpreter finalizes, which can abort a gloo process at exit: do it here.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
