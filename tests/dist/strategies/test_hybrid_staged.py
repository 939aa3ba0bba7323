"""HybridParallelStrategy on unmodified models (split_points, the staged pipeline): Hugging Face GPT-2 with tied
embeddings and a residual CNN with BatchNorm and in-place ReLU, every schedule, against one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import SCRIPTS, run_python

FIT = str(SCRIPTS / "fit_staged.py")


def _fit(tmp_path: Path, name: str, *flags: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.pt"
    run_python([FIT, *flags, "--out", str(out)], cwd=tmp_path, timeout=400)
    return torch.load(out, weights_only=True)


def _assert_same(got: dict[str, Any], want: dict[str, Any], *, losses: bool = True) -> None:
    assert got["state"].keys() == want["state"].keys()  # state_dict keys do not depend on placement
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-5, msg=key)
    if losses:
        assert len(got["losses"]) == len(want["losses"]) == 4
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=1e-5)
        assert got["logged"] == pytest.approx(want["logged"], abs=1e-5)  # self.log: once per step, full batch


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_gpt2_with_tied_embeddings_one_and_two_replicas_every_schedule(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    one = _fit(tmp_path, "one", "--model", "gpt2", "--strategy", "single", "--schedules", "gpipe")["gpipe"]
    split = _fit(tmp_path, "split", "--model", "gpt2", "--split-points", "model.transformer.h.2")
    assert set(split) == {"gpipe", "1f1b", "zero_bubble"}
    for schedule, record in split.items():
        assert record["world_size"] == 1 and record["split_points"] == ["model.transformer.h.2"], schedule
        assert record["tied"], "the tied embedding must stay one parameter"
        _assert_same(record, one)
    # 2 replicas x 2 devices, half the batch each, the strategy picks the cut among transformer.h's blocks
    two = _fit(tmp_path, "two", "--model", "gpt2", "--devices", "4", "--batch-size", "8")
    for schedule, record in two.items():
        assert record["world_size"] == 2 and record["split_points"] == ["model.transformer.h.2"], schedule
        _assert_same(record, one)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_residual_cnn_with_batchnorm_and_in_place_relu_every_schedule(tmp_path: Path) -> None:
    """BatchNorm in training normalises per micro-batch: the reference computes the same 4 micro-batches in turn."""
    one = _fit(
        tmp_path, "one", "--model", "cnn", "--strategy", "single", "--schedules", "gpipe", "--reference-chunks", "4"
    )
    split = _fit(tmp_path, "split", "--model", "cnn", "--split-points", "model.blocks.2")
    for schedule, record in split.items():
        assert record["split_points"] == ["model.blocks.2"], schedule
        _assert_same(record, one["gpipe"])  # running statistics included
