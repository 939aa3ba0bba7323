"""A parameter shared by stages on different devices (placement/shared_params.py): the using stage's module runs
with a differentiable copy on its own device, gradients summed into the one parameter, exact against one process.
On CPU stages the copy is forced (``copy_shared=True``): the same code path as on GPUs, where devices differ."""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mgpu.placement.running.shared_params import foreign_uses
from lightning_mgpu.placement.running.engine import Pipeline
from lightning_mgpu.placement.runner import PipelineOptions, check_model, place_modules
from tests.scripts.split_models import tiny_gpt2

SCHEDULES = ["gpipe", "1f1b", "zero_bubble"]
TWO_GPUS = [torch.device("cuda:0"), torch.device("cuda:1")]  # only compared, never used


class TiedLM(nn.Module):
    """An embedding tied to the output layer, blocks between: the first and the last stage share one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


class SharedBlock(nn.Module):
    """One block called in the first stage and again in the second (it belongs to the second by definition order)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.mid = nn.Linear(6, 6), nn.Linear(6, 6)
        self.shared = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.tanh(self.mid(torch.tanh(self.shared(self.a(x))))))


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _run_copied(
    model: nn.Module, points: list[str], step: Any, *batch: Any, schedule: str, microbatches: int, watch: str
) -> tuple[torch.Tensor, list[str]]:
    """Run one step with copies forced; return the loss and, for each call of module ``watch``, what torch calls
    inside the call get for its parameters, joined by '+': a copy (``ToCopyBackward0``) or not (``AccumulateGrad``)."""
    engine = Pipeline(
        model, points, ["cpu"] * (len(points) + 1), schedule=schedule, microbatches=microbatches, copy_shared=True
    )
    seen: list[str] = []
    handles = [  # registered after the engine's hooks: sees what they put in place
        model.get_submodule(watch).register_forward_pre_hook(
            lambda m, _args: seen.append(
                "+".join(type(p.mul(1).grad_fn.next_functions[0][0]).__name__ for p in m.parameters(recurse=False))
            )
        )
    ]
    try:
        loss = engine.run(step, model, *batch)
        loss.backward()
        assert engine.backward()
    finally:
        for handle in handles:
            handle.remove()
        engine.close()
    return loss, seen


def _assert_same_grads(got: nn.Module, want: nn.Module) -> None:
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tied_embedding_used_through_a_copy_sums_both_stages_gradients(schedule: str) -> None:
    torch.manual_seed(0)
    reference = TiedLM()
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 16, (8, 6))
    want = _lm_loss(reference, ids)
    want.backward()
    got, seen = _run_copied(model, ["blocks.1"], _lm_loss, ids, schedule=schedule, microbatches=4, watch="head")
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
    _assert_same_grads(model, reference)
    assert seen == ["ToCopyBackward0"] * 4  # the output layer ran with a copy, once per micro-batch
    assert model.head.weight is model.emb.weight and isinstance(model.head.weight, nn.Parameter)  # put back
    assert list(model.state_dict()) == list(reference.state_dict())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_block_called_by_two_stages_gets_a_copy_where_it_does_not_live(schedule: str) -> None:
    torch.manual_seed(0)
    reference = SharedBlock()
    model = copy.deepcopy(reference)
    x = torch.randn(6, 6)
    reference(x).square().mean().backward()
    got, seen = _run_copied(
        model, ["mid"], lambda net, x: net(x).square().mean(), x, schedule=schedule, microbatches=3, watch="shared"
    )
    _assert_same_grads(model, reference)
    # 'shared' lives in the second stage: its call in the first stage uses copies (weight and bias), the second
    # not, also while the other stage's thread runs it with copies at the same time
    assert collections.Counter(seen) == {"ToCopyBackward0+ToCopyBackward0": 3, "AccumulateGrad+AccumulateGrad": 3}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_unmodified_gpt2_with_tied_embeddings_through_a_copy(schedule: str) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    reference = tiny_gpt2()
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 64, (8, 12))

    def loss_of(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return net(input_ids=ids, labels=ids).loss

    want = loss_of(reference, ids)
    want.backward()
    got, seen = _run_copied(
        model, ["transformer.h.2"], loss_of, ids, schedule=schedule, microbatches=4, watch="lm_head"
    )
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5, msg=name)
    assert seen == ["ToCopyBackward0"] * 4


def test_which_uses_need_a_copy_and_where_a_tied_parameter_lives() -> None:
    model = TiedLM()
    assert foreign_uses(model, ["blocks.1"], TWO_GPUS) == [("head", "weight", 1)]
    assert foreign_uses(model, ["blocks.1"], [torch.device("cpu")] * 2) == []
    assert foreign_uses(model, ["blocks.1"], [torch.device("cpu")] * 2, always=True) == [("head", "weight", 1)]
    assert foreign_uses(model, ["head"], TWO_GPUS) == [("head", "weight", 1)]
    assert foreign_uses(SharedBlock(), ["mid"], TWO_GPUS) == []  # one module: a copy is decided per call
    # the tied parameter goes with the module that registers it first (the embedding, stage 0), not the last
    place_modules(model, ["blocks.1"], [torch.device("cpu"), torch.device("meta")])
    assert model.emb.weight.device.type == "cpu" and model.head.weight is model.emb.weight
    assert model.blocks[0].weight.device.type == "cpu" and model.blocks[1].weight.device.type == "meta"
    # no longer refused on GPUs (it was: "not supported yet on GPUs")
    check_model(TiedLM(), PipelineOptions(devices_per_replica=2, split_points=["blocks.1"]), TWO_GPUS)
