"""The test lanes keep their rules: the fast lane starts no process, every multi-process test has a ceiling.

The lanes are directories (tests/unit, tests/dist, tests/bench) and the rules live in tests/conftest.py;
these tests check that they are in force (without starting anything) and that ``make test-fast`` runs
exactly the lane whose tests conftest allows no process. The processes the suite starts (tests/_site):
tests/dist/repo/test_lanes.py.
"""

from __future__ import annotations

import fnmatch
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
    with pytest.raises(ProcessStartedInFastTest, match=r"test_lanes\.py::.* move it to tests/dist/AREA/"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(ProcessStartedInFastTest):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(ProcessStartedInFastTest):
        multiprocessing.get_context("fork").Process(target=print).start()
    with pytest.raises(ProcessStartedInFastTest):
        os.system("true")


def test_matplotlibs_font_scan_is_not_a_tests_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib's first pyplot import on a machine without its font cache asks ``fc-list`` (seen on a fresh GPU
    machine, where four fast tests failed for it): let through, and nothing else by that door."""
    monkeypatch.setenv("PATH", "/nonexistent")  # whatever fontconfig this machine has: the start is what counts
    with pytest.raises(FileNotFoundError):  # past the guard, to the missing program
        subprocess.run(["fc-list", "--help"], capture_output=True)
    with pytest.raises(ProcessStartedInFastTest):
        subprocess.run(["/usr/bin/fc-list-not", "--help"], capture_output=True)


@dataclass
class _Item:
    nodeid: str
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> Optional[Any]:
        return name if name in self.markers else None

    def add_marker(self, name: str) -> None:
        self.markers.add(name)


def test_a_multiprocess_test_without_a_timeout_is_a_collection_error() -> None:
    items: Any = [
        _Item("tests/dist/test_x.py::test_ok", {"timeout"}),  # multiprocess by its directory
        _Item("tests/unit/test_y.py::test_in_process"),
        _Item("tests/dist/test_x.py::test_no_ceiling"),
    ]
    with pytest.raises(pytest.UsageError, match=r"1 test\(s\) marked multiprocess have no timeout ceiling") as raised:
        conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]  (config is unused)
    assert "tests/dist/test_x.py::test_no_ceiling" in str(raised.value) and "test_ok" not in str(raised.value)
    conftest.pytest_collection_modifyitems(None, items[:2])  # type: ignore[arg-type]


def test_the_directory_marks_the_lane_and_a_test_outside_the_lanes_is_a_collection_error() -> None:
    items: Any = [
        _Item("tests/unit/comm/test_a.py::test_in_process"),
        _Item("tests/dist/comm/test_a.py::test_launched", {"timeout"}),
        _Item("tests/bench/test_b.py::test_smoke", {"timeout"}),
        _Item("bench/test_elsewhere.py::test_not_ours"),  # a path given on the command line: left alone
    ]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    lanes = {item.nodeid.split("::")[1]: item.markers - {"timeout"} for item in items}
    assert lanes == {
        "test_in_process": set(),
        "test_launched": {"multiprocess"},
        "test_smoke": {"bench"},
        "test_not_ours": set(),
    }
    for misplaced, message in (
        (
            _Item("tests/test_flat.py::test_x"),
            r"1 test\(s\) outside the lanes:\n  tests/test_flat.py::test_x\nmove the file",
        ),
        (_Item("tests/scripts/test_x.py::test_x"), r"outside the lanes"),
        (
            _Item("tests/unit/comm/test_a.py::test_x", {"multiprocess", "timeout"}),
            r"under tests/unit/ marked to start processes:\n  tests/unit/comm/test_a.py::test_x\nmove them to tests/dist/",
        ),
        (_Item("tests/unit/test_a.py::test_x", {"bench", "timeout"}), r"under tests/unit/ marked to start processes"),
    ):
        with pytest.raises(pytest.UsageError, match=message):
            conftest.pytest_collection_modifyitems(None, [*items, misplaced])  # type: ignore[arg-type]


def test_a_plain_pytest_run_collects_every_lane() -> None:
    """pytest skips directories named ``dist`` unless told otherwise: the lane would vanish from ``make test``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["tests"]
    for lane in conftest.LANES:
        assert (REPO / "tests" / lane).is_dir(), lane
        assert not [pattern for pattern in options["norecursedirs"] if fnmatch.fnmatch(lane, pattern)], lane


def test_the_fast_lane_leaves_out_exactly_the_markers_that_may_start_processes() -> None:
    makefile = (REPO / "Makefile").read_text()
    found = re.search(r"^test-fast:.*\n\t(.*-m pytest .*)$", makefile, flags=re.MULTILINE)
    assert found, "Makefile has no test-fast target running pytest"
    assert found.group(1).split()[-1] == "tests/unit" and "-m " not in found.group(1).replace("-m pytest", "")
    # the other lanes' directories give their tests exactly the markers that may start processes
    assert sorted(marker for marker in conftest.LANES.values() if marker) == sorted(PROCESS_MARKERS)
    assert conftest.LANES["unit"] is None


def test_files_start_longest_first_each_kept_together_in_its_order(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make test``'s workers take a file at a time: the longest go first; unknown files last, as collected."""
    seconds = tmp_path / "file_seconds.json"
    seconds.write_text('{"tests/unit/test_b.py": 90.0, "tests/unit/test_c.py": 5.0}')
    monkeypatch.setattr(conftest, "FILE_SECONDS", seconds)
    names = ["a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "b.py::t2", "d.py::t1"]
    items: Any = [_Item(f"tests/unit/test_{name}") for name in names]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [item.nodeid.removeprefix("tests/unit/test_") for item in items] == [
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
