"""Driving the bucket-size search during ``fit`` (``TunedDDPStrategy(bucket_cap_mb="auto")``).

The search itself (which sizes, which steps measure which, the decision) lives in
:mod:`lightning_mgpu.tuning`; this module connects it to the strategy's lifecycle: it starts
the search when training starts, marks the first batch of each optimizer step, hands each
step's end to the tuner and re-wraps the model in DDP when the tuner asks for another size
(only there: every rank is after the same optimizer step, with no gradient half-accumulated),
and reports the result to the console and to every logger.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.strategies.parts.ddp_model import reducer_named_params
from lightning_mgpu.tuning.tuner import (
    DONE,
    FINAL_STATES,
    RESUMED,
    WAITING,
    BucketTuner,
    LocalComm,
    TorchComm,
    host_clock,
)


class _SizedStrategy(Protocol):
    """What the driver needs of the strategy (``TunedDDPStrategy``'s public side)."""

    @property
    def model(self) -> Any: ...

    @property
    def lightning_module(self) -> Any: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def bucket_cap_mb(self) -> float: ...

    @property
    def bucket_layout(self) -> Any: ...


class AutoBucketDriver:
    """One fit's driver of a :class:`BucketTuner`; ``rewrap(size)`` re-wraps the model with a new size."""

    def __init__(self, tuner: BucketTuner, *, owner: str, rewrap: Callable[[float], None]) -> None:
        self.tuner = tuner
        self.owner = owner
        self._rewrap = rewrap

    def on_train_start(self, strategy: _SizedStrategy) -> None:
        tuner = self.tuner
        if tuner.status != WAITING:
            if tuner.status == RESUMED:
                rank_zero_info(f"{self.owner}: {tuner.summary()}")
            return
        module = strategy.lightning_module
        assert module is not None
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        tuner.comm = TorchComm(strategy.root_device) if distributed else LocalComm()
        tuner.clock = host_clock(strategy.root_device)
        model = strategy.model
        if not isinstance(model, DistributedDataParallel):
            tuner.skip(f"the model is wrapped in {type(model).__name__}, not DistributedDataParallel")
        elif not module.automatic_optimization:
            tuner.skip("manual optimization: the strategy cannot tell where an optimizer step ends")
        else:
            tuner.begin(
                [param for _, param in reducer_named_params(model)], remaining_steps=_steps_left(module.trainer)
            )
        if tuner.status in FINAL_STATES:
            rank_zero_info(f"{self.owner}: {tuner.summary()}")

    def at_step_start(self) -> None:
        """The first batch of an optimizer step (of its accumulation window) starts."""
        if self.tuner.active:
            self.tuner.window_start()

    def after_optimizer_step(self, strategy: _SizedStrategy) -> None:
        tuner = self.tuner
        if not tuner.active:
            return
        # Every rank is here after the same step, with no gradient half-accumulated:
        # the one place where the layout may change.
        size = tuner.step_end(lambda: _built_bucket_bytes(strategy))
        if size is not None:
            self._rewrap(size)
        if not tuner.active:
            self._report(strategy)

    def _report(self, strategy: _SizedStrategy) -> None:
        tuner = self.tuner
        rank_zero_info(f"{self.owner}: {tuner.summary()}")
        module = strategy.lightning_module
        if tuner.status != DONE or module is None or not strategy.is_global_zero:
            return
        metrics: dict[str, float] = {"tuning/bucket_cap_mb": strategy.bucket_cap_mb}
        index = tuner.chosen_index
        if index is not None:
            metrics["tuning/step_ms"] = tuner.results[index].step_ms
            default = next((r for r in tuner.results if r.candidate.is_default), None)
            if default is not None:
                metrics["tuning/default_step_ms"] = default.step_ms
        if tuner.gain is not None:
            metrics["tuning/gain_vs_default"] = tuner.gain
        for logger in module.trainer.loggers:
            logger.log_metrics(metrics, step=module.trainer.global_step)

    def teardown(self) -> None:
        tuner = self.tuner
        if tuner.active:  # the fit ended (or failed) before the search did
            tuner.abandon(f"the fit ended after {tuner.steps_taken} tuning step(s)")
            rank_zero_info(f"{self.owner}: {tuner.summary()}")


def _steps_left(trainer: Any) -> Optional[float]:
    """Optimizer steps this fit still has to run (None: unknown, e.g. an endless loader)."""
    try:
        total = float(trainer.estimated_stepping_batches)
    except Exception:  # Lightning cannot tell (no length, no max_steps): assume a long run
        return None
    return None if math.isinf(total) else total - trainer.global_step


def _built_bucket_bytes(strategy: _SizedStrategy) -> Optional[tuple[int, ...]]:
    layout = strategy.bucket_layout
    return None if layout is None else tuple(b.bytes for b in layout)
