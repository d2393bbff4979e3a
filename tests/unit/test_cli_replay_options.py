"""replay's options are checked before any events are read."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from coda_memory.cli import app


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--horizon-days", "-1"),
        ("--horizon-days", "0"),
        ("--sample", "0"),
        ("--min-sessions", "0"),
    ],
)
def test_a_value_that_would_score_nothing_is_a_usage_error(option: str, value: str) -> None:
    # The URL answers nothing: the error must come before any database work.
    result = CliRunner().invoke(
        app, ["replay", "--url", "postgresql://u@127.0.0.1:1/x", option, value]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0], result.stderr
