"""Argument checks shared by every public constructor and command.

Each check returns the value it accepted (normalised where that is useful) or raises
``ValueError`` naming the argument, what is allowed and what was given. ``owner`` (a
class or command name) prefixes the message when given: ``"CommProfiler: warmup_steps
must be an integer >= 1, got 0"``.
"""

from __future__ import annotations

import math
import sys
from typing import Optional


def _prefix(owner: Optional[str]) -> str:
    return f"{owner}: " if owner else ""


def check_int(
    name: str,
    value: object,
    *,
    minimum: int = 1,
    maximum: Optional[int] = None,
    owner: Optional[str] = None,
    why: str = "",
) -> int:
    """An ``int`` (never a ``bool``) in ``[minimum, maximum]``; ``maximum`` defaults to ``sys.maxsize``."""
    high = sys.maxsize if maximum is None else maximum
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= high:
        bound = f" (at most {high})" if maximum is not None or (isinstance(value, int) and value > high) else ""
        raise ValueError(f"{_prefix(owner)}{name} must be an integer >= {minimum}{bound}{why}, got {value!r:.60}")
    return value


def check_bool(name: str, value: object, *, owner: Optional[str] = None) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{_prefix(owner)}{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_real(
    name: str,
    value: object,
    *,
    above: Optional[float] = None,
    below: Optional[float] = None,
    owner: Optional[str] = None,
    what: str = "a number",
) -> float:
    """A finite ``int``/``float`` (never a ``bool``) strictly between ``above`` and ``below``, as a float."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    number = float(value) if ok and not (isinstance(value, int) and abs(value) > 2**1023) else math.nan  # type: ignore[arg-type]
    if not ok or not math.isfinite(number):
        raise ValueError(f"{_prefix(owner)}{name} must be {what}, got {value!r:.60}")
    if (above is not None and not number > above) or (below is not None and not number < below):
        if above is not None and below is not None:
            limits = f"between {above:g} and {below:g}"
        elif above is not None:
            limits = f"> {above:g}"
        else:
            limits = f"< {below:g}"
        raise ValueError(f"{_prefix(owner)}{name} must be {what} {limits}, got {value!r:.60}")
    return number
