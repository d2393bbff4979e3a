"""import-redis on records no check foresaw: one identity's bad data never stops the copy
of the others, and the command line reads the URL's prefix and never shows a password."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import asyncpg
import pytest
import redis
import redis.asyncio as aioredis
from sqlalchemy import make_url
from typer.testing import CliRunner

from coda_memory import MemoryService
from coda_memory.cli import app
from coda_memory.core.model import Fact
from coda_memory.core.sanitize import sanitize_observation
from coda_memory.errors import ConnectionLost
from coda_memory.migration import (
    IMPORT_SOCKET_TIMEOUT,
    ImportSummary,
    import_redis,
    redis_to_postgres,
)
from coda_memory.postgres import PostgresStore, imports
from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.migrate import migrate_async
from coda_memory.redis import RedisStore
from coda_memory.redis.codec import SUBJECT_RULE, from_ms
from coda_memory.redis.export import stream_identity
from coda_memory.redis.store import split_prefix
from tests.helpers import tool_ok
from tests.postgres.helpers import dsn, own_postgres, unflushed, until_waiting
from tests.postgres.test_migrations import HEAD
from tests.redis.test_import_redis import fact, ms, now, observation, row_counts
from tests.redis_fixtures import _own_server


async def _seed_good(client: aioredis.Redis, prefix: str, identity: str) -> None:
    await client.zadd(
        f"{prefix}obs:{identity}", {observation(identity, "1", 1, "get_account"): ms(1)}
    )
    await client.hset(
        f"{prefix}facts:{identity}", "fact:tool_affinity:t", fact(identity, "t", 0.5, 1)
    )


async def _imported_once(redis_url: str, pg_url: str) -> ImportSummary:
    """One run of the import from ``redis_url`` into ``pg_url``."""
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        return await import_redis(source, target, now=now)
    finally:
        await source.close()
        await target.close()


#: Too long for coda-memory; random, so that Postgres cannot compress it into its index.
LONG_SUBJECT = "tool_affinity:" + secrets.token_urlsafe(6000)
LONG_SESSION = secrets.token_urlsafe(6000)
LONG_IDENTITY = "h-" + "x" * 300


def _event(identity: str, count_after: int, session: str = "s1") -> str:
    return json.dumps(
        {
            "identityId": identity,
            "subject": "tool_affinity:t",
            "category": "tool_affinity",
            "kind": "reinforced",
            "sessionId": session,
            "at": ms(2),
            "confidenceBefore": 0.5,
            "confidenceAfter": 0.6,
            "countBefore": 1,
            "countAfter": count_after,
            "easeBefore": None,
            "easeAfter": None,
            "quality": None,
            "hits": 1,
            "trials": 1,
        }
    )


async def test_records_postgres_cannot_hold_leave_out_what_they_must_and_no_more(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    p = redis_prefix
    for identity in ("a-good", "b-case", "c-type", "d-event", "e-good", "i-session"):
        await _seed_good(redis_client, p, identity)
    # Facts Postgres cannot store: left out one by one, the rest of b-case is copied.
    await redis_client.hset(
        f"{p}facts:b-case",
        mapping={
            "fact:tool_affinity:big": fact("b-case", "big", 0.5, 3_000_000_000),
            "fact:tool_affinity:nul": fact("b-case", "nul", 0.5, 1, subject="tool_affinity:\x00"),
            "fact:tool_affinity:long": fact("b-case", "long", 0.5, 1, subject=LONG_SUBJECT),
        },
    )
    # A key of another type than the layout's: the identity is left out whole. A fact
    # event whose count Postgres cannot hold: the event is left out, found by the dry run.
    await redis_client.set(f"{p}pending:c-type", "oops")
    await redis_client.rpush(f"{p}history:d-event", _event("d-event", 3_000_000_000))
    # An identity that is not UTF-8 text, and one that holds a NUL.
    await redis_client.hset(f"{p}facts:".encode() + b"f-bad\xff", "x", fact("x", "t", 0.5, 1))
    await redis_client.hset(f"{p}facts:g\x00nul", "x", fact("g\x00nul", "t", 0.5, 1))
    # An identity longer than any the library serves.
    await redis_client.hset(f"{p}facts:{LONG_IDENTITY}", "x", fact(LONG_IDENTITY, "t", 0.5, 1))
    # A fact event whose session is longer than any the library takes (too long for
    # Postgres to index, SQLSTATE 54000): the event is left out, the identity copied.
    await redis_client.rpush(f"{p}history:i-session", _event("i-session", 2, LONG_SESSION))

    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        dry = await import_redis(source, None, now=now)
        summary = await import_redis(source, target, now=now)
        again = await import_redis(source, target, now=now)
    finally:
        await source.close()
        await target.close()

    reasons = dict(summary.bad)
    assert reasons[f"{p}facts:b-case field 'fact:tool_affinity:big'"].startswith(
        "reinforcementCount is not an integer"
    )
    assert reasons[f"{p}facts:b-case field 'fact:tool_affinity:nul'"] == (
        "subject holds a NUL character or a lone surrogate"
    )
    assert reasons[f"{p}*:c-type"].startswith("not copied: BadRecord: a key of the wrong type")
    assert reasons[f"{p}history:d-event"] == "fact event: countAfter is out of range"
    assert reasons[f"{p}*:b'f-bad\\xff'"] == "the identity in the key is not UTF-8 text"
    assert reasons[f"{p}*:'g\\x00nul'"] == "the identity in the key holds a NUL character"
    assert reasons[f"{p}facts:b-case field 'fact:tool_affinity:long'"] == (
        "subject is longer than 500 characters"
    )
    assert reasons[f"{p}*:{LONG_IDENTITY}"] == (
        "the identity in the key is longer than 256 characters"
    )
    assert reasons[f"{p}history:i-session"] == (
        "fact event: sessionId is longer than 200 characters"
    )
    assert len(summary.bad) == 9
    # The dry run finds them all.
    assert set(dict(dry.bad)) == set(reasons)
    # Every other identity is copied, those after the bad ones included.
    assert (summary.identities, summary.copied) == (9, 5)
    counts = await row_counts(pg_url)
    assert (counts["observations"], counts["facts"], counts["redis_imports"]) == (5, 5, 5)
    # What was left out whole is not in the ledger: a later run tries it again.
    assert (again.copied, again.skipped) == (0, 5)
    assert {key for key, _ in again.bad} == {
        f"{p}*:c-type",
        f"{p}*:{LONG_IDENTITY}",
        f"{p}*:b'f-bad\\xff'",
        f"{p}*:'g\\x00nul'",
    }


def test_the_command_reads_the_prefix_of_the_url(
    redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    server, _ = split_prefix(redis_url)
    client = redis.Redis.from_url(server)
    client.hset(f"{redis_prefix}facts:bob", "fact:tool_affinity:t", fact("bob", "t", 0.5, 1))
    client.close()
    result = CliRunner().invoke(app, ["import-redis", redis_url, "--dry-run", "-f", "json"])
    assert result.exit_code == 0, result.output
    assert (json.loads(result.stdout)["identities"], json.loads(result.stdout)["facts"]) == (1, 1)


def test_a_url_that_cannot_be_parsed_never_shows_its_password(pg_url: str) -> None:
    for url in ("redis://admin:hunter2/x@127.0.0.1:6379/14", "redis://u:s3c:r@et@127.0.0.1:1/0"):
        result = CliRunner().invoke(app, ["import-redis", url, "--dry-run", "--url", pg_url])
        assert result.exit_code in (1, 2), result.output
        assert "hunter2" not in result.output and "et@" not in result.output, result.output
        assert result.output.startswith("error: "), result.output
    assert asyncio.run(row_counts(pg_url))["redis_imports"] == 0


async def test_a_second_fact_about_a_subject_and_a_rejected_observation_are_named(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    p = redis_prefix
    await redis_client.hset(
        f"{p}facts:h-dup",
        mapping={
            "fact:a": fact("h-dup", "t", 0.5, 1, id="fact:a"),
            "fact:b": fact("h-dup", "t", 0.9, 4, id="fact:b"),
        },
    )
    # Parsed, then refused by the checks a new emit passes (a tool name with a space).
    await redis_client.zadd(f"{p}obs:h-dup", {observation("h-dup", "n2", 1, "bad name"): ms(1)})
    summary = await _imported_once(redis_url, pg_url)
    reasons = dict(summary.bad)
    assert reasons.pop(f"{p}facts:h-dup field 'fact:a'") == (
        f"a second fact about its subject (field 'fact:b' is copied: {SUBJECT_RULE})"
    )
    # By the id the original server gave it, which finds it in Redis.
    [(key, _)] = reasons.items()
    assert key == f"{p}obs:h-dup id 'n2'"
    assert (summary.copied, summary.facts) == (1, 1)


#: Two facts about one subject, (field, confidence, updatedAt in days) each, and the field
#: of the one every reader keeps: the later anchor (confidenceAt, else updatedAt), then
#: the higher confidence, then the smaller id (the field).
SECOND_FACTS = [
    # A stale fact's stored confidence is as of its old anchor: the fresh one is kept.
    pytest.param((("fact:a", 0.9, 1), ("fact:b", 0.6, 9)), "fact:b", id="anchor"),
    pytest.param((("fact:a", 0.5, 9), ("fact:b", 0.9, 9)), "fact:b", id="confidence"),
    pytest.param((("fact:b", 0.7, 9), ("fact:a", 0.7, 9)), "fact:a", id="id"),
]


@pytest.mark.parametrize(("stored", "kept"), SECOND_FACTS)
async def test_a_second_fact_about_a_subject_is_left_out_by_the_rule_the_store_reads_by(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    pg_url: str,
    stored: tuple[tuple[str, float, float], ...],
    kept: str,
) -> None:
    """The import copied the first fact by field name, where the Redis store's reads kept
    whichever ``HVALS`` gave last: Postgres held another fact than the one the Redis
    store served."""
    for field, confidence, updated in stored:
        await redis_client.hset(
            f"{redis_prefix}facts:h-dup",
            field,
            fact("h-dup", "t", confidence, 1, id=field, updatedAt=ms(updated)),
        )
    summary = await _imported_once(redis_url, pg_url)
    (left_out,) = {field for field, _, _ in stored} - {kept}
    assert summary.bad == [
        (
            f"{redis_prefix}facts:h-dup field {left_out!r}",
            f"a second fact about its subject (field {kept!r} is copied: {SUBJECT_RULE})",
        )
    ]
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        ((field, confidence, updated),) = [s for s in stored if s[0] == kept]
        [served] = await source.facts("h-dup")
        [copied] = await target.facts("h-dup")
        assert (served.id, served.confidence, served.updated_at) == (
            field,
            confidence,
            from_ms(ms(updated), "updatedAt"),
        )
        assert (copied.confidence, copied.updated_at) == (served.confidence, served.updated_at)
    finally:
        await source.close()
        await target.close()


async def _served_and_copied(redis_url: str, pg_url: str, identity: str) -> tuple[Fact, Fact]:
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        [served] = await source.facts(identity)
        [copied] = await target.facts(identity)
        return served, copied
    finally:
        await source.close()
        await target.close()


async def test_two_facts_alike_but_for_their_json_are_told_apart_alike_by_the_store_and_the_import(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """Of one id, anchor and confidence, the store kept the one ``HVALS`` gave first and
    the import the one of the first field: the smaller stored JSON decides for both."""
    for field, content in (("fact:a", "Uses t: z"), ("fact:b", "Uses t: a")):
        await redis_client.hset(
            f"{redis_prefix}facts:h-tie", field, fact("h-tie", "t", 0.7, 1, content=content)
        )
    summary = await _imported_once(redis_url, pg_url)
    assert summary.bad == [
        (
            f"{redis_prefix}facts:h-tie field 'fact:a'",
            f"a second fact about its subject (field 'fact:b' is copied: {SUBJECT_RULE})",
        )
    ]
    served, copied = await _served_and_copied(redis_url, pg_url, "h-tie")
    assert served.content == copied.content == "Uses t: a"


async def test_the_rule_takes_a_fact_of_an_unusable_ease_and_the_import_names_it(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """The import left out a fact of an ease no strategy gives before the rule, and so
    copied the stale one that the Redis store, which reads the fresh one, leaves out."""
    key = f"{redis_prefix}facts:h-ease"
    await redis_client.hset(key, "fact:a", fact("h-ease", "t", 0.9, 1, updatedAt=ms(1)))
    await redis_client.hset(key, "fact:b", fact("h-ease", "t", 0.6, 1, easeFactor=1e308))
    summary = await _imported_once(redis_url, pg_url)
    reasons = dict(summary.bad)
    assert reasons.pop(f"{key} field 'fact:b'").startswith("easeFactor 1e+308 is outside")
    assert reasons == {
        f"{key} field 'fact:a'": (
            "a second fact about its subject (field 'fact:b' is read instead, and left"
            f" out: {SUBJECT_RULE})"
        )
    }
    assert (summary.copied, summary.facts) == (1, 0)


async def test_a_lone_surrogate_leaves_out_its_record_or_is_removed_from_a_facts_text(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """One lone surrogate (half an emoji that a JavaScript ``slice`` cut) kept the whole
    identity out of Postgres on every run, and the dry run said nothing of it."""
    p, cut = redis_prefix, "\ud83d"
    await _seed_good(redis_client, p, "j-cut")
    await redis_client.hset(
        f"{p}facts:j-cut",
        mapping={
            "fact:tool_affinity:emoji": fact(
                "j-cut", "emoji", 0.5, 1, content=f"Uses emoji {cut}successfully"
            ),
            "fact:tool_affinity:half": fact(
                "j-cut", "half", 0.5, 1, subject=f"tool_affinity:half{cut}"
            ),
        },
    )
    await redis_client.rpush(f"{p}history:j-cut", _event("j-cut", 2, f"s{cut}"))
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        dry = await import_redis(source, None, now=now)
        summary = await import_redis(source, target, now=now)
        copied = {f.subject: f.content for f in await target.facts("j-cut")}
    finally:
        await source.close()
        await target.close()
    expected = [
        (
            f"{p}facts:j-cut field 'fact:tool_affinity:half'",
            "subject holds a NUL character or a lone surrogate",
        ),
        (f"{p}history:j-cut", "fact event: sessionId holds a NUL character or a lone surrogate"),
    ]
    assert sorted(dry.bad) == sorted(summary.bad) == sorted(expected)
    assert (summary.copied, summary.failed) == (1, [])
    assert copied["tool_affinity:emoji"] == "Uses emoji successfully"
    assert "tool_affinity:half\ud83d" not in copied


async def test_a_bad_record_is_named_without_what_it_holds(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """Labels quoted up to 40 characters of a member that was no observation, and a
    field's whole name: both may hold anything a tool wrote (here a name and an address)."""
    p = redis_prefix
    field = "fact:entity_frequency:person:Jane Roe <jane@example.org>"
    await redis_client.hset(f"{p}facts:h-pii", field, "{not json")
    text, named = "Jane Roe, jane@example.org, +1 555 0100", '{"id": "Jane <jane@example.org>"}'
    await redis_client.zadd(
        f"{p}obs:h-pii",
        {observation("h-pii", "n1", 1, "get_account"): ms(1), text: ms(2), named: ms(3)},
    )
    summary = await _imported_once(redis_url, pg_url)
    assert sorted(key for key, _ in summary.bad) == [
        f"{p}facts:h-pii field of {len(field)} bytes",
        f"{p}obs:h-pii member #1 ({len(text)} bytes)",
        f"{p}obs:h-pii member #2 ({len(named)} bytes)",
    ]
    assert "jane" not in repr(summary.bad).lower()
    assert (summary.copied, summary.observations) == (1, 1)


async def _served_live(pg_url: str, identity: str) -> None:
    """A live server on Postgres stored and consolidated ``identity``: its checkpoint row,
    which a consolidation would lock, is there."""
    store = PostgresStore.from_url(pg_url)
    try:
        await store.append([sanitize_observation(identity, tool_ok("t"), datetime.now(UTC))])
        await MemoryService(store).consolidate(identity)
    finally:
        await store.close()


async def test_an_identity_live_traffic_holds_is_left_busy_and_the_others_are_copied(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """One identity whose checkpoint a live consolidation held stopped the whole run after
    the lock timeout; the bad records of the identities copied before were never listed,
    since the next run skips those."""
    for identity in ("alice", "bob", "carol"):
        await _seed_good(redis_client, redis_prefix, identity)
    await redis_client.zadd(f"{redis_prefix}obs:carol", {"{broken": ms(2)})
    await _served_live(pg_url, "bob")
    holder = await asyncpg.connect(dsn(pg_url))
    try:
        lock = holder.transaction()
        await lock.start()
        await holder.execute(
            "SELECT 1 FROM coda_memory.checkpoints WHERE identity_id = 'bob' FOR UPDATE"
        )
        busy = await asyncio.to_thread(
            CliRunner().invoke, app, ["import-redis", redis_url, "--url", pg_url]
        )
        await lock.rollback()
    finally:
        await holder.close()
    assert busy.exit_code == 3, busy.output
    assert "busy (locked by live traffic; the next run copies them): bob" in busy.stderr
    assert "identities copied" in busy.stdout and "bad record: " in busy.stdout
    again = await asyncio.to_thread(
        CliRunner().invoke, app, ["import-redis", redis_url, "--url", pg_url, "-f", "json"]
    )
    assert again.exit_code == 0, again.output
    summary = json.loads(again.stdout)
    assert (summary["copied"], summary["skipped"], summary["busy"]) == (1, 2, [])


async def test_a_key_with_an_empty_identity_is_left_out_not_counted_as_copied(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """It counted as copied, with a ledger row, although its observation was refused."""
    await _seed_good(redis_client, redis_prefix, "alice")
    await redis_client.zadd(f"{redis_prefix}obs:", {observation("", "1", 1, "get_account"): ms(1)})
    summary = await _imported_once(redis_url, pg_url)
    assert (summary.identities, summary.copied) == (2, 1)
    assert dict(summary.bad) == {f"{redis_prefix}*:": "the identity in the key is empty"}
    assert (await row_counts(pg_url))["redis_imports"] == 1


async def test_an_identity_left_out_whole_makes_the_run_exit_1(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """It exited 0 (3 with another identity busy): a script took the import for done."""
    await _seed_good(redis_client, redis_prefix, "alice")
    await redis_client.set(f"{redis_prefix}facts:carol", "not a hash")  # a key of another type
    for dry in ([], ["--dry-run"]):
        result = await asyncio.to_thread(
            CliRunner().invoke,
            app,
            ["import-redis", redis_url, "--url", pg_url, "-f", "json", *dry],
        )
        assert result.exit_code == 1, result.output
        report = json.loads(result.stdout)
        assert (report["copied"], report["failed"]) == (1, ["carol"]), report
    # What was copied stays copied; carol is tried again by the next run.
    assert (await row_counts(pg_url))["redis_imports"] == 1


def test_a_dry_run_checks_the_target_it_was_given(redis_url: str, empty_pg_url: str) -> None:
    """It never connected to Postgres: a server out of reach, or a schema not migrated,
    stopped only the real run."""
    for target, says in (
        (empty_pg_url, "not migrated"),
        ("postgresql://postgres@127.0.0.1:9/nowhere", "cannot connect"),
    ):
        result = CliRunner().invoke(app, ["import-redis", redis_url, "--dry-run", "--url", target])
        assert result.exit_code == 1, result.output
        assert says in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("failure", "raised", "says"),
    [
        # An identity too large to read within redis-py's 5 s: a bare "Timeout reading
        # from host:port" stopped the run.
        (
            redis.exceptions.TimeoutError("Timeout reading from 127.0.0.1:6379"),
            TimeoutError,
            r"identity whale was read .*\?socket_timeout=",
        ),
        # Redis gone: "ConnectionError: Connection closed by server.", Redis unnamed.
        (
            redis.exceptions.ConnectionError("Connection closed by server."),
            ConnectionLost,
            r"connection to Redis was lost while the identity whale was read",
        ),
    ],
)
async def test_a_redis_failure_names_redis_the_identity_and_the_remedy(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
    failure: Exception,
    raised: type[Exception],
    says: str,
) -> None:
    for identity in ("a-small", "whale"):
        await _seed_good(redis_client, redis_prefix, identity)
    read = stream_identity

    async def slow(store: RedisStore, identity: str, sink: Any) -> Any:
        if identity == "whale":
            raise failure
        return await read(store, identity, sink)

    monkeypatch.setattr(redis_to_postgres, "stream_identity", slow)
    summary = ImportSummary()
    with pytest.raises(raised, match=says):
        source = RedisStore.from_url(redis_url)
        try:
            await import_redis(source, None, now=now, summary=summary)
        finally:
            await source.close()
    assert summary.copied == 1  # a-small, before it


@pytest.mark.parametrize(
    ("failure", "raised"),
    [
        (redis.exceptions.TimeoutError("Timeout reading from 127.0.0.1:6379"), TimeoutError),
        (redis.exceptions.ConnectionError("Connection closed by server."), ConnectionLost),
    ],
)
async def test_a_redis_failure_during_a_copy_is_not_taken_for_a_dead_postgres_connection(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
    failure: Exception,
    raised: type[Exception],
) -> None:
    """The identity is read within its copy's Postgres transaction: a Redis timeout (an
    OSError, as TimeoutError is) or a lost Redis connection raised there must stop the
    run at once, not read as a dead Postgres connection that replaces the pool and reads
    the identity again (waiting out the socket timeout twice)."""
    await _seed_good(redis_client, redis_prefix, "whale")
    reads: list[str] = []

    async def failing(store: RedisStore, identity: str, sink: Any) -> Any:
        reads.append(identity)
        raise failure from OSError("the socket said so")

    monkeypatch.setattr(redis_to_postgres, "stream_identity", failing)
    source = RedisStore.from_url(redis_url)
    target = PostgresStore.from_url(pg_url)
    try:
        pool = target.engine.pool
        with pytest.raises(raised, match="identity whale was read"):
            await import_redis(source, target, now=now)
        assert reads == ["whale"]
        assert target.engine.pool is pool
    finally:
        await source.close()
        await target.close()
    assert (await row_counts(pg_url))["redis_imports"] == 0


def test_the_command_reads_redis_with_a_long_socket_timeout_unless_the_url_says(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[float | None] = []
    from_url = RedisStore.from_url

    def recorded(url: str, **options: Any) -> RedisStore:
        store = from_url(url, **options)
        made.append(store.client.connection_pool.connection_kwargs.get("socket_timeout"))
        return store

    monkeypatch.setattr(RedisStore, "from_url", recorded)
    server, _ = split_prefix(redis_url)
    for url in (server, f"{server}?socket_timeout=7"):
        CliRunner().invoke(app, ["import-redis", url, "--dry-run", "--prefix", "none:"])
    assert made == [IMPORT_SOCKET_TIMEOUT, 7.0]


async def test_a_statement_timeout_of_the_database_does_not_cut_a_copy(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str, admin_url: str
) -> None:
    """A statement_timeout set on the database or the role (a managed server's parameter
    group) cut each copy that waited or ran longer, which was then reported "busy (locked
    by live traffic)", exit 3, on every run."""
    await _seed_good(redis_client, redis_prefix, "bob")
    await _served_live(pg_url, "bob")
    database = make_url(pg_url).database
    holder = await asyncpg.connect(dsn(pg_url))
    try:
        await holder.execute(f"ALTER DATABASE \"{database}\" SET statement_timeout = '200ms'")
        lock = holder.transaction()
        await lock.start()
        await holder.execute(
            "SELECT 1 FROM coda_memory.checkpoints WHERE identity_id = 'bob' FOR UPDATE"
        )
        copy = asyncio.create_task(_imported_once(redis_url, pg_url))
        await until_waiting(admin_url, database, 1)
        await asyncio.sleep(0.4)  # held past the database's statement timeout
        await lock.rollback()
        summary = await copy
    finally:
        await holder.close()
    assert (summary.copied, summary.busy, summary.failed) == (1, [], [])


async def _idle_past_or_ended(admin_url: str, database: str | None, past: timedelta) -> None:
    """Until the server has either ended the session of ``database`` that is idle in a
    transaction (its idle_in_transaction_session_timeout), or let it idle for longer
    than ``past`` by its own clock."""
    query = (
        "SELECT count(*) FILTER (WHERE clock_timestamp() - state_change > $2), count(*) "
        "FROM pg_stat_activity WHERE datname = $1 "
        "AND state = 'idle in transaction'"
    )
    conn = await asyncpg.connect(dsn(admin_url))
    try:
        async with asyncio.timeout(10):
            while True:
                idle_long, idle = await conn.fetchrow(query, database, past)
                if idle_long or not idle:
                    return
                await asyncio.sleep(0.01)  # polling the server until either is so
    finally:
        await conn.close()


async def test_an_idle_in_transaction_timeout_of_the_database_does_not_cut_a_copy(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    pg_url: str,
    admin_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An idle_in_transaction_session_timeout set on the database or the role (a managed
    server's parameter group) shorter than the import's own work between two statements
    of a copy (seconds, for an identity of hundreds of thousands of observations) ended
    the copy's session at every attempt: the run stopped there, and every rerun too."""
    await _seed_good(redis_client, redis_prefix, "bob")
    database = make_url(pg_url).database
    setting = f"ALTER DATABASE \"{database}\" SET idle_in_transaction_session_timeout = '100ms'"
    holder = await asyncpg.connect(dsn(pg_url))
    try:
        await holder.execute(setting)
    finally:
        await holder.close()
    write_rollup = imports._write_rollup

    async def after_a_long_pause(conn: Any, identity_id: str, types: Any) -> None:
        # The client's work between two statements, past the database's timeout.
        await _idle_past_or_ended(admin_url, database, timedelta(milliseconds=300))
        await write_rollup(conn, identity_id, types)

    monkeypatch.setattr(imports, "_write_rollup", after_a_long_pause)
    summary = await _imported_once(redis_url, pg_url)
    assert (summary.copied, summary.busy, summary.bad) == (1, [], [])
    assert (await row_counts(pg_url))["redis_imports"] == 1


async def test_an_identity_copied_from_another_prefix_is_not_merged_into(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, pg_url: str
) -> None:
    """Two deployments under two prefixes, each with a user "ana": the second copy went
    into the first's identity without a word (its facts lost to the first's)."""
    other = f"{redis_prefix}eu:"
    for prefix in (redis_prefix, other):
        await _seed_good(redis_client, prefix, "ana")
    await _seed_good(redis_client, other, "bo")
    first = await _imported_once(redis_url, pg_url)
    target = PostgresStore.from_url(pg_url)
    source = RedisStore.from_url(redis_url, prefix=other)
    try:
        second = await import_redis(source, target, now=now)
    finally:
        await source.close()
        await target.close()
    assert (first.copied, second.copied, second.failed) == (1, 1, ["ana"])
    assert second.bad == [
        (
            f"{other}*:ana",
            f"not copied: copied from the prefix {redis_prefix!r} already (two deployments' "
            "users of one name would become one; copy this prefix into a schema of its own, "
            "--schema)",
        )
    ]
    counts = await row_counts(pg_url)
    assert (counts["observations"], counts["redis_imports"]) == (2, 2)  # ana's, and bo's


def test_a_prefix_that_finds_nothing_says_so(redis_url: str) -> None:
    """A prefix without its closing ':' (or the wrong database) copied nothing, exit 0,
    as if the copy had succeeded."""
    server, _ = split_prefix(redis_url)
    result = CliRunner().invoke(app, ["import-redis", server, "--dry-run", "--prefix", "none"])
    assert result.exit_code == 0, result.output
    assert "no identity found under the key prefix 'none' in redis://" in result.stderr
    assert "check --prefix" in result.stderr


async def test_the_command_says_which_identity_redis_timed_out_on(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The command line printed any TimeoutError as "timed out", the identity and the
    remedy lost."""
    await _seed_good(redis_client, redis_prefix, "whale")

    async def slow(store: RedisStore, identity: str, sink: Any) -> Any:
        raise redis.exceptions.TimeoutError("Timeout reading from 127.0.0.1:6379")

    monkeypatch.setattr(redis_to_postgres, "stream_identity", slow)
    result = await asyncio.to_thread(
        CliRunner().invoke, app, ["import-redis", redis_url, "--url", pg_url]
    )
    assert result.exit_code == 1
    assert "error: timed out: Redis did not answer within its socket timeout while the " in (
        result.stderr
    )
    assert "identity whale was read" in result.stderr


async def test_a_schema_behind_the_latest_migration_is_named_before_anything_is_read(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, empty_pg_url: str
) -> None:
    """At 0017 the copy failed with "UndefinedColumnError: column bad_records does not
    exist", and the dry run said the target was fine."""
    await _seed_good(redis_client, redis_prefix, "ana")
    await migrate_async(empty_pg_url, revision="0017")
    for dry in ([], ["--dry-run"]):
        result = await asyncio.to_thread(
            CliRunner().invoke, app, ["import-redis", redis_url, "--url", empty_pg_url, *dry]
        )
        assert result.exit_code == 1, result.output
        assert result.stderr == (
            f"error: schema coda_memory is at revision 0017, and import-redis needs {HEAD}: "
            "run coda-memory migrate\n"
        )


def test_a_user_the_server_refuses_a_command_stops_the_run_naming_it(pg_url: str) -> None:
    """An ACL user that may read but not run MULTI: every identity was left out as "a
    key of the wrong type" (NOPERM is a ResponseError, as WRONGTYPE is), exit 1 after a
    whole run of misleading lines."""
    with contextlib.contextmanager(_own_server)() as server:
        client = redis.Redis.from_url(server)
        try:
            client.acl_setuser(
                "reader",
                enabled=True,
                passwords=["+r3ader"],
                keys=["*"],
                commands=["+@read", "+@connection", "+scan"],
            )
            client.hset("coda:memory:facts:bob", "fact:tool_affinity:t", fact("bob", "t", 0.5, 1))
        finally:
            client.close()
        reader = server.replace("redis://", "redis://reader:r3ader@", 1)
        result = CliRunner().invoke(app, ["import-redis", reader, "--url", pg_url])
    assert result.exit_code == 1, result.output
    assert "NoPermissionError: this user has no permissions to run the 'multi' command" in (
        result.stderr
    )
    assert "wrong type" not in result.output
    assert asyncio.run(row_counts(pg_url))["redis_imports"] == 0


@pytest.mark.parametrize(
    ("given", "bad"),
    [("url", "\x00"), ("option", "\x00"), ("option", "\udcff")],
    ids=["nul in the url", "nul in --prefix", "not utf-8 in --prefix"],
)
def test_a_prefix_the_ledger_cannot_hold_is_a_usage_error(
    redis_url: str, redis_prefix: str, pg_url: str, given: str, bad: str
) -> None:
    """A prefix with a NUL or bytes that are not UTF-8 stopped the run (its dry run too)
    with "CharacterNotInRepertoireError: invalid byte sequence …" or "UnicodeEncodeError:
    …" and exit 1, as if the store had failed: the ledger keeps the prefix as text."""
    server, _ = split_prefix(redis_url)
    prefix = f"{redis_prefix}{bad}:"
    if bad == "\x00":  # (one that Redis holds: the dry run found it and said nothing)
        client = redis.Redis.from_url(server)
        client.hset(f"{prefix}facts:bob", "fact:tool_affinity:t", fact("bob", "t", 0.5, 1))
        client.close()
    where = [f"{server}?prefix={quote(prefix)}"] if given == "url" else [server, "--prefix", prefix]
    for dry_run in (["--dry-run"], []):
        result = CliRunner().invoke(app, ["import-redis", *where, *dry_run, "--url", pg_url])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("error: invalid key prefix "), lines[0]
        assert "UTF-8" in lines[0] and "NUL" in lines[0], lines[0]
    assert asyncio.run(row_counts(pg_url))["redis_imports"] == 0


@contextlib.contextmanager
def _durable_run(redis_url: str, redis_prefix: str, identities: int) -> Iterator[str]:
    """``identities`` identities (``u0``, ``u1``, …) of one observation each under
    ``redis_prefix``, and the URL of a migrated Postgres server of the test's own whose
    WAL writer flushes once every 10 s and on which nothing else writes WAL meanwhile (no
    autovacuum; no standby snapshots, which wal_level minimal does without): what a run
    leaves unflushed stays so while the test looks."""
    server, _ = split_prefix(redis_url)
    client = redis.Redis.from_url(server)
    for identity in (f"u{n}" for n in range(identities)):
        client.zadd(f"{redis_prefix}obs:{identity}", {observation(identity, "1", 1, "t"): ms(1)})
    client.close()
    with own_postgres(
        wal_writer_delay="10s",
        wal_writer_flush_after="1GB",
        autovacuum="off",
        wal_level="minimal",
        max_wal_senders="0",
    ) as pg:
        assert CliRunner().invoke(app, ["migrate", "--url", pg]).exit_code == 0
        yield pg


def test_the_copies_a_run_reports_are_durable_when_it_ends(
    redis_client: aioredis.Redis, redis_url: str, redis_prefix: str
) -> None:
    """The copies commit with synchronous_commit off, and the run ended with the last of
    them unflushed: it reported them copied (exit 0), and a crash or a failover right
    after took them back, ledger rows and all, with nothing to say a rerun was needed
    (the servers start on Postgres next)."""
    with _durable_run(redis_url, redis_prefix, 10) as pg:
        result = CliRunner().invoke(app, ["import-redis", redis_url, "--url", pg, "-f", "json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["copied"] == 10
        assert not asyncio.run(unflushed(pg))
        assert asyncio.run(row_counts(pg))["redis_imports"] == 10


def test_the_copies_are_durable_when_the_ledger_row_it_rewrites_is_gone(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run's last write, which makes its copies durable, rewrote the ledger row of
    one identity it copied: one that a forget erased meanwhile matched no row, the
    transaction wrote nothing and its commit waited for nothing, and the run ended with
    its copies unflushed all the same."""
    settle = imports.settle_copies

    async def erased_first(target: PostgresStore) -> None:
        async with target.engine.connect() as conn:
            raw = await driver_connection(conn)
            async with raw.transaction():  # (not flushed either)
                await raw.execute("SET LOCAL synchronous_commit = off")
                await raw.execute(
                    f'DELETE FROM "{target.schema}".redis_imports WHERE identity_id = $1', "u3"
                )
        await settle(target)

    monkeypatch.setattr(redis_to_postgres, "settle_copies", erased_first)
    with _durable_run(redis_url, redis_prefix, 4) as pg:
        result = CliRunner().invoke(app, ["import-redis", redis_url, "--url", pg, "-f", "json"])
        assert result.exit_code == 0, result.output
        assert not asyncio.run(unflushed(pg))
        assert asyncio.run(row_counts(pg))["redis_imports"] == 3


def test_the_copies_are_durable_when_no_ledger_row_of_the_source_is_left(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forget of every identity the run copied (here its one) erased the ledger rows
    the run's last write could rewrite: it wrote nothing, its commit waited for nothing,
    and the run ended with the copies and the erasure unflushed."""
    settle = imports.settle_copies

    async def erased(target: PostgresStore) -> None:
        async with target.engine.connect() as conn:
            raw = await driver_connection(conn)
            async with raw.transaction():  # (not flushed either)
                await raw.execute("SET LOCAL synchronous_commit = off")
                await raw.execute(f'DELETE FROM "{target.schema}".redis_imports')
        await settle(target)

    monkeypatch.setattr(redis_to_postgres, "settle_copies", erased)
    with _durable_run(redis_url, redis_prefix, 1) as pg:
        result = CliRunner().invoke(app, ["import-redis", redis_url, "--url", pg, "-f", "json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["copied"] == 1
        assert not asyncio.run(unflushed(pg))
        assert asyncio.run(row_counts(pg))["redis_imports"] == 0


async def test_a_live_consolidation_is_not_held_off_while_the_import_reads_redis(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The import reads an identity from Redis within its copy's transaction, which took
    the identity's checkpoint lock first: a live server on Postgres (which the README
    allows during an import) could not consolidate the identity for the whole read (one
    of 300,000 observations took 35 to 57 s). The lock is taken once the read is done."""
    await _seed_good(redis_client, redis_prefix, "bob")
    await _served_live(pg_url, "bob")
    live: list[str] = []
    read = stream_identity

    async def consolidated_meanwhile(store: RedisStore, identity: str, sink: Any) -> Any:
        conn = await asyncpg.connect(dsn(pg_url))
        try:
            async with conn.transaction():
                await conn.execute("SET LOCAL lock_timeout = '200ms'")
                try:
                    await conn.execute(
                        "SELECT 1 FROM coda_memory.checkpoints WHERE identity_id = 'bob' FOR UPDATE"
                    )
                    live.append("locked")
                except asyncpg.LockNotAvailableError:
                    live.append("held off")
        finally:
            await conn.close()
        return await read(store, identity, sink)

    monkeypatch.setattr(redis_to_postgres, "stream_identity", consolidated_meanwhile)
    summary = await _imported_once(redis_url, pg_url)
    assert live == ["locked"]
    assert (summary.copied, summary.observations, summary.busy) == (1, 1, [])


async def test_an_identity_another_run_copies_during_the_read_is_copied_once(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two runs at once: the one whose read ends second finds the identity in the ledger
    once it holds the identity's lock, and takes back what it wrote, so nothing is copied
    twice."""
    await _seed_good(redis_client, redis_prefix, "bob")
    read = stream_identity
    runs: list[ImportSummary] = []

    async def another_run_meanwhile(store: RedisStore, identity: str, sink: Any) -> Any:
        if not runs:
            runs.append(ImportSummary())
            runs[0] = await _imported_once(redis_url, pg_url)
        return await read(store, identity, sink)

    monkeypatch.setattr(redis_to_postgres, "stream_identity", another_run_meanwhile)
    summary = await _imported_once(redis_url, pg_url)
    assert (runs[0].copied, runs[0].observations) == (1, 1)
    assert (summary.copied, summary.skipped, summary.observations) == (0, 1, 0)
    counts = await row_counts(pg_url)
    assert (counts["observations"], counts["redis_imports"]) == (1, 1)


def test_a_rerun_that_only_skips_makes_the_copies_of_a_killed_run_durable(
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run killed before its last write left its copies committed but unflushed; a rerun
    found every identity in the ledger and skipped it, and, having copied none, wrote
    nothing: it reported them all copied by an earlier run while a crash right after still
    took them back."""

    async def killed_first(target: PostgresStore) -> None:
        pass

    with _durable_run(redis_url, redis_prefix, 3) as pg:
        monkeypatch.setattr(redis_to_postgres, "settle_copies", killed_first)
        first = CliRunner().invoke(app, ["import-redis", redis_url, "--url", pg, "-f", "json"])
        assert first.exit_code == 0, first.output
        assert asyncio.run(unflushed(pg))
        monkeypatch.undo()
        rerun = CliRunner().invoke(app, ["import-redis", redis_url, "--url", pg, "-f", "json"])
        assert rerun.exit_code == 0, rerun.output
        assert (json.loads(rerun.stdout)["copied"], json.loads(rerun.stdout)["skipped"]) == (0, 3)
        assert not asyncio.run(unflushed(pg))
        assert asyncio.run(row_counts(pg))["redis_imports"] == 3
