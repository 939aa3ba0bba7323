"""recipes/image_classifier: the Lightning script is the DataParallel loop, step for step, on 1 or 2 processes.

Three short runs (2 epochs x 8 steps, so the reshuffled order of epoch 2 is covered),
shared by the tests: the plain loop, the Lightning script on one process, and on 2 CPU
ranks with the same global batch (half of it per rank). The sampler they rely on is checked in-process in
tests/unit/recipes/test_image_classifier.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import conftest
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "image_classifier"
SEED = 0
TRAIN_SIZE, VAL_SIZE, BATCH_SIZE, EPOCHS = 256, 128, 32, 2
EXPECTED_STEPS = EPOCHS * TRAIN_SIZE // BATCH_SIZE
# Less noise than the default run, so that 16 steps visibly learn.
COMMON_FLAGS = ["--seed", str(SEED), "--epochs", str(EPOCHS), "--noise", "1.0"]
COMMON_FLAGS += ["--train-size", str(TRAIN_SIZE), "--val-size", str(VAL_SIZE)]


def run_recipe(script: str, workdir: Path, *flags: str) -> dict[str, Any]:
    """Run an image_classifier script on CPU and return what rank 0 recorded."""
    return conftest.run_recipe("image_classifier", script, workdir, *COMMON_FLAGS, *flags, timeout=150)[0]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_recipe("train_plain.py", tmp_path_factory.mktemp("plain"), "--batch-size", str(BATCH_SIZE))


@pytest.fixture(scope="module")
def lightning_one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    flags = ["--devices", "1", "--batch-size", str(BATCH_SIZE)]
    return run_recipe("train_lightning.py", tmp_path_factory.mktemp("lightning1"), *flags)


@pytest.fixture(scope="module")
def lightning_two_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    flags = ["--devices", "2", "--batch-size", str(BATCH_SIZE)]  # the global batch: 16 per rank
    return run_recipe("train_lightning.py", tmp_path_factory.mktemp("lightning2"), *flags)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_lightning_on_one_process_gives_the_plain_loops_losses_and_accuracy(
    plain: dict[str, Any], lightning_one_process: dict[str, Any]
) -> None:
    assert len(plain["losses"]) == EXPECTED_STEPS
    assert len(lightning_one_process["losses"]) == EXPECTED_STEPS
    assert lightning_one_process["world_size"] == 1
    losses, plain_losses = torch.tensor(lightning_one_process["losses"]), torch.tensor(plain["losses"])
    torch.testing.assert_close(losses, plain_losses, rtol=0, atol=1e-6)
    assert plain["state_dict"].keys() == lightning_one_process["state_dict"].keys()
    for name, value in plain["state_dict"].items():
        torch.testing.assert_close(lightning_one_process["state_dict"][name], value, rtol=0, atol=1e-6)
    assert lightning_one_process["val_acc"] == plain["val_acc"]
    assert plain["val_acc"] > 0.3, "the classifier did not learn (chance is 0.1)"


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_ranks_with_the_same_global_batch_end_where_one_process_ends(
    lightning_one_process: dict[str, Any], lightning_two_processes: dict[str, Any]
) -> None:
    assert lightning_two_processes["world_size"] == 2
    assert len(lightning_two_processes["losses"]) == EXPECTED_STEPS
    spec = importlib.util.spec_from_file_location("image_classifier_plain", RECIPE / "train_plain.py")
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    torch.manual_seed(SEED)
    initial = recipe.ConvNet().state_dict()  # what the recipes build after seeding
    one, two = lightning_one_process["state_dict"], lightning_two_processes["state_dict"]
    assert one.keys() == two.keys() == initial.keys()
    for name in one:
        assert (one[name] - initial[name]).abs().max() > 1e-3, f"{name} barely moved from its initial value"
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5)
    # Rank 0 saw half of the validation set: only a synced metric equals the one-process value.
    assert lightning_two_processes["val_acc"] == lightning_one_process["val_acc"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path: Path) -> None:
    script = str(RECIPE / "train_lightning.py")
    flags = [*COMMON_FLAGS, "--devices", "2", "--batch-size", "33"]
    proc = conftest.run_python([script, *flags], cwd=tmp_path, timeout=150, check=False)
    assert proc.returncode != 0
    assert "--batch-size 33 is the global batch" in proc.stderr + proc.stdout
    assert "use a multiple of 2" in proc.stderr + proc.stdout
