"""Profiling the candidate blocks of an unmodified model (placement/planning/profile.py) and the plan's activation
estimate per schedule (PlacementPlan.peak_activation_bytes). In-process, no threads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mgpu.placement.planning.profile import LayerCost, block_costs, profile_blocks
from lightning_mgpu.placement.planning.plan import PlacementPlan, choose_split_points
from lightning_mgpu.placement.planning.schedule import make_schedule, peak_in_flight
from lightning_mgpu.placement.planning.split_points import candidate_blocks
from lightning_mgpu.placement.runner import block_profiler
from tests.scripts.split_models import ResidualCNN

BLOCKS = [f"blocks.{i}" for i in range(4)]


def test_blocks_of_a_residual_cnn_are_measured_and_the_model_is_left_as_it_was() -> None:
    torch.manual_seed(0)
    model = ResidualCNN()
    x = torch.randn(4, 3, 8, 8)
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    costs = profile_blocks(model, BLOCKS, lambda: model(x), repeats=3, warmup=1)
    assert [c.name for c in costs] == BLOCKS
    assert all(c.forward_ms > 0 and c.backward_ms > 0 for c in costs)
    # identical blocks on identical shapes save identical tensors: conv inputs, BatchNorm's, the in-place ReLUs' outputs
    middle = {c.activation_bytes for c in costs[1:3]}
    assert len(middle) == 1 and middle.pop() >= 4 * 8 * 8 * 8 * 4
    assert costs[0].activation_bytes > costs[1].activation_bytes  # the stem runs in block 0's span
    assert costs[3].activation_bytes > costs[1].activation_bytes  # so do the pooling and the head in block 3's
    want = block_costs(model, BLOCKS)
    assert [c.param_count for c in costs] == [c.param_count for c in want]
    for buffer, before in zip(model.buffers(), stats):
        torch.testing.assert_close(buffer, before, rtol=0, atol=0)  # BatchNorm's running statistics restored
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_a_candidate_that_does_not_run_once_is_refused() -> None:
    model = ResidualCNN()
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match=r"entered 3 of the 4 candidate blocks"):
        profile_blocks(model, BLOCKS, lambda: model.blocks[1:](model.stem(x)), repeats=1, warmup=0)


def _layer(index: int, activation: int) -> LayerCost:
    return LayerCost(
        index=index,
        name=str(index),
        kind="Linear",
        forward_ms=1.0,
        backward_ms=2.0,
        param_count=0,
        param_bytes=0,
        grad_bytes=0,
        optimizer_bytes=0,
        activation_bytes=activation,
        output_bytes=0,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_the_plan_estimates_a_stage_peak_as_one_microbatch_times_the_schedule_in_flight(schedule: str) -> None:
    layers = [_layer(0, 100), _layer(1, 20), _layer(2, 30), _layer(3, 5)]
    plan = PlacementPlan(devices=["cpu", "cpu"], sizes=[2, 2], balance=[2, 2], microbatches=8, layers=layers)
    in_flight = peak_in_flight(make_schedule(schedule, 2, 8))
    assert plan.peak_activation_bytes(schedule) == [120 * in_flight[0], 35 * in_flight[1]]
    if schedule == "gpipe":
        assert in_flight == [8, 8]
    elif schedule == "1f1b":
        assert in_flight == [2, 1]
    else:
        assert in_flight == [3, 2]
    assert PlacementPlan(devices=["cpu"], sizes=[1], balance="params").peak_activation_bytes(schedule) is None


class _Wide(nn.Module):
    """Same parameters whatever ``k``; ``k`` times the saved activations (tanh saves its k-fold output)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x).unsqueeze(1).expand(-1, self.k, -1)).mean(1)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Wide(256), _Wide(1), _Wide(1), _Wide(1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _choose(model: nn.Module, balance: str, warnings: list[str]) -> tuple[list[str], PlacementPlan]:
    return choose_split_points(
        model,
        split_points=None,
        candidates=lambda: candidate_blocks(model),
        balance=balance,
        devices=[torch.device("cpu")] * 2,
        microbatches=2,
        rank_zero=True,
        broadcast=lambda sizes: sizes,
        warn=warnings.append,
        measure=block_profiler(model, 2),
    )


def test_the_fit_balances_candidate_blocks_by_measured_memory_not_parameter_counts() -> None:
    torch.manual_seed(0)
    model = _Net()
    model.example_input_array = torch.randn(16, 8)
    warnings: list[str] = []
    points, plan = _choose(model, "memory", warnings)
    assert points == ["blocks.1"] and plan.sizes == [1, 3] and not warnings  # the wide block alone
    assert plan.layers[0].activation_bytes > 100 * plan.layers[1].activation_bytes
    assert _choose(model, "params", warnings)[0] == ["blocks.2"]  # equal parameters: two blocks each
    del model.example_input_array
    points, plan = _choose(model, "memory", warnings)
    assert points == ["blocks.2"] and "set `example_input_array`" in warnings[-1]
