"""recipes/char_lm: the Lightning script is the hand-written DDP loop, step for step.

Four short runs on the first 2,200 characters of the corpus (240 training windows: 7 steps
of 32 per epoch, 3 epochs, so the order is reshuffled twice), shared by the tests:

* the plain loop as a world of 1, and the Lightning script on 1 process, same batch:
  same losses at every step (the sampler's seed, set_epoch and the optimizer all match);
* the Lightning script on 2 CPU ranks with half the batch each: same final weights as
  the 1-process run (DDP averages the two halves' gradients into the full batch's);
* the plain loop under torchrun on 2 ranks, same flags: same losses and weights as the
  Lightning script on 2 ranks.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from tests import conftest
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "char_lm"
BATCH_SIZE, EPOCHS, STEPS_PER_EPOCH = 32, 3, 7  # 240 windows // 32
EXPECTED_STEPS = EPOCHS * STEPS_PER_EPOCH
COMMON_FLAGS = ["--max-chars", "2200", "--epochs", str(EPOCHS), "--seed", "1234", "--sample-chars", "20"]
TWO_RANKS = ["--batch-size", str(BATCH_SIZE // 2)]  # --batch-size is per process
SUMMARY_TITLES = {"train_plain.py": "char_lm: hand-written DDP", "train_lightning.py": "char_lm: Lightning + ddp_tuned"}


def run_recipe(script: str, workdir: Path, *flags: str, torchrun: bool = False) -> dict[str, Any]:
    """Run a char_lm script on CPU (under torchrun with 2 processes if asked); return rank 0's record."""
    launcher = conftest.TORCHRUN_2 if torchrun else ()
    result, proc = conftest.run_recipe("char_lm", script, workdir, *COMMON_FLAGS, *flags, launcher=launcher)
    # Only rank 0 prints the summary, once, however many processes ran.
    assert proc.stdout.count(SUMMARY_TITLES[script]) == 1, proc.stdout
    return result


@pytest.fixture(scope="module")
def plain_one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_recipe("train_plain.py", tmp_path_factory.mktemp("plain1"), "--batch-size", str(BATCH_SIZE))


@pytest.fixture(scope="module")
def lightning_one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    flags = ["--devices", "1", "--batch-size", str(BATCH_SIZE)]
    return run_recipe("train_lightning.py", tmp_path_factory.mktemp("lightning1"), *flags)


@pytest.fixture(scope="module")
def lightning_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_recipe("train_lightning.py", tmp_path_factory.mktemp("lightning2"), "--devices", "2", *TWO_RANKS)


@pytest.fixture(scope="module")
def plain_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_recipe("train_plain.py", tmp_path_factory.mktemp("plain2"), *TWO_RANKS, torchrun=True)


@pytest.fixture(scope="module")
def initial_weights() -> dict[str, torch.Tensor]:
    """The weights both scripts start from: the recipe's model, built right after seeding."""
    spec = importlib.util.spec_from_file_location("char_lm_train_plain", RECIPE / "train_plain.py")
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with mock.patch.object(sys, "argv", ["train_plain.py", *COMMON_FLAGS]):
        args = recipe.parse_args()
    _, vocab = recipe.load_corpus(args.data, args.max_chars)
    torch.manual_seed(args.seed)
    model = recipe.CharTransformer(len(vocab), args.block_size, args.width, args.layers, args.heads)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.multiprocess
@pytest.mark.timeout(540)
def test_lightning_on_one_process_takes_the_plain_loops_steps(
    plain_one_process: dict[str, Any], lightning_one_process: dict[str, Any]
) -> None:
    plain, lightning = plain_one_process, lightning_one_process
    assert plain["world_size"] == lightning["world_size"] == 1
    assert len(plain["losses"]) == len(lightning["losses"]) == EXPECTED_STEPS
    # Steps 8 and 15 start epochs 2 and 3: a sampler with another seed, or without
    # set_epoch, would give other batches (other losses) from there on, if not from step 1.
    torch.testing.assert_close(torch.tensor(lightning["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=1e-6)
    assert plain["losses"][-1] < plain["losses"][0] - 1.5, "the loop did not train"
    assert_same_weights(lightning["state_dict"], plain["state_dict"], atol=1e-6)
    assert lightning["val_loss"] == pytest.approx(plain["val_loss"], abs=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(540)
def test_two_ranks_with_half_the_batch_end_where_one_process_with_the_full_batch_ends(
    lightning_one_process: dict[str, Any], lightning_two_ranks: dict[str, Any], initial_weights: dict[str, torch.Tensor]
) -> None:
    one, two = lightning_one_process, lightning_two_ranks
    assert two["world_size"] == 2
    assert len(two["losses"]) == EXPECTED_STEPS
    # No `module.` prefix: the record holds the bare model's weights.
    assert two["state_dict"].keys() == initial_weights.keys()
    for name, initial in initial_weights.items():  # else the comparison below would prove little
        assert (one["state_dict"][name] - initial).abs().max() > 0.01, f"{name} barely moved from its initial value"
    assert_same_weights(two["state_dict"], one["state_dict"], atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(540)
def test_torchrun_plain_ddp_and_lightning_on_two_ranks_agree(
    plain_two_ranks: dict[str, Any], lightning_two_ranks: dict[str, Any]
) -> None:
    plain, lightning = plain_two_ranks, lightning_two_ranks
    assert plain["world_size"] == lightning["world_size"] == 2
    assert len(plain["losses"]) == len(lightning["losses"]) == EXPECTED_STEPS
    torch.testing.assert_close(torch.tensor(lightning["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=1e-6)
    assert_same_weights(lightning["state_dict"], plain["state_dict"], atol=1e-5)
    # all_reduce of (sum, count) by hand and self.log(sync_dist=True) give the same validation loss.
    assert lightning["val_loss"] == pytest.approx(plain["val_loss"], abs=1e-6)
