"""The two test lanes keep their rules: the fast lane starts no process, every multi-process test has a ceiling.

The rules live in tests/conftest.py; these tests check that they are in force (without
starting anything) and that ``make test-fast`` leaves out exactly the markers conftest allows
to start processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

from tests import conftest
from tests.conftest import PROCESS_MARKERS, REPO, ProcessStartedInFastTest


def test_an_unmarked_test_cannot_start_a_process() -> None:
    with pytest.raises(ProcessStartedInFastTest, match=r"test_lanes\.py::.* mark it @pytest\.mark\.multiprocess"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(ProcessStartedInFastTest):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(ProcessStartedInFastTest):
        multiprocessing.get_context("fork").Process(target=print).start()
    with pytest.raises(ProcessStartedInFastTest):
        os.system("true")


@dataclass
class _Item:
    nodeid: str
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> Optional[Any]:
        return name if name in self.markers else None


def test_a_multiprocess_test_without_a_timeout_is_a_collection_error() -> None:
    items: Any = [
        _Item("tests/test_x.py::test_ok", {"multiprocess", "timeout"}),
        _Item("tests/test_x.py::test_in_process"),
        _Item("tests/test_x.py::test_no_ceiling", {"multiprocess"}),
    ]
    with pytest.raises(pytest.UsageError, match=r"1 test\(s\) marked multiprocess have no timeout ceiling") as raised:
        conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]  (config is unused)
    assert "tests/test_x.py::test_no_ceiling" in str(raised.value) and "test_ok" not in str(raised.value)
    conftest.pytest_collection_modifyitems(None, items[:2])  # type: ignore[arg-type]


def test_the_fast_lane_leaves_out_exactly_the_markers_that_may_start_processes() -> None:
    makefile = (REPO / "Makefile").read_text()
    found = re.search(r"^test-fast:.*\n\t.*-m \"([^\"]+)\"", makefile, flags=re.MULTILINE)
    assert found, 'Makefile has no test-fast target running pytest -m "..."'
    excluded = re.findall(r"not (\w+)", found.group(1))
    assert sorted(excluded) == sorted(PROCESS_MARKERS) and found.group(1) == " and ".join(f"not {m}" for m in excluded)


def test_files_start_longest_first_each_kept_together_in_its_order(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make test``'s workers take a file at a time: the longest go first; unknown files last, as collected."""
    seconds = tmp_path / "file_seconds.json"
    seconds.write_text('{"tests/test_b.py": 90.0, "tests/test_c.py": 5.0}')
    monkeypatch.setattr(conftest, "FILE_SECONDS", seconds)
    names = ["a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "b.py::t2", "d.py::t1"]
    items: Any = [_Item(f"tests/test_{name}") for name in names]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [item.nodeid.removeprefix("tests/test_") for item in items] == [
        "b.py::t1",
        "b.py::t2",
        "c.py::t1",
        "a.py::t1",
        "a.py::t2",
        "d.py::t1",
    ]
    seconds.write_text("not json")  # a broken file leaves the collected order
    backwards = items[::-1]
    conftest.pytest_collection_modifyitems(None, backwards)  # type: ignore[arg-type]
    assert backwards == items[::-1]


def test_the_test_lane_runs_on_xdist_workers_a_file_each_in_the_given_order() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^XDIST\s*:=.*-n \$\(WORKERS\) --dist loadfile --no-loadscope-reorder", makefile, re.MULTILINE)
    test_recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert test_recipe is not None
    assert re.search(r"^\t\$\(BIN\)/python -m pytest \$\(XDIST\)(;|$)", test_recipe.group(1), re.MULTILINE)
    assert "$(BIN)/mypy" in test_recipe.group(1)  # still checked, beside pytest


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
