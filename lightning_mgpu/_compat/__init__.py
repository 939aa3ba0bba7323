"""The only place in the package that touches private names of torch or Lightning.

Every use of an underscore name of ``torch`` or ``lightning`` lives in
:mod:`lightning_mgpu._compat.torch` or :mod:`lightning_mgpu._compat.lightning`, behind a
small public function of ours. Each private name is declared with :func:`guarded`, which
records it in :data:`GUARDED`; ``tests/unit/repo/test_compat.py`` resolves every entry against the
installed torch and Lightning and fails loudly, naming it, when one disappears. A function
here either has a tested fallback for versions without the name or raises a clear
``RuntimeError`` saying which version is needed.

A test (``tests/unit/repo/test_compat.py``) also scans the rest of the package and fails if any
module outside this package imports or reads a private torch/Lightning name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class GuardedName:
    """One private name we rely on: ``module`` is importable, ``attribute`` a dotted path in it."""

    module: str
    attribute: str
    required: bool
    """True when the package cannot work without it (no fallback); False when a fallback exists."""
    why: str
    since: str | None = None
    """The oldest release of ``module``'s distribution (torch or lightning) known to have it, when an
    older one inside pyproject's bounds lacks it and runs the fallback there; None: every one has it."""


GUARDED: list[GuardedName] = []


def guarded(module: str, attribute: str, *, required: bool, why: str, since: str | None = None) -> GuardedName:
    """Declare a private name used by ``_compat`` (see :data:`GUARDED`)."""
    if since is not None and required:
        raise ValueError(f"{module}.{attribute}: a name without a fallback cannot be missing before {since}")
    entry = GuardedName(module, attribute, required, why, since)
    GUARDED.append(entry)
    return entry


def shadow(obj: object, replacements: dict[str, Callable[..., Any]]) -> Callable[[], None]:
    """Shadow methods of ``obj`` by instance attributes (``{name: function}``); returns the undo,
    which drops them again so that the class's methods show through."""
    for name, function in replacements.items():
        setattr(obj, name, function)

    def undo() -> None:
        for name in replacements:
            vars(obj).pop(name, None)

    return undo
