"""The few pieces of Markdown the generator writes and reads: tables, cells, links, heading anchors.

Pure string work, no project import, so that the generator's own tests need nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

__all__ = ["cell", "code", "heading_anchors", "links", "table"]

_FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) and ![alt](target); the text may hold `code` and nested brackets one level deep.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def cell(text: object) -> str:
    """One table cell: a ``|`` would end the cell and a newline the row, so both are escaped away."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def code(text: object) -> str:
    """``text`` as inline code (a backtick inside gets a longer fence, as CommonMark allows)."""
    text = str(text)
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> str:
    """A GitHub table; the columns whose indexes are in ``right`` are right-aligned (numbers)."""
    rule = ["---:" if i in right else "---" for i in range(len(header))]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cell(c) for c in line) + " |" for line in lines)


def _outside_code(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks, with inline code blanked out."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, re.sub(r"`+[^`]*`+", lambda m: " " * len(m.group(0)), line)


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image outside code."""
    return [(number, match.group(1)) for number, line in _outside_code(text) for match in _LINK.finditer(line)]


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives this document's headings (``## The planner: `partition` `` -> ``the-planner-partition``).

    GitHub lower-cases the heading's text, drops every character that is not a letter, digit,
    space, hyphen or underscore, turns spaces into hyphens and numbers repeats (``-1``, ``-2``).
    """
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match is None:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors
