"""What the in-process and the multi-process tests of the repository's machinery share (tests/unit/repo/,
tests/dist/repo/).

A fixture here is shared by assigning it in the test module (``probe = repo.probe``): pytest finds
fixtures by the module's names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# ----------------------------------------------------------------------------- test_warm.py
PROBE = """
import json, os, sys
import __main__
report = {
    "argv": sys.argv,
    "main_file": getattr(__main__, "__file__", None),
    "main_spec": getattr(getattr(__main__, "__spec__", None), "name", None),
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "env": os.environ.get("PROBE_VALUE"),
    "session_leader": os.getsid(0) == os.getpid(),
    "stdin_empty": sys.stdin.read() == "",
    "sibling_importable": __import__("importlib.util").util.find_spec("probe_sibling") is not None,
}
print(json.dumps(report))
print("to stderr", file=sys.stderr)
code = int(os.environ.get("PROBE_EXIT", "0"))
if os.environ.get("PROBE_RAISE"):
    raise RuntimeError("raised in the probe")
if os.environ.get("PROBE_SIGNAL"):
    os.kill(os.getpid(), int(os.environ["PROBE_SIGNAL"]))
sys.exit(code)
"""


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    package = tmp_path / "probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(PROBE)
    (package / "probe_sibling.py").write_text("VALUE = 'beside the script'\n")
    return package / "probe.py"
