"""``lightning-mgpu whatif`` in a fresh interpreter: the command imports no torch when it does not measure.

The rest of the command, in-process: tests/unit/cli/test_whatif_cli.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import cli

profile = cli.profile  # a fixture, shared with tests/unit/cli/test_whatif_cli.py


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_whatif_without_measuring_imports_no_torch(profile: Path) -> None:
    code = (
        "import sys\n"
        "from lightning_mgpu.cli import main\n"
        f"main(['whatif', {str(profile)!r}, '--link', '1gbe', '--costs', 'none', '--json'])\n"
        "try:\n"
        "    main(['whatif', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, sorted(sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=100)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout[: done.stdout.index("usage:")])["predicted"]["world_size"] == 2
