"""One path of ``lightning-mgpu doctor --selftest`` (each path in a fresh process).

    python -m lightning_mgpu.cli.workers.selftest PATH OUT.json [--device cuda|cpu]

Started once per path by :mod:`lightning_mgpu.cli._selftest`.

Paths (:data:`PATHS`): a short ``fit`` or a pipeline step that exercises one CUDA code path of
the package and checks its result, not only that it ran. Rank 0 writes ``OUT.json``:
``{"path", "seconds", "facts"}``; a failed check raises (the exit code and the traceback
are the failure). ``--device cpu`` runs the same code on CPU stand-ins (gloo, ``bf16-mixed``,
CPU stages): how this project's tests check the self-test itself on machines without a GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from typing import Any, Callable, Optional

PATHS: dict[str, str] = {
    "nccl-ddp": "ddp_tuned over NCCL, one rank per GPU: a short fit, parameters equal on every rank",
    "cuda-profiling": "CommProfiler with CUDA events: buckets timed on the device",
    "amp": "16-bit mixed precision with ddp_tuned, no compression",
    "amp-fp16": "16-bit mixed precision with compression='fp16'",
    "amp-bf16": "bf16 mixed precision with compression='bf16'",
    "amp-powersgd": "16-bit mixed precision with compression='powersgd' (compressing from step 2)",
    "hybrid-cuda-cpu": "a pipeline across cuda:0 and the CPU, gradients equal to one device's",
    "hybrid-gpus": "strategy='hybrid' across 2 GPUs in one process: a short fit",
    "copy-streams": "the pipeline's copy streams: boundary tensors moved between devices, results exact",
}
"""Path name -> what it exercises (the order ``doctor --selftest`` runs them in)."""
MIN_GPUS = {"hybrid-gpus": 2}
"""Paths that need more than one GPU; the others run on one."""

STEPS = 8


def _module() -> Any:
    import lightning as L
    import torch
    from torch import nn

    class SelfTestNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
            self.losses: list[float] = []
            self.example_input_array = torch.randn(8, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.body(x)
            return out

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x).float(), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64 * STEPS, 32, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].sin()), batch_size=16)

    return SelfTestNet()


def _fit(
    device: str,
    *,
    strategy: Any,
    precision: str = "32-true",
    callbacks: Optional[list[Any]] = None,
    devices: Optional[int] = None,
) -> tuple[Any, Any]:
    """A short fit of the self-test's module; ``devices``: every GPU there is (2 CPU processes) unless given."""
    import lightning as L
    import torch

    L.seed_everything(0, verbose=False)
    if devices is None:
        devices = torch.cuda.device_count() if device == "cuda" else 2
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
        max_steps=STEPS,
        callbacks=callbacks or [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = _module()
    trainer.fit(model)
    if not model.losses or not all(math.isfinite(v) for v in model.losses):
        raise AssertionError(f"losses not finite: {model.losses}")
    return trainer, model


def _same_on_every_rank(trainer: Any, model: Any) -> dict[str, Any]:
    import torch

    # After fit, Lightning's teardown has moved the module back to the CPU; NCCL gathers only CUDA tensors.
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()]).to(trainer.strategy.root_device)
    gathered = trainer.strategy.all_gather(flat)
    rows = gathered if gathered.dim() == 2 else gathered.unsqueeze(0)
    if not all(torch.equal(rows[0], row) for row in rows):
        raise AssertionError("parameters differ between ranks after the fit")
    return {"ranks": int(rows.shape[0]), "backend": str(torch.distributed.get_backend()), "steps": trainer.global_step}


def path_ddp(device: str) -> dict[str, Any]:
    from lightning_mgpu import TunedDDPStrategy

    trainer, model = _fit(device, strategy=TunedDDPStrategy())
    return _same_on_every_rank(trainer, model)


def path_profiling(device: str) -> dict[str, Any]:
    from lightning_mgpu import CommProfiler, TunedDDPStrategy

    profiler = CommProfiler(warmup_steps=1, every_n_steps=2, profile_every=None)
    trainer, _ = _fit(device, strategy=TunedDDPStrategy(), callbacks=[profiler])
    summary = profiler.summary
    if summary is None or not summary["measures_comm"] or not summary["comm_ms"] or summary["comm_ms"] <= 0:
        raise AssertionError(f"no bucket was timed: {summary}")
    return {"comm_ms": summary["comm_ms"], "steps": summary["steps"], "device_type": trainer.strategy.root_device.type}


def _amp(compression: Optional[str]) -> Callable[[str], dict[str, Any]]:
    def run(device: str) -> dict[str, Any]:
        from lightning_mgpu import TunedDDPStrategy

        options: dict[str, Any] = {"compression": compression}
        if compression == "powersgd":
            options["powersgd_start_iter"] = 2
        precision = "bf16-mixed" if compression == "bf16" or device != "cuda" else "16-mixed"
        trainer, model = _fit(device, strategy=TunedDDPStrategy(**options), precision=precision)
        facts = _same_on_every_rank(trainer, model)
        facts.update(precision=precision, final_loss=model.losses[-1])
        if compression == "fp16":
            facts.update(_fp16_hook_values(trainer.strategy.root_device))
        return facts

    return run


class _Bucket:
    """What the fp16 hook reads of DDP's GradBucket: its flat buffer (on the device) and its parameters."""

    def __init__(self, values: Any) -> None:
        self._buffer = values.clone()

    def buffer(self) -> Any:
        return self._buffer

    def parameters(self) -> list[Any]:
        return []

    def index(self) -> int:
        return 0


def _fp16_hook_values(device: Any) -> dict[str, Any]:
    """``compression="fp16"``'s hook on buckets of this device (the group the fit left up): gradients far above and
    below float16's range come back to float16's precision, inf/NaN come back as they were and are reported."""
    import torch

    from lightning_mgpu.comm.compression import ScaledFp16Allreduce

    hook = ScaledFp16Allreduce()
    world = torch.distributed.get_world_size()
    worst = 0.0
    for values in ([1.0e5, -3.0e5, 0.0, 1.0], [2.5e-9, -7.0e-10, 1.0e-12]):
        want = torch.tensor(values, dtype=torch.float32)
        got = hook(None, _Bucket(want.to(device))).wait().cpu()  # type: ignore[arg-type]
        worst = max(worst, float(((got - want).abs() / want.abs().clamp_min(1e-30)).max()))
    if worst > 2**-11:
        raise AssertionError(f"fp16 hook: a gradient came back off by {worst:.3g} (float16 keeps 2**-11)")
    if hook.end_step() is not None:
        raise AssertionError("fp16 hook: finite gradients reported as inf/NaN or underflowed")
    got = hook(None, _Bucket(torch.tensor([1.0, float("nan"), float("inf")], device=device))).wait().cpu()  # type: ignore[arg-type]
    if not (got[0] == 1.0 and bool(got[1].isnan()) and float(got[2]) == float("inf") * world):
        raise AssertionError(f"fp16 hook: inf/NaN gradients came back as {got.tolist()}, not as they were")
    message = hook.end_step()
    if message is None or "inf or NaN" not in message:
        raise AssertionError(f"fp16 hook: inf/NaN gradients were not reported ({message!r})")
    return {
        "fp16_hook_worst_relative_error": worst,
        "fp16_hook_path": "exchanged" if device.type == "cuda" else "carried",
    }


def _pipeline_against_one_device(devices: list[str]) -> dict[str, Any]:
    """The same two-stage model and batch on ``devices`` (pipelined, 4 micro-batches) and on one device."""
    import torch
    from torch import nn

    from lightning_mgpu.placement.running.engine import Pipeline

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)).double()
    x, target = torch.randn(16, 32, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    nn.functional.mse_loss(reference(x), target).backward()  # type: ignore[no-untyped-call]
    layers = list(copy.deepcopy(reference))
    split = [nn.Sequential(*layers[:2]).to(devices[0]), nn.Sequential(*layers[2:]).to(devices[1])]
    for stage in split:
        stage.zero_grad(set_to_none=True)  # the copies start without the reference's gradients
    model = nn.Sequential(*split)
    pipeline = Pipeline(model, ["1"], devices, microbatches=4)
    try:
        output = pipeline.forward(model, x.to(devices[0]))  # on the input's device
        nn.functional.mse_loss(output, target.to(devices[0]), reduction="mean").backward()  # type: ignore[no-untyped-call]
        pipeline.backward()  # the stages' backward, micro-batch by micro-batch, gradients accumulated once
    finally:
        pipeline.close()
    worst = 0.0
    stages = (reference[:2], reference[2:])
    for stage, source in zip(split, stages):
        for param, original in zip(stage.parameters(), source.parameters()):
            assert param.grad is not None and original.grad is not None
            worst = max(worst, float((param.grad.cpu() - original.grad).abs().max()))
    if worst > 1e-9:  # float64: a missed stream synchronisation shows as garbage, not as rounding
        raise AssertionError(f"pipelined gradients differ from one device's by {worst:g}")
    return {"devices": devices, "max_grad_difference": worst}


def path_hybrid_cuda_cpu(device: str) -> dict[str, Any]:
    return _pipeline_against_one_device(["cuda:0", "cpu"] if device == "cuda" else ["cpu", "cpu"])


def path_copy_streams(device: str) -> dict[str, Any]:
    import torch

    if device != "cuda":
        return _pipeline_against_one_device(["cpu", "cpu"])
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cuda:0"]
    return _pipeline_against_one_device(devices)


def path_hybrid_gpus(device: str) -> dict[str, Any]:
    from lightning_mgpu import HybridParallelStrategy

    trainer, model = _fit(device, strategy=HybridParallelStrategy(devices_per_replica=2, microbatches=2), devices=2)
    return {"steps": trainer.global_step, "final_loss": model.losses[-1]}


RUNNERS: dict[str, Callable[[str], dict[str, Any]]] = {
    "nccl-ddp": path_ddp,
    "cuda-profiling": path_profiling,
    "amp": _amp(None),
    "amp-fp16": _amp("fp16"),
    "amp-bf16": _amp("bf16"),
    "amp-powersgd": _amp("powersgd"),
    "hybrid-cuda-cpu": path_hybrid_cuda_cpu,
    "hybrid-gpus": path_hybrid_gpus,
    "copy-streams": path_copy_streams,
}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_mgpu.cli.workers.selftest")
    parser.add_argument("path", choices=sorted(RUNNERS))
    parser.add_argument("out")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    facts = RUNNERS[args.path](args.device)
    seconds = time.perf_counter() - started
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"path": args.path, "seconds": seconds, "facts": facts}, fh, default=str)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
