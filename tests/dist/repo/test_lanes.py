"""The processes the suite starts skip torchmetrics' optional imports (tests/_site), and can opt out.

Checked in a child process; the lanes' rules themselves: tests/unit/repo/test_lanes.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import conftest


_START_UP_PROBE = """
import json, sys
import lightning.pytorch
import torchmetrics.utilities.imports as flags
eager = {name: name in sys.modules for name in ("transformers", "matplotlib")}
import transformers, matplotlib  # still importable by whoever needs them
print(json.dumps({"eager": eager, "bert_flag": bool(flags._TRANSFORMERS_GREATER_EQUAL_4_4)}))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_children_start_without_torchmetrics_optional_imports_and_can_opt_out() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    assert str(conftest.SITE) in os.environ["PYTHONPATH"].split(os.pathsep)
    runs = {}
    for name, opt_out in (("quick", "0"), ("full", "1")):  # "0" also when the suite itself runs with the opt-out
        out = subprocess.run(
            [sys.executable, "-c", _START_UP_PROBE],
            env=conftest.cpu_env({"MGPU_TEST_FULL_IMPORTS": opt_out}),
            capture_output=True,
            text=True,
            timeout=100,
            check=True,
        )
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["quick"] == {"eager": {"transformers": False, "matplotlib": False}, "bert_flag": False}
    assert runs["full"] == {"eager": {"transformers": True, "matplotlib": True}, "bert_flag": True}
