"""Byte sizes as people write them: ``"256MiB"`` -> 268435456 and back (powers of 1024, as nccl-tests).

Only the standard library here: the command line parses sizes before anything heavy is imported.
"""

from __future__ import annotations

import re

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_SIZE = re.compile(r"\s*(\d+)\s*([kmg](?:ib)?|b)?\s*", flags=re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"1KiB"``, ``"1K"``, ``"256MiB"``, ``"1GiB"`` (K/M/G are powers of 1024, as in nccl-tests).

    Raises ``ValueError`` for anything it cannot read exactly (``"1MB"``, ``"1.5MiB"``, ``"-4"``).
    """
    match = _SIZE.fullmatch(str(text))
    if match is None:
        raise ValueError(
            f"cannot read {text!r} as a size; use a number of bytes or KiB/MiB/GiB (powers of 1024), e.g. 1KiB or 256MiB"
        )
    number, unit = int(match.group(1)), (match.group(2) or "b").lower()
    return number * {"b": 1, "k": KiB, "m": MiB, "g": GiB}[unit[0]]


def format_size(nbytes: int) -> str:
    """``1024`` -> ``"1 KiB"``, ``268435456`` -> ``"256 MiB"``, ``1000`` -> ``"1000 B"``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
