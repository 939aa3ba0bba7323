"""The ``lightning-mgpu`` package in-process: plain help texts, the shared argument types and target syntax.

The lazy imports (``lightning-mgpu --help`` and ``import lightning_mgpu`` import neither torch nor
Lightning, yet the strategy names get registered) need fresh interpreters: tests/dist/cli/test_cli.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from lightning_mgpu._target import TargetError, load_target, parse_target
from lightning_mgpu.cli import _args, build_parser
from tests.helpers.cli import COMMANDS


# ----------------------------------------------------------------------------- help texts


def _help(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_every_command_is_listed_and_its_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    listed = _help(capsys=capsys)
    assert all(command in listed for command in COMMANDS)
    for argv in [(), *[(command,) for command in COMMANDS]]:
        text = _help(*argv, capsys=capsys)
        for markup in ("``", ":func:", ":mod:", ":class:", ":meth:"):
            assert markup not in text, f"lightning-mgpu {' '.join(argv)} --help shows reST markup {markup!r}:\n{text}"


@pytest.mark.parametrize("command", ["tune", "plan"])
def test_commands_taking_a_target_name_the_same_syntax(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help(command, capsys=capsys).split())
    assert "TARGET" in text and "FILE.py:FUNCTION or MODULE:FUNCTION" in text


# ----------------------------------------------------------------------------- argument types


@pytest.mark.parametrize(
    ("convert", "text", "message"),
    [
        (_args.bounded_int(), "0", "expected an integer >= 1, got '0'"),
        (_args.bounded_int(8), "9", "expected an integer >= 1 and at most 8, got '9'"),
        (_args.bounded_int(), "1.5", "expected an integer >= 1, got '1.5'"),
        (_args.positive_seconds(60), "nan", "expected a number of seconds > 0 and at most 60, got 'nan'"),
        (_args.positive_seconds(60), "61", "at most 60"),
        (_args.positive_seconds(60), "soon", "expected a number of seconds > 0, got 'soon'"),
        (_args.size, "1MB", "cannot read '1MB' as a size"),
        (_args.positive_size, "0", "expected a size > 0 such as 80GiB, got '0'"),
        (_args.output_file, " ", "expected the path of a file to write"),
        (_args.output_file, ".", "expected the path of a file to write"),
        (_args.existing_parent, "/nonexistent/dir/x.json", "the directory of '/nonexistent/dir/x.json' does not exist"),
        (_args.output_dir, "", "expected a directory path"),
        (_args.target, "nocolon", "expected FILE.py:FUNCTION or MODULE:FUNCTION, got 'nocolon'"),
        (_args.target, "x.py:not-a-name", "expected FILE.py:FUNCTION or MODULE:FUNCTION"),
    ],
)
def test_argument_types_refuse_with_one_sentence(convert: object, text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        convert(text)  # type: ignore[operator]
    assert message in str(info.value)


def test_argument_types_accept_what_they_document(tmp_path: Path) -> None:
    assert _args.bounded_int(8)("8") == 8
    assert _args.positive_seconds(60)("1.5") == 1.5
    assert _args.size("256MiB") == 256 * 2**20 and _args.positive_size("1K") == 1024
    assert _args.existing_parent(str(tmp_path / "x.json")) == str(tmp_path / "x.json")
    assert _args.output_dir(str(tmp_path / "new")) == tmp_path / "new"
    assert _args.target("pkg.models:build") == "pkg.models:build"


# ----------------------------------------------------------------------------- FILE.py:FUNCTION and MODULE:FUNCTION


@pytest.fixture()
def targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module and a script in a working directory; sys.path and sys.modules restored afterwards."""
    (tmp_path / "target_mod_for_cli.py").write_text("def build():\n    return 'module'\n\nNOT_CALLABLE = 3\n")
    (tmp_path / "target_script.py").write_text("from target_helper import VALUE\n\ndef build():\n    return VALUE\n")
    (tmp_path / "target_helper.py").write_text("VALUE = 'script'\n")
    (tmp_path / "target_broken.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    return tmp_path


def test_a_target_is_a_file_or_a_module_function(targets: Path) -> None:
    assert load_target("target_mod_for_cli:build")() == "module"  # the current directory is on the path
    assert load_target(f"{targets / 'target_script.py'}:build")() == "script"  # its neighbours import
    assert load_target("target_script.py:build")() == "script"
    assert parse_target("a/b.py:f") == ("a/b.py", "f") and parse_target("C:/x.py:f") == ("C:/x.py", "f")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nocolon", "expected FILE.py:FUNCTION or MODULE:FUNCTION, got 'nocolon'"),
        (":build", "expected FILE.py:FUNCTION or MODULE:FUNCTION"),
        ("missing.py:build", "no such file: 'missing.py' (in 'missing.py:build')"),
        ("no_such_pkg.models:build", "no module named 'no_such_pkg.models'"),
        ("target_mod_for_cli:absent", "target_mod_for_cli has no function 'absent'"),
        ("target_mod_for_cli:NOT_CALLABLE", "target_mod_for_cli:NOT_CALLABLE is a int, not a function"),
        ("target_broken.py:f", "importing 'target_broken.py' failed: RuntimeError: broken at import"),
        ("target_broken:f", "importing 'target_broken' failed: RuntimeError: broken at import"),
    ],
)
def test_a_bad_target_is_one_clear_sentence(targets: Path, text: str, message: str) -> None:
    with pytest.raises(TargetError) as info:
        load_target(text)
    assert message in str(info.value)
