"""Printing: rich tables (never reading data as markup), JSON, notes on stderr, plots."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from coda_memory.cli.demo.plots import PlotsUnavailable
from coda_memory.cli.runtime import (
    CliError,
)

#: Width of tables written to a file or pipe (unless $COLUMNS says otherwise): wide
#: enough that cells are not wrapped, so the output stays greppable.
PIPE_WIDTH = 160


def make_console(*, stderr: bool = False) -> Console:
    """A console on stdout (or stderr) that never highlights or reads data as markup or
    as emoji codes (an identity `:ok:` printed as 🆗)."""
    # Made per command: CliRunner and pipes swap sys.stdout, and rich drops colour codes
    # when the stream is not a terminal.
    console = Console(stderr=stderr, highlight=False, soft_wrap=False, emoji=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = PIPE_WIDTH
    return console


def identities_progress(doing: str) -> Progress:
    """A progress bar on stderr of the identities a command has done, out of how many
    (``doing``: what it does to them, as "pruning")."""
    return Progress(
        TextColumn(doing),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("identities"),
        TimeElapsedColumn(),
        console=make_console(stderr=True),
    )


def note(message: str) -> None:
    """A remark on stderr, so stdout keeps only the command's output."""
    make_console(stderr=True).print(message, markup=False, style="dim")


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout, in ASCII: a stored string's 8-bit controls
    (U+009B is a CSI to a terminal that reads them), bidi overrides and zero-width
    characters are escaped as ``\\uXXXX``, as JSON escapes the 7-bit ones."""
    typer.echo(json.dumps(data, indent=2, ensure_ascii=True))


def dump(rows: Sequence[BaseModel]) -> list[dict[str, Any]]:
    """Models as JSON-ready dicts (ISO datetimes)."""
    return [row.model_dump(mode="json") for row in rows]


def fmt_time(value: datetime | None) -> str:
    """``YYYY-MM-DD HH:MM`` in UTC; empty for None."""
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M")


def fmt_number(value: float | None, digits: int = 2) -> str:
    """A fixed-point number, or ``-`` for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_count(value: int | None) -> str:
    """A count, or ``-`` for None (withheld: fewer identities than a k-anonymity floor)."""
    return "-" if value is None else str(value)


def fmt_percent(value: float | None) -> str:
    """A share as a whole percentage, or ``-`` for None; below 1 % and from 99.5 %, to a
    tenth, and never 0 % or 100 % unless it is (a tool that failed 1 call in 2,000 showed
    a success of 100 %)."""
    if value is None:
        return "-"
    percent = 100 * value
    if 0 < percent < 1:  # (0.5 would round to an even 0)
        return f"{max(round(percent, 1), 0.1):.1f}%"
    if 99.5 <= percent < 100:
        return f"{min(round(percent, 1), 99.9):.1f}%"
    return f"{percent:.0f}%"


_WRAPPING = frozenset({"subject", "content", "tool", "entity id", "subject / content"})


def add_row(table: Table, *cells: str | Text) -> None:
    """Add a row whose strings are shown as they are: identity ids, sessions and contents
    are data, never rich markup, and what a terminal would act on in them is escaped
    (:func:`printable`: an escape sequence in a session id or an imported fact's content
    reached the operator's terminal). A :class:`Text` cell is the caller's, made of
    :func:`printable` strings."""
    table.add_row(*(cell if isinstance(cell, Text) else Text(printable(cell)) for cell in cells))


def new_table(title: str | None, columns: Sequence[tuple[str, str]]) -> Table:
    """A table with these (header, justify) columns; fill it with :func:`add_row`."""
    table = Table(
        title=None if title is None else Text(printable(title)),
        title_justify="left",
        caption_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
    )
    for header, justify in columns:
        # Only identifiers and free text wrap (folded: a subject keeps every character).
        # A header may be data (a domain, in analytics domains): never read as markup,
        # and escaped as a cell is.
        table.add_column(
            Text(printable(header)),
            justify=justify,  # type: ignore[arg-type]
            no_wrap=header not in _WRAPPING,
            overflow="fold",
            min_width=12 if header in _WRAPPING else None,
        )
    return table


def checked_plot_path(path: Path | None) -> Path | None:
    """Fail before any work when ``--plot`` names a file that is not a ``.png`` (charts
    are PNG only) or lies in a missing directory."""
    if path is None:
        return None
    if path.suffix.lower() != ".png":
        raise CliError(f"cannot write {path}: --plot writes PNG files only (name it *.png)", 2)
    if not path.parent.is_dir():
        raise CliError(f"cannot write {path}: directory {path.parent} does not exist", 2)
    return path


def draw_plot(draw: Callable[[], Path]) -> None:
    """Run ``draw``; a missing matplotlib, an unwritable file or data no chart can place
    becomes a CliError."""
    try:
        path = draw()
    except PlotsUnavailable as exc:
        raise CliError(str(exc)) from exc
    except OSError as exc:
        raise CliError(f"cannot write the plot: {exc}") from exc
    except (ValueError, OverflowError) as exc:
        # Matplotlib's dates run from year 1 to 9999, and a chart's margins reach past
        # data near either end (a fact's history, copied as it was by import-redis): its
        # refusal was a traceback.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CliError(f"cannot draw the chart: {reason}") from exc
    note(f"plot written to {path}")


def fmt_bytes(size: int) -> str:
    """``size`` in B, kB, MB or GB (powers of 1024)."""
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{size} B"


#: What a spreadsheet reads as the start of a formula in a cell (OWASP's list).
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


#: A signed decimal number and nothing else, which a spreadsheet reads as that number.
_SIGNED_NUMBER = re.compile(r"[+-](?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


def csv_cell(value: Any) -> Any:
    """A CSV field: a string :func:`printable` (no line break can forge a row, no escape
    sequence reaches a terminal) and, when it begins as a formula would, after a ``'``
    (a stored ``=HYPERLINK(…)`` is text to a spreadsheet); other values as they are. A
    string that is only a signed number (``-3``, ``+0.5``) is left as it is: a
    spreadsheet reads it as that number, and a ``'`` would alter the value."""
    if not isinstance(value, str):
        return value
    text = printable(value)
    if text.startswith(_FORMULA_STARTS) and not _SIGNED_NUMBER.fullmatch(text):
        return f"'{text}"
    return text


def printable(text: str) -> str:
    """``text`` with what a terminal would act on (escape sequences, a line break, a tab)
    escaped as Python writes it: ids and reasons may quote data as the store holds it."""
    return text if text.isprintable() else repr(text)[1:-1]
