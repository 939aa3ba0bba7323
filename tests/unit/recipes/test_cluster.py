"""The cluster recipes' batch scripts say what docs/cluster.md promises (issue 31 item 3), read without running them.

Submitted for real to the SLURM lab (their CPU variant): tests/dist/cluster/test_slurm_jobs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import RECIPES

TEMPLATES = sorted((RECIPES / "cluster").glob("*.sbatch"))


def directives(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"#SBATCH --([a-z-]+)(?:=(\S+))?", line.strip())
        if match:
            found[match.group(1)] = match.group(2) or ""
    return found


def test_there_is_one_template_per_layout() -> None:
    assert [p.name for p in TEMPLATES] == ["multi_node.sbatch", "one_node.sbatch", "torchrun_multi_node.sbatch"]


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
def test_every_template_asks_for_the_warning_and_the_requeue(template: Path) -> None:
    found = directives(template)
    text = template.read_text()
    assert "requeue" in found and found["open-mode"] == "append"  # every attempt's output in one file
    assert re.fullmatch(r"(B:)?USR1@90", found["signal"]), found["signal"]
    assert "srun --kill-on-bad-exit=1" in text and text.startswith("#!/bin/bash\n")
    if template.stem == "torchrun_multi_node":
        # torchrun would die of SIGUSR1: the batch script gets it and requeues (SIGTERM to every task)
        assert found["signal"] == "B:USR1@90" and found["ntasks-per-node"] == "1"
        assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "--node-rank=\\$SLURM_NODEID" in text
    else:
        # one task per GPU, and the Trainer told as much
        assert found["signal"] == "USR1@90" and found["ntasks-per-node"] == found["gpus-per-node"]
        assert '--devices "$SLURM_NTASKS_PER_NODE" --num-nodes "$SLURM_JOB_NUM_NODES"' in text
    assert found["nodes"] == ("1" if template.stem == "one_node" else "2")
