"""recipes/model_split: the hand split (ModelPart1 / ModelPart2 + .to()) and its HybridParallelStrategy form
train the same numbers: 1 replica over 2 CPU "devices" with 4 micro-batches, and 2 replicas x 2 devices.
Likewise the transformer variant: the GPT split by hand (rewritten forward, a copy of the tied embedding on the
second device) and the unmodified GPT on split_points=["model.transformer.h.2"], 1F1B and zero-bubble."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests import conftest

FLAGS = ["--seed", "0", "--num-samples", "2048", "--epochs", "2"]
STEPS = 2 * 2048 // 64


def _run(script: str, workdir: Path, *flags: str) -> dict[str, Any]:
    return conftest.run_recipe("model_split", script, workdir, *FLAGS, *flags, timeout=200)[0]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("train_plain.py", tmp_path_factory.mktemp("plain"))


def _assert_same_training(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert len(got["parameters"]) == len(want["parameters"]) == 10
    for a, b in zip(got["parameters"], want["parameters"]):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_hybrid_on_two_cpu_devices_with_4_microbatches_trains_the_hand_split_numbers(
    plain: dict[str, Any], tmp_path: Path
) -> None:
    hybrid = _run("train_lightning.py", tmp_path, "--accelerator", "cpu", "--devices", "2", "--microbatches", "4")
    assert hybrid["world_size"] == 1 and len(plain["losses"]) == len(hybrid["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(hybrid["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=1e-5)
    _assert_same_training(hybrid, plain)
    assert sum(plain["losses"][-8:]) < 0.8 * sum(plain["losses"][:8]), "the loop did not train"


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_replicas_of_two_devices_with_half_the_batch_train_the_hand_split_numbers(
    plain: dict[str, Any], tmp_path: Path
) -> None:
    flags = [
        "--accelerator",
        "cpu",
        "--devices",
        "4",
        "--batch-size",
        "32",
        "--microbatches",
        "2",
        "--balance",
        "params",
    ]
    hybrid = _run("train_lightning.py", tmp_path, *flags)
    assert hybrid["world_size"] == 2 and len(hybrid["losses"]) == STEPS
    _assert_same_training(hybrid, plain)


# ----------------------------------------------------------------------------- the transformer variant
GPT_FLAGS = ["--seed", "0", "--num-samples", "256", "--epochs", "2"]
GPT_STEPS = 2 * 256 // 32


def _run_gpt(script: str, workdir: Path, *flags: str) -> dict[str, Any]:
    return conftest.run_recipe("model_split", script, workdir, *GPT_FLAGS, *flags, timeout=200)[0]


@pytest.fixture(scope="module")
def gpt_plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_gpt("train_gpt_plain.py", tmp_path_factory.mktemp("gpt_plain"))


def _assert_same_gpt(got: dict[str, Any], want: dict[str, Any]) -> None:
    # 4 blocks x 12 tensors + wte (tied to lm_head: one parameter) + wpe + ln_f's 2
    assert len(got["parameters"]) == len(want["parameters"]) == 4 * 12 + 4
    for a, b in zip(got["parameters"], want["parameters"]):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_gpt_split_at_a_named_block_trains_the_hand_split_numbers(
    gpt_plain: dict[str, Any], tmp_path: Path, schedule: str
) -> None:
    flags = ["--accelerator", "cpu", "--devices", "2", "--microbatches", "4", "--schedule", schedule]
    hybrid = _run_gpt("train_gpt_lightning.py", tmp_path, *flags)
    assert hybrid["world_size"] == 1 and len(gpt_plain["losses"]) == len(hybrid["losses"]) == GPT_STEPS
    torch.testing.assert_close(torch.tensor(hybrid["losses"]), torch.tensor(gpt_plain["losses"]), rtol=0, atol=1e-5)
    _assert_same_gpt(hybrid, gpt_plain)
    assert gpt_plain["losses"][-1] < 0.95 * gpt_plain["losses"][0], "the loop did not train"


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_gpt_on_two_replicas_of_two_devices_with_half_the_batch_trains_the_hand_split_numbers(
    gpt_plain: dict[str, Any], tmp_path: Path
) -> None:
    flags = ["--accelerator", "cpu", "--devices", "4", "--batch-size", "16", "--microbatches", "2"]
    hybrid = _run_gpt("train_gpt_lightning.py", tmp_path, *flags)
    assert hybrid["world_size"] == 2 and len(hybrid["losses"]) == GPT_STEPS
    _assert_same_gpt(hybrid, gpt_plain)
