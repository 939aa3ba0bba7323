"""``lightning_mgpu.placement.planning.partition`` imports no torch: read from its source, and loaded in a fresh
interpreter (the in-process tests of the planner: tests/unit/placement/test_partition.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.conftest import REPO

PARTITION_FILE = REPO / "lightning_mgpu" / "placement" / "planning" / "partition.py"
PARTITION_INPUT_FILE = REPO / "lightning_mgpu" / "placement" / "planning" / "partition_input.py"
PLACEMENT_INIT = REPO / "lightning_mgpu" / "placement" / "__init__.py"
PLANNING_INIT = REPO / "lightning_mgpu" / "placement" / "planning" / "__init__.py"


# ----------------------------------------------------------------------------- no torch
@pytest.mark.multiprocess  # a fresh interpreter proves the module loads without torch
@pytest.mark.timeout(90)
def test_partition_module_imports_no_torch() -> None:
    for path in (PARTITION_FILE, PARTITION_INPUT_FILE, PLACEMENT_INIT, PLANNING_INIT):
        tree = ast.parse(path.read_text())
        imported = {
            alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert imported <= {"__future__", "bisect", "math", "numbers", "collections", "itertools", "typing", "lightning_mgpu"}, (
            path,
            imported,
        )
    # Loaded without the package's own __init__ (it registers strategies, so it imports Lightning):
    # an empty stand-in for `lightning_mgpu`, then placement/__init__, partition and partition_input for real.
    code = (
        "import sys, types\n"
        "package = types.ModuleType('lightning_mgpu')\n"
        f"package.__path__ = [{str(PARTITION_FILE.parents[2])!r}]\n"
        "sys.modules['lightning_mgpu'] = package\n"
        "from lightning_mgpu.placement import partition\n"
        "assert partition([1, 1, 1, 1, 4], 2) == [4, 1]\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
