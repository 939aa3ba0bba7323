"""recipes/regression: the Lightning script is the plain loop, step for step, on 1 or 2 processes.

Three short runs (2 epochs x 8 steps), shared by the tests: the plain loop, the Lightning
script on one process with the same batch, and on 2 CPU ranks with half the batch each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests import conftest
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "regression"
SEED = 0
NUM_SAMPLES, BATCH_SIZE, EPOCHS = 256, 32, 2
EXPECTED_STEPS = EPOCHS * NUM_SAMPLES // BATCH_SIZE
COMMON_FLAGS = ["--seed", str(SEED), "--num-samples", str(NUM_SAMPLES), "--epochs", str(EPOCHS)]


def run_recipe(script: str, workdir: Path, *flags: str) -> dict[str, Any]:
    """Run a regression script on CPU and return what rank 0 recorded."""
    return conftest.run_recipe("regression", script, workdir, *COMMON_FLAGS, *flags, timeout=150)[0]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_recipe("train_plain.py", tmp_path_factory.mktemp("plain"), "--batch-size", str(BATCH_SIZE))


@pytest.fixture(scope="module")
def lightning_one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    flags = ["--devices", "1", "--batch-size", str(BATCH_SIZE)]
    return run_recipe("train_lightning.py", tmp_path_factory.mktemp("lightning1"), *flags)


@pytest.fixture(scope="module")
def lightning_two_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    flags = ["--devices", "2", "--batch-size", str(BATCH_SIZE // 2)]  # --batch-size is per process here
    return run_recipe("train_lightning.py", tmp_path_factory.mktemp("lightning2"), *flags)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_lightning_on_one_process_gives_the_plain_loops_losses(
    plain: dict[str, Any], lightning_one_process: dict[str, Any]
) -> None:
    assert len(plain["losses"]) == EXPECTED_STEPS
    assert len(lightning_one_process["losses"]) == EXPECTED_STEPS
    assert lightning_one_process["world_size"] == 1
    # A shuffled order (Lightning's automatic sampler) would already differ at step 1.
    losses, plain_losses = torch.tensor(lightning_one_process["losses"]), torch.tensor(plain["losses"])
    torch.testing.assert_close(losses, plain_losses, rtol=0, atol=1e-6)
    assert plain["losses"][-1] < 0.5 * plain["losses"][0], "the loop did not train"
    assert plain["state_dict"].keys() == lightning_one_process["state_dict"].keys() == {"weight", "bias"}
    for name, value in plain["state_dict"].items():
        torch.testing.assert_close(lightning_one_process["state_dict"][name], value, rtol=0, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_ranks_with_half_the_batch_end_where_one_process_with_the_full_batch_ends(
    lightning_one_process: dict[str, Any], lightning_two_processes: dict[str, Any]
) -> None:
    assert lightning_two_processes["world_size"] == 2
    assert len(lightning_two_processes["losses"]) == EXPECTED_STEPS
    torch.manual_seed(SEED)
    initial = nn.Linear(10, 1).state_dict()  # what the recipes build after seeding
    one, two = lightning_one_process["state_dict"], lightning_two_processes["state_dict"]
    assert one.keys() == two.keys() == initial.keys()
    for name in one:
        assert (one[name] - initial[name]).abs().max() > 0.1, f"{name} barely moved from its initial value"
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5)
