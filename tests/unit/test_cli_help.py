"""The command line's help and version: help texts that the terminal wraps, and --version."""

from __future__ import annotations

import tomllib
from pathlib import Path

from typer.testing import CliRunner

from coda_memory import __version__
from coda_memory.cli import app
from coda_memory.cli.app import unwrapped


def test_version_prints_the_library_version_and_exits() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"coda-memory {__version__}\n"


def test_the_library_version_is_the_package_version() -> None:
    """Two strings kept by hand (``__version__`` and pyproject's ``version``); read from
    pyproject.toml, since the suite may run on the sources, not an installed package."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert __version__ == tomllib.loads(pyproject.read_text())["project"]["version"]


def test_version_with_a_command_after_it_runs_no_command() -> None:
    # Eager: no database is asked for, even with a command after it.
    result = CliRunner().invoke(app, ["--version", "stats"])
    assert result.exit_code == 0
    assert result.stdout == f"coda-memory {__version__}\n"


def test_help_paragraphs_are_wrapped_by_the_terminal_not_the_source() -> None:
    # Wide enough for each paragraph to fit on a line: a line break of the docstring
    # would show as one in the middle of a sentence.
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    assert "created and migrated on first use. Warnings label identities under the key" in (
        result.stdout
    )
    # The command listing: a first paragraph of several source lines.
    assert "history, checkpoint, its own rollup rows, owed rollups" in result.stdout
    forget = CliRunner().invoke(app, ["forget", "--help"], env={"COLUMNS": "300"})
    assert "checkpoint, its own rollup rows, owed rollups and import ledger" in forget.stdout


def test_unwrapped_joins_a_paragraph_s_lines_and_keeps_laid_out_ones() -> None:
    text = """First line
    goes on.

    A list:
    - one
    - two

    \b
    kept
    as is
    """
    assert unwrapped(text) == "First line goes on.\n\nA list:\n- one\n- two\n\n\b\nkept\nas is"
    assert unwrapped(None) is None
    assert unwrapped("") == ""
