"""Tables for long-running commands' output: they fit or wrap at any width, terminal or not.

Rich sizes a table to the console (80 columns when output is a pipe or a CI log) and, when the
columns do not fit, cuts cell and header text with an ellipsis. Folding instead keeps every
figure whole across lines, so a narrow log loses no column.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Column, Table


def wrapping_table(title: str, headers: Sequence[str], caption: str | None = None) -> Table:
    """A table whose headers and cells fold onto further lines instead of being cut."""
    columns = [Column(header, overflow="fold") for header in headers]
    return Table(*columns, title=title, caption=caption)
