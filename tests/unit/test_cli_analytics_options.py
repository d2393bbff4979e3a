"""The options the analytics commands share: parsed once, in one place, for each command.

The commands' database work is replaced here: only the parsing of their options is tested
(the commands themselves run against Postgres in tests/postgres/test_cli.py).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from typer.testing import CliRunner

from coda_memory.cli import analytics_commands, app
from coda_memory.cli.analytics_commands import AnalyticsQuery
from coda_memory.cli.app import AnalyticsFormat
from coda_memory.postgres import analytics as postgres_analytics
from coda_memory.postgres.schema import DEFAULT_SCHEMA
from coda_memory.postgres.store import PostgresStore

Seen = dict[str, Any]


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Seen:
    """What the command passed on: its query, its title, and the analytics call's options."""
    for name in ("CODA_MEMORY_DATABASE_URL", "CODA_MEMORY_SCHEMA"):
        monkeypatch.delenv(name, raising=False)
    seen: Seen = {}

    def analytics(
        fetch: Callable[[PostgresStore], Coroutine[Any, Any, object]],
        query: AnalyticsQuery,
        *,
        title: str,
        **_: object,
    ) -> None:
        seen.update(query=query, title=title)
        asyncio.run(fetch(cast(PostgresStore, None)))

    async def recorded(_store: PostgresStore, **options: object) -> list[object]:
        seen["options"] = options
        return []

    monkeypatch.setattr(analytics_commands, "_analytics", analytics)
    for function in ("tool_effectiveness", "entity_popularity", "domain_trends", "fact_summary"):
        monkeypatch.setattr(postgres_analytics, function, recorded)
    return seen


def test_every_option_reaches_the_command(seen: Seen) -> None:
    result = CliRunner().invoke(
        app,
        [
            "analytics",
            "entities",
            "--since",
            "2d",
            "--min-users",
            "1",
            "--limit",
            "7",
            "-f",
            "csv",
            "--lock-wait",
            "3s",
            "--url",
            "postgresql://db/x",
            "--schema",
            "tenant",
        ],
    )

    assert result.exit_code == 0, result.output
    assert seen["query"] == AnalyticsQuery(
        since="2d",
        min_users=1,
        output=AnalyticsFormat.CSV,
        plot=None,
        lock_wait="3s",
        url="postgresql://db/x",
        schema="tenant",
    )
    assert seen["options"] == {"since": timedelta(days=2), "min_users": 1, "limit": 7}
    assert seen["title"] == "Entity popularity (last 2d, at least 1 user)"


@pytest.mark.parametrize("command", ["tools", "entities", "domains"])
def test_windowed_commands_share_their_defaults(seen: Seen, command: str) -> None:
    result = CliRunner().invoke(app, ["analytics", command])

    assert result.exit_code == 0, result.output
    assert seen["query"] == AnalyticsQuery(
        since="30d",
        min_users=5,
        output=AnalyticsFormat.TABLE,
        plot=None,
        lock_wait="10s",
        url=None,
        schema=DEFAULT_SCHEMA,
    )
    assert seen["options"]["since"] == timedelta(days=30)
    assert seen["options"]["min_users"] == 5
    assert "(last 30d, at least 5 users)" in seen["title"]


def test_the_facts_command_has_no_window(seen: Seen) -> None:
    result = CliRunner().invoke(app, ["analytics", "facts", "--min-users", "3"])

    assert result.exit_code == 0, result.output
    assert seen["query"].since is None
    assert seen["options"] == {"min_users": 3}
    assert seen["title"] == "Facts by category (at least 3 users)"
    refused = CliRunner().invoke(app, ["analytics", "facts", "--since", "3d"])
    assert refused.exit_code == 2
    assert seen["options"] == {"min_users": 3}


def test_a_bad_window_is_a_usage_error_before_any_work(seen: Seen) -> None:
    result = CliRunner().invoke(app, ["analytics", "domains", "--since", "soon"])

    assert result.exit_code == 2
    assert "invalid duration 'soon' for --since" in result.output
    assert seen == {}


@pytest.mark.parametrize("since", ["12h", "1.5d", "90m"])
def test_a_window_of_part_of_a_day_is_a_usage_error_before_any_work(seen: Seen, since: str) -> None:
    result = CliRunner().invoke(app, ["analytics", "tools", "--since", since])

    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"error: invalid duration {since!r} for --since: analytics count whole UTC days, "
        "so give a number of days or weeks (e.g. 30d, 2w)"
    ]
    assert seen == {}


def test_help_lists_the_commands_own_options_between_the_shared_ones() -> None:
    result = CliRunner().invoke(app, ["analytics", "entities", "--help"], env={"COLUMNS": "100"})

    options = re.findall(r"│ (--[a-z-]+)", result.output)
    assert options == [
        "--since",
        "--min-users",
        "--limit",
        "--format",
        "--plot",
        "--lock-wait",
        "--url",
        "--schema",
        "--help",
    ]


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--url", ""], {}, "is empty: give a database URL"),
        (["--url", "  "], {}, "is empty: give a database URL"),
        ([], {"CODA_MEMORY_DATABASE_URL": ""}, "is empty: give a database URL"),
        ([], {"CODA_MEMORY_DATABASE_URL": " "}, "is empty: give a database URL"),
        # The default schema, perhaps another tenant's, answered for an empty variable.
        (
            ["--url", "postgresql://u@127.0.0.1:9/x"],
            {"CODA_MEMORY_SCHEMA": ""},
            "$CODA_MEMORY_SCHEMA is empty: give a schema",
        ),
    ],
)
def test_an_empty_url_is_a_usage_error_not_the_embedded_postgres(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str], env: dict[str, str], says: str
) -> None:
    """An unset variable in a deploy script ran the command against a new embedded
    Postgres in the working directory, and exited 0."""
    monkeypatch.delenv("CODA_MEMORY_DATABASE_URL", raising=False)
    monkeypatch.setenv("CODA_MEMORY_DATA_DIR", str(tmp_path / "pgdata"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["stats", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert not (tmp_path / "pgdata").exists()
