"""How the command line writes numbers."""

from __future__ import annotations

import csv
import io
import json

import pytest
from rich.console import Console

from coda_memory.cli.output import add_row, csv_cell, fmt_percent, new_table, print_json


@pytest.mark.parametrize(
    ("share", "shown"),
    [
        (None, "-"),
        (0.0, "0%"),
        (1.0, "100%"),
        (0.8, "80%"),
        (0.994, "99%"),
        # 1 failure in 2,000 calls: it said 100 %, as if none had failed.
        (0.9995, "99.9%"),
        (0.995, "99.5%"),
        (0.00004, "0.1%"),  # and 0 % as if none had succeeded
        (0.003, "0.3%"),
        (0.005, "0.5%"),  # 1 in 200: "0%", Python rounding 0.5 to an even 0
        (0.007, "0.7%"),
    ],
)
def test_a_share_is_never_rounded_to_all_or_none(share: float | None, shown: str) -> None:
    assert fmt_percent(share) == shown


HOSTILE = "x\x1b]52;c;ZWNobyBwd25lZA==\x07[link=http://evil.example/]click[/link]\n\x1b[2J"


def test_a_header_made_of_data_is_neither_markup_nor_an_escape_sequence() -> None:
    """analytics domains makes its columns of the domains: a domain written by SQL with
    markup made a clickable link, and its escape sequences reached the terminal."""
    table = new_table(None, [(HOSTILE, "left")])
    add_row(table, "1")
    console = Console(file=io.StringIO(), force_terminal=True, width=400, emoji=False)
    console.print(table)
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b]52" not in shown and "\x1b[2J" not in shown and "\x1b]8;" not in shown
    assert "[link=http://evil.example/]click[/link]" in shown  # the text, as it is
    assert "\\x1b]52" in shown and "\\n" in shown


@pytest.mark.parametrize(
    ("value", "cell"),
    [
        ('=HYPERLINK("http://evil","click")', '\'=HYPERLINK("http://evil","click")'),
        ("+cmd|' /C calc'!A0", "'+cmd|' /C calc'!A0"),
        ("-2-3", "'-2-3"),
        ("-3", "-3"),  # a number a spreadsheet reads as it is, not a formula
        ("+0.5", "+0.5"),
        ("-1e5", "-1e5"),
        ("-1e5+A1", "'-1e5+A1"),
        ("-", "'-"),
        ("- 3", "'- 3"),
        ("-\u0663", "'-\u0663"),  # digits a spreadsheet does not read as a number
        ("+\uff11", "'+\uff11"),
        ("@SUM(1+1)", "'@SUM(1+1)"),
        ("dom-good\rEVIL", "dom-good\\rEVIL"),  # one field, not a forged row
        ("tool-\x1b[2J", "tool-\\x1b[2J"),
        ("get_account", "get_account"),
        (-3, -3),
        (0.25, 0.25),
    ],
)
def test_a_csv_field_is_text_a_spreadsheet_does_not_run(value: object, cell: object) -> None:
    assert csv_cell(value) == cell
    if isinstance(cell, str):
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerow([csv_cell(value), "3"])
        assert list(csv.reader(io.StringIO(out.getvalue()))) == [[cell, "3"]]


def test_json_output_escapes_what_a_terminal_would_act_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """8-bit controls (U+009B is a CSI, U+009D an OSC), bidi overrides and zero-width
    characters went out raw, where JSON escapes only the 7-bit ones."""
    print_json({"identity_id": "id-\x9b2J-\u202egnp.exe-\u200b", "n": 1})
    out = capsys.readouterr().out
    assert out.isascii()
    assert "\\u009b2J" in out and "\\u202e" in out and "\\u200b" in out
    assert json.loads(out) == {"identity_id": "id-\x9b2J-\u202egnp.exe-\u200b", "n": 1}
