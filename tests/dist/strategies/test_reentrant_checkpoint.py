"""Reentrant activation checkpointing under DDP: torch's raw error becomes one that names the fixes that work.

``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` with ``find_unused_parameters=True``
fails in the first backward with DDP's "Expected to mark a variable ready only once ... try to
use _set_static_graph()" (a private torch method). Our strategies' ``backward`` raises
``ReentrantCheckpointError`` from it, naming ``TunedDDPStrategy(static_graph=True)`` and
``use_reentrant=False``; ``on_exception`` appends the same to the raw error when it was raised
outside the strategy's backward (in-process: tests/unit/strategies/test_reentrant_checkpoint.py).
Here the 2-rank launch (``tests/scripts/reentrant_fit.py``) shows the error on both ranks, and that
both fixes train exactly as the run with nothing for DDP to search.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from lightning_mgpu.strategies.parts.failures import READY_TWICE
from tests.conftest import SCRIPTS, TORCHRUN_2, run_python


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("reentrant") / "out"
    run_python(
        [*TORCHRUN_2, str(SCRIPTS / "reentrant_fit.py"), "--out-dir", str(out_dir)], cwd=out_dir.parent, timeout=180
    )
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_ranks_both_get_the_fixes_with_torchs_error_chained(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        failed = rank["failing"]
        assert failed["error_type"] == "ReentrantCheckpointError", failed
        assert "TunedDDPStrategy(static_graph=True, ...)" in failed["error"], failed
        assert "checkpoint(..., use_reentrant=False)" in failed["error"], failed
        assert failed["cause_type"] == "RuntimeError" and failed["cause"].startswith(READY_TWICE), failed


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_ranks_both_fixes_train_exactly_as_the_baseline(two_ranks: list[dict[str, Any]]) -> None:
    """static_graph=True and use_reentrant=False end with the parameters of the run with nothing for DDP to search
    (find_unused_parameters=False), bit for bit, on both ranks."""
    baseline = two_ranks[0]["baseline"]["params"]
    for rank in two_ranks:
        assert rank["static_graph"]["params"] == baseline
        assert rank["non_reentrant"]["params"] == baseline
