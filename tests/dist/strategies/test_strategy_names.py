"""A mirrored Lightning name trains for real on 2 CPU ranks (issue 18 item 5).

``ddp_tuned_notebook_find_unused_parameters_true`` stacks both presets of the new names: the fork
launcher (as Lightning's ``ddp_notebook``) and ``find_unused_parameters=True``. Every name's preset is
checked in process by ``tests/unit/strategies/test_lightning_parity.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import fit_tiny


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_notebook_name_with_find_unused_trains_on_two_forked_ranks(tmp_path: Path) -> None:
    result = fit_tiny(tmp_path, "--strategy", "ddp_tuned_notebook_find_unused_parameters_true", "--steps", "4")
    assert result["strategy_class"] == "TunedDDPStrategy" and result["world_size"] == 2
    assert result["ddp_flags"]["find_unused_parameters"] is True
    first, second = result["params_per_rank"]
    assert first == second  # the ranks trained as one
