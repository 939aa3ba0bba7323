"""Tables as every command prints them: rich, the label columns left-aligned and the figures right-aligned,
at least 120 columns wide when the output is a file or a log rather than a terminal."""

from __future__ import annotations

from typing import Any, Optional, Sequence


def table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1, caption: Optional[str] = None
) -> Any:
    """A ``rich.table.Table``: the first ``left`` columns left-aligned (labels), the others right-aligned."""
    from rich.table import Table

    made = Table(title=title, caption=caption)
    for index, column in enumerate(columns):
        made.add_column(column, justify="left" if index < left else "right")
    for row in rows:
        made.add_row(*row)
    return made


def wide_console(console: Any = None) -> Any:
    """``console`` or a new ``rich.console.Console``; piped to a file or a log, it does not squeeze into 80 columns."""
    from rich.console import Console

    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    return console


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    left: int = 1,
    caption: Optional[str] = None,
    console: Any = None,
) -> None:
    """Print :func:`table` on ``console`` (default: a new one, see :func:`wide_console`)."""
    wide_console(console).print(table(title, columns, rows, left=left, caption=caption))
