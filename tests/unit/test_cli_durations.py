"""Durations on the command line: ``30d``, ``12h``, ``90m`` and friends."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda_memory.cli import app
from coda_memory.cli.runtime import CliError, parse_duration
from coda_memory.postgres.connection import timeout_setting


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


def test_digits_are_ascii() -> None:
    with pytest.raises(CliError):
        parse_duration("\u0663d", "--since")  # ARABIC-INDIC DIGIT THREE


@pytest.mark.parametrize(
    ("option", "value", "limit"),
    [
        ("--lock-wait", "25d", "at most 24 days, 20:31:23.647000"),
        ("--retention", "36501d", "at most 36500d"),
    ],
)
def test_consolidate_refuses_a_duration_no_store_takes_before_connecting(
    option: str, value: str, limit: str
) -> None:
    """These failed after connecting, as a ValueError of the library (exit 1)."""
    result = CliRunner().invoke(
        app, ["consolidate", "--all", "--url", "postgresql://u@127.0.0.1:1/x", option, value]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"for {option}: {limit}" in lines[0], lines[0]


@pytest.mark.parametrize(
    ("value", "setting"),
    [
        (None, "0ms"),
        (timedelta(0), "0ms"),
        (timedelta(microseconds=1), "1ms"),
        (timedelta(microseconds=400), "1ms"),  # 0ms: Postgres read it as no limit at all
        (timedelta(microseconds=1_600), "2ms"),
        (timedelta(seconds=10), "10000ms"),
    ],
)
def test_a_wait_under_a_millisecond_is_a_millisecond_not_no_limit(
    value: timedelta | None, setting: str
) -> None:
    """``--lock-wait 0.4ms`` (and a lock_timeout below a millisecond) waited forever."""
    assert timeout_setting(value, "lock_timeout") == setting


@pytest.mark.parametrize(
    "args",
    [
        ["prune", "--older-than", "0d"],
        ["consolidate", "--all", "--retention", "5"],
        ["analytics", "tools", "--since", "0d"],
    ],
)
def test_a_bad_duration_without_a_url_starts_no_embedded_postgres(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str]
) -> None:
    """The options were checked after the target was resolved: without --url, the
    embedded Postgres was created and started in the working directory first."""
    monkeypatch.delenv("CODA_MEMORY_DATABASE_URL", raising=False)
    monkeypatch.setenv("CODA_MEMORY_DATA_DIR", str(tmp_path / "pgdata"))

    result = CliRunner().invoke(app, args)

    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid duration" in lines[0], result.stderr
    assert not (tmp_path / "pgdata").exists()
