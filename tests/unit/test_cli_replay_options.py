"""replay's options are checked before any events are read."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "1e12", "36501"])
def test_a_horizon_past_any_date_is_a_usage_error(value: str) -> None:
    """An infinite or huge horizon failed with an OverflowError's traceback."""
    result = CliRunner().invoke(
        app, ["replay", "--url", "postgresql://u@127.0.0.1:1/x", "--horizon-days", value]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--horizon-days" in lines[0], result.stderr


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("notjson.jsonl", b"identity,time\n", ":1: not JSON"),
        ("array.jsonl", b"[1, 2]\n", ":1: not an event (a list, not an object)"),
        ("bytes.jsonl", b"\xff\xfe\x00garbage\n", ": not UTF-8 text"),
        (
            "badtime.jsonl",
            b'{"identity": "a", "time": "yesterday", "kind": "tool_success", "subject": "t"}\n',
            ":1: not an event",
        ),
        ("nocolumn.csv", b"who,when\nalice,2026-01-01\n", ":2: not an event"),
        (
            "nullsubject.jsonl",
            b'{"identity": "a", "time": "2026-01-01T00:00:00Z", "kind": "tool_success",'
            b' "subject": null}\n',
            ":1: not an event (no subject)",
        ),
        (
            "short.csv",
            b"identity,time,kind,subject\na,2026-01-01T00:00:00Z,tool_success\n",
            ":2: not an event (no subject)",
        ),
        (
            "beforeyear1.jsonl",
            b'{"identity": "a", "time": "0001-01-01T00:30:00+01:00", "kind": "tool_success",'
            b' "subject": "t"}\n',
            ":1: not an event ('0001-01-01T00:30:00+01:00' is out of the range of dates",
        ),
        (
            "lastinstant.jsonl",
            b'{"identity": "a", "time": "9999-12-31T23:59:59.999999Z", "kind": "tool_success",'
            b' "subject": "t"}\n',
            ":1: not an event ('9999-12-31T23:59:59.999999Z' is the first or last instant",
        ),
    ],
)
def test_an_events_file_that_is_not_one_is_one_line_naming_it(
    tmp_path: Path, name: str, content: bytes, says: str
) -> None:
    """Each of these printed a Python traceback (JSONDecodeError, TypeError,
    UnicodeDecodeError, ValueError; OverflowError for a time before year 1 in UTC), or was
    read where the service refuses its date (the last instant of a datetime), or read a
    missing field as the text "None" (a JSON null, a short CSV line)."""
    path = tmp_path / name
    path.write_bytes(content)
    result = CliRunner().invoke(app, ["replay", "--events", str(path)])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {path}") and says in lines[0], lines[0]


@pytest.mark.parametrize("plot", ["out.txt", "missing-directory/out.png"])
def test_a_plot_that_can_not_be_written_is_a_usage_error(tmp_path: Path, plot: str) -> None:
    """Checked before the events are read; it raised CliError's traceback."""
    events = tmp_path / "events.jsonl"
    events.write_text("")
    result = CliRunner().invoke(
        app, ["replay", "--events", str(events), "--plot", str(tmp_path / plot)]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot write"), result.stderr


@pytest.mark.parametrize(
    ("store", "says"),
    [
        ("null://", "keeps nothing"),
        ("ftp://x", "unsupported"),
        ("postgresql://u:p@127.0.0.1:99999/x", "port must be from 1 to 65535"),
        ("postgres://u@127.0.0.1/x?foo=1", "foo"),
        ("postgresql://u@127.0.0.1:abc/x", "the port is not a number"),
        ("postgresql", "Could not parse"),  # a traceback, from SQLAlchemy's ArgumentError
        ("redis://127.0.0.1:99999/9", "the port is out of range (1 to 65535)"),
        ("redis://app:8080#pw@127.0.0.1/9", "the host part ends before its '@'"),
        ("memory", "use memory://"),
        ("memory://\n", "whitespace"),
        ("redis://127.0.0.1/9\n", "whitespace"),
    ],
)
def test_a_store_that_can_not_serve_the_replay_is_a_usage_error(store: str, says: str) -> None:
    """ftp:// and a Postgres URL the driver refuses (a bad port, an unknown parameter)
    exited 1 once every event was read, and so did a Redis URL redis-py would misread;
    null:// scored zeros and exited 0. (The events' database, --url, is never reached:
    port 1.)"""
    result = CliRunner().invoke(
        app, ["replay", "--url", "postgresql://u@127.0.0.1:1/x", "--store", store]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--store" in lines[0] and says in lines[0], result.stderr


@pytest.mark.parametrize(
    ("store", "schema", "says"),
    [
        ("memory://", "scratch", "only a Postgres --store"),
        ("redis://127.0.0.1:1/9", "scratch", "only a Postgres --store"),
        ("postgresql://u@127.0.0.1:1/x", "Bad Name", "--store-schema"),
    ],
)
def test_a_store_schema_the_store_can_not_have_is_a_usage_error(
    store: str, schema: str, says: str
) -> None:
    result = CliRunner().invoke(
        app,
        [
            *("replay", "--url", "postgresql://u@127.0.0.1:1/x"),
            *("--store", store, "--store-schema", schema),
        ],
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--store-schema" in lines[0] and says in lines[0], result.stderr
