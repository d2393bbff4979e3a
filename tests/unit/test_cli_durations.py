"""Durations on the command line: ``30d``, ``12h``, ``90m`` and friends."""

from __future__ import annotations

from datetime import timedelta

import pytest

from coda_memory.cli.runtime import CliError, parse_duration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30d", timedelta(days=30)),
        ("12h", timedelta(hours=12)),
        ("90m", timedelta(minutes=90)),
        ("45s", timedelta(seconds=45)),
        ("250ms", timedelta(milliseconds=250)),
        ("2w", timedelta(weeks=2)),
        (" 1.5h ", timedelta(minutes=90)),
        ("7D", timedelta(days=7)),
    ],
)
def test_durations_parse(text: str, expected: timedelta) -> None:
    assert parse_duration(text, "--since") == expected


@pytest.mark.parametrize(
    "text",
    # 500000w is a timedelta, but not one back from now (before year 1); 0.0001ms rounds
    # to nothing.
    ["", "30", "d", "3x", "-1d", "0d", "0.0h", "1 day", "1d2h", "1e9w", "500000w", "0.0001ms"],
)
def test_bad_durations_are_usage_errors_that_name_the_option(text: str) -> None:
    with pytest.raises(CliError) as raised:
        parse_duration(text, "--older-than")
    assert raised.value.code == 2
    assert str(raised.value).startswith(f"invalid duration {text!r} for --older-than: ")
