"""Resolve a target string, ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION``, to the function it names.

Every command that takes a target (``lightning-mgpu tune``, ``lightning-mgpu plan``) and the
workers they start use :func:`load_target`, so the syntax and the errors are the same
everywhere. A mistake raises :class:`TargetError` with one sentence that says what was given
and what was expected; a command prints it as one line, without a traceback.

Only the standard library here: commands check a target's syntax while parsing arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

SYNTAX = "FILE.py:FUNCTION or MODULE:FUNCTION"


class TargetError(ValueError):
    """The target does not name a function that can be imported."""


def parse_target(text: str) -> tuple[str, str]:
    """``"FILE.py:FUNCTION"`` or ``"package.module:FUNCTION"`` -> ``(where, function)``; nothing is imported."""
    where, sep, name = str(text).rpartition(":")
    if not sep or not where or not name or not name.isidentifier():
        raise TargetError(f"expected {SYNTAX}, got {text!r}")
    return where, name


def _import_file(where: str, text: str) -> ModuleType:
    path = Path(where)
    if not path.is_file():
        raise TargetError(f"no such file: {where!r} (in {text!r})")
    spec = importlib.util.spec_from_file_location(f"_lightning_mgpu_target_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {where!r} (in {text!r}): not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    # The file imports its neighbours the way `python FILE.py` would allow.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec.loader.exec_module(module)
    return module


def _import_module(where: str, text: str) -> ModuleType:
    # A module of the current directory imports the way `python -m` would allow.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):  # a parent package that does not exist, or a name like "a..b"
        found = None
    if found is None:
        raise TargetError(f"no module named {where!r} (in {text!r}); give FILE.py:FUNCTION or an importable module")
    return importlib.import_module(where)


def load_target(text: str) -> Callable[..., Any]:
    """Import the file or module ``text`` names and return its function.

    Raises :class:`TargetError` when the syntax is wrong, the file or module does not exist,
    importing it raises (the user's own error is named), or the name is missing or not callable.
    """
    where, name = parse_target(text)
    try:
        module = _import_file(where, text) if where.endswith(".py") else _import_module(where, text)
    except TargetError:
        raise
    except Exception as exc:  # the user's module failed while importing: name it in one line
        raise TargetError(f"importing {where!r} failed: {type(exc).__name__}: {exc}") from exc
    function = getattr(module, name, None)
    if function is None:
        raise TargetError(f"{where} has no function {name!r} (in {text!r})")
    if not callable(function):
        raise TargetError(f"{where}:{name} is a {type(function).__name__}, not a function (in {text!r})")
    return function  # type: ignore[no-any-return]
