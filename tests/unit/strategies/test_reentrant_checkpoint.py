"""Reentrant activation checkpointing under DDP: torch's raw error becomes one that names the fixes that work.

``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` with ``find_unused_parameters=True``
fails in the first backward with DDP's "Expected to mark a variable ready only once ... try to
use _set_static_graph()" (a private torch method). Our strategies' ``backward`` raises
``ReentrantCheckpointError`` from it, naming ``TunedDDPStrategy(static_graph=True)`` and
``use_reentrant=False``; ``on_exception`` appends the same to the raw error when it was raised
outside the strategy's backward. The 2-rank launch (``tests/scripts/reentrant_fit.py``) that shows the
error on both ranks, and that both fixes train exactly as the baseline:
tests/dist/strategies/test_reentrant_checkpoint.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from lightning_mgpu import HybridParallelStrategy, TunedDDPStrategy
from lightning_mgpu.strategies.parts.failures import READY_TWICE, ReentrantCheckpointError


class _Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool, twice: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_reentrant, self.twice = use_reentrant, twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint(self.b, self.a(x), use_reentrant=self.use_reentrant)
        if self.twice:  # the same parameters in a second checkpointed segment
            hidden = checkpoint(self.b, hidden, use_reentrant=self.use_reentrant)
        return hidden.sum()


def _facts(strategy: Any) -> dict[str, Any]:
    return strategy._ddp_facts()  # type: ignore[no-any-return]


def test_torchs_own_error_becomes_one_naming_both_fixes(one_rank_group: None) -> None:
    """A real one-rank DDP raises torch's error; the strategy's wrapper re-raises it explained, chained."""
    ddp = DistributedDataParallel(_Checkpointed(use_reentrant=True), find_unused_parameters=True)
    strategy = TunedDDPStrategy(find_unused_parameters=True)
    with pytest.raises(ReentrantCheckpointError) as raised:
        with strategy.backward_errors_explained():
            ddp(torch.randn(2, 4)).backward()
    message = str(raised.value)
    assert isinstance(raised.value.__cause__, RuntimeError) and str(raised.value.__cause__).startswith(READY_TWICE)
    assert "TunedDDPStrategy(static_graph=True, ...)" in message
    assert "checkpoint(..., use_reentrant=False)" in message
    assert "find_unused_parameters=True" in message
    assert "_set_static_graph" not in message  # torch's private name stays in torch's message only


def test_both_fixes_run_in_process(one_rank_group: None) -> None:
    for module, kwargs in (
        (_Checkpointed(use_reentrant=True), {"find_unused_parameters": True, "static_graph": True}),
        (_Checkpointed(use_reentrant=False), {"find_unused_parameters": True}),
    ):
        ddp = DistributedDataParallel(module, **kwargs)
        for _ in range(2):
            ddp(torch.randn(2, 4)).backward()


def test_the_hybrid_strategy_names_only_the_fix_it_accepts(one_rank_group: None) -> None:
    """hybrid refuses static_graph=True (and find_unused_parameters=True): a layer checkpointed twice raises the
    same error; the one fix offered is non-reentrant checkpointing."""
    ddp = DistributedDataParallel(_Checkpointed(use_reentrant=True, twice=True))
    strategy = HybridParallelStrategy(devices_per_replica=2)
    with pytest.raises(ReentrantCheckpointError) as raised:
        with strategy.backward_errors_explained():
            ddp(torch.randn(2, 4)).backward()
    message = str(raised.value)
    assert "HybridParallelStrategy does not accept static_graph=True; the fix: non-reentrant" in message
    assert "two checkpointed segments" in message and "Either fix" not in message


def test_with_static_graph_on_already_only_the_other_fix_is_offered() -> None:
    strategy = TunedDDPStrategy(static_graph=True)
    with pytest.raises(ReentrantCheckpointError, match=r"static_graph=True is on already; the fix: non-reentrant"):
        with strategy.backward_errors_explained():
            raise RuntimeError(f"{READY_TWICE}. This error is caused by ...")


def test_other_errors_pass_through_untouched() -> None:
    strategy = TunedDDPStrategy()
    error = RuntimeError("CUDA out of memory")
    with pytest.raises(RuntimeError) as raised:
        with strategy.backward_errors_explained():
            raise error
    assert raised.value is error
    strategy.on_exception(error)
    assert str(error) == "CUDA out of memory"


def test_on_exception_explains_the_raw_error_raised_outside_the_strategys_backward() -> None:
    """``loss.backward()`` called directly (manual optimization) bypasses the strategy's backward."""
    strategy = TunedDDPStrategy(find_unused_parameters=True)
    error = RuntimeError(f"{READY_TWICE}. This error is caused by ...")
    strategy.on_exception(error)
    text = str(error)
    assert text.startswith(READY_TWICE)
    assert "TunedDDPStrategy(static_graph=True, ...)" in text and "use_reentrant=False" in text
    strategy.on_exception(error)
    assert str(error) == text  # explained once
    assert _facts(strategy)["find_unused_parameters"] is True
