"""What the in-process and the multi-process tests of one command share (tests/unit/cli/, tests/dist/cli/).

A fixture here is shared by assigning it in the test module (``workdir = cli.workdir``): pytest finds
fixtures by the module's names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS
from tests.helpers.whatif import mlp_profile

# ----------------------------------------------------------------------------- lightning-mgpu (test_cli.py)
COMMANDS = ("strategies", "doctor", "bench-comm", "tune", "plan")

# ----------------------------------------------------------------------------- lightning-mgpu plan (test_cli_plan.py)
FACTORY = """
import torch.nn as nn

def build():
    # a heavy block in the middle, so time balance and parameter balance disagree
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 512), nn.Linear(512, 16), nn.Linear(16, 16))

class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.blocks = build()

def wrapped():
    return Wrapper()

def two():
    m = Wrapper()
    m.other = build()
    return m
"""


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "plan_factory_mod.py").write_text(FACTORY)
    return tmp_path


# ----------------------------------------------------------------------------- lightning-mgpu doctor (test_doctor_cli.py)
SECRET = "0123456789abcdef0123456789abcdef01234567"  # the shape of a W&B API key

# ----------------------------------------------------------------------------- lightning-mgpu tune (test_tuning_cli.py)
TARGET = f"{SCRIPTS / 'tune_target.py'}:make_module"


# ----------------------------------------------------------------------------- lightning-mgpu whatif (test_whatif_cli.py)
@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "comm_profile.json"
    path.write_text(json.dumps(mlp_profile()))
    return path
