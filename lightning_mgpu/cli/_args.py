"""The argparse ``type=`` converters every ``lightning-mgpu`` command shares.

Each one raises ``argparse.ArgumentTypeError``, so argparse prints one line naming the flag
(``lightning-mgpu tune: error: argument --nproc: expected an integer >= 1, got '0'``) and
exits with status 2. Only the standard library here: ``lightning-mgpu --help`` imports this.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable, Optional

from lightning_mgpu._sizes import parse_size


def bounded_int(maximum: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= 1 (and <= ``maximum``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1 and at most {maximum}, got {text!r}")
        return value

    return parse


def positive_seconds(maximum: float) -> Callable[[str], float]:
    """An argparse ``type`` for a number of seconds > 0 and <= ``maximum`` (NaN and infinity refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
        if not math.isfinite(value) or value <= 0 or value > maximum:
            raise argparse.ArgumentTypeError(f"expected a number of seconds > 0 and at most {maximum:g}, got {text!r}")
        return value

    return parse


def size(text: str) -> int:
    """An argparse ``type`` for a size in bytes: ``4096``, ``1KiB``, ``256MiB``, ``1GiB`` (powers of 1024)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_size(text: str) -> int:
    """An argparse ``type`` for a size in bytes > 0, such as a device's memory."""
    value = size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a size > 0 such as 80GiB, got {text!r}")
    return value


def output_file(text: str) -> str:
    """An argparse ``type`` for a file to write: not empty, not a directory, in a directory that exists."""
    if not text.strip() or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected the path of a file to write, got {text!r}")
    return text


def existing_parent(text: str) -> str:
    """:func:`output_file`, and its directory must exist already (the command does not create it)."""
    path = output_file(text)
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise argparse.ArgumentTypeError(f"the directory of {text!r} does not exist")
    return path


def output_dir(text: str) -> Path:
    """An argparse ``type`` for a directory to write into (created later if missing)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a directory path, got ''")
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return Path(text)


def target(text: str) -> str:
    """An argparse ``type`` for ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION``: the syntax only, nothing imported yet."""
    from lightning_mgpu._target import TargetError, parse_target

    try:
        parse_target(text)
    except TargetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
