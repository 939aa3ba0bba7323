"""Run each of our communication hooks, then destroy the process group at once, many times over.

gloo runs a hook's ``then`` callback on its worker thread and frees the callback there. A callback
that held the group's last reference (the group destroyed right after the step) made the group
join that thread from inside it: ``std::system_error: Resource deadlock avoided``, and the process
aborted. This script exits 0 when none of our hooks keeps the group alive from a callback, and when
torch's powerSGD_hook (which does) runs with the groups kept until the end, as the test fixtures do:

    python -m tests.scripts.group_teardown --rounds 300
"""

from __future__ import annotations

import argparse
import gc
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.comm.compression import PrescaledAllreduce, ScaledFp16Allreduce, bf16_allreduce_hook


class Bucket:
    """What a communication hook reads from DDP's GradBucket (tests/unit/comm/test_fp16_safety.py uses it too)."""

    def __init__(
        self, values: torch.Tensor, *, index: int = 0, parameters: Optional[list[torch.Tensor]] = None
    ) -> None:
        self._values = values
        self._buffer = values.clone()  # a hook scales its bucket in place: the caller's tensor stays as it was
        self._index = index
        self._parameters = list(parameters or [])

    def fresh(self) -> "Bucket":
        """The same bucket with its original values again (the next step's gradients)."""
        return Bucket(self._values, index=self._index, parameters=self._parameters)

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)


def _outside_backward(hook: Callable[..., Any]) -> None:
    hook(None, Bucket(torch.linspace(-3.0, 5.0, 64))).wait()


def _in_ddp_backward(hook: Any) -> None:
    """Two DDP steps (the second one carries the first one's scale), then DDP is dropped."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    model.register_comm_hook(None, hook)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        model(torch.randn(8, 16)).square().mean().mul(1e3 if step else 1.0).backward()  # a jump: float32 fallback
    del model


def _torch_powersgd() -> None:
    """torch's own powerSGD_hook captures the group in its callbacks: safe only with the group freed later."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(torch.randn(8, 16)).sum().backward()
    del model, state


# name: (case, its share of --rounds): a DDP round costs ~5x a bare hook's
CASES: dict[str, tuple[Callable[[], None], float]] = {
    "fp16 outside backward": (lambda: _outside_backward(ScaledFp16Allreduce()), 1.0),
    "fp16 in a DDP backward": (lambda: _in_ddp_backward(ScaledFp16Allreduce()), 0.2),
    "bf16": (lambda: _outside_backward(bf16_allreduce_hook), 1.0),
    "prescaled": (lambda: _outside_backward(PrescaledAllreduce(world_size=1)), 1.0),
}
# Groups kept until the end, then freed after a garbage collection, as tests/conftest.py's destroy_default_group does
RETIRED = {"torch powerSGD_hook, groups kept until the end": (_torch_powersgd, 0.2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    retired: list[Any] = []
    for name, (case, share) in [*CASES.items(), *RETIRED.items()]:
        rounds = max(1, round(args.rounds * share))
        for _ in range(rounds):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
            case()
            if name in RETIRED:
                retired.append(dist.group.WORLD)
            dist.destroy_process_group()  # nothing but the hook's callbacks may still hold the group now
        print(f"{name}: {rounds} rounds", flush=True)
    gc.collect()
    retired.clear()
    gc.collect()
    print("retired groups freed", flush=True)


if __name__ == "__main__":
    main()
