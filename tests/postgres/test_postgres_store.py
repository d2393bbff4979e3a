"""PostgresStore beyond the store contract: poison rows, the stored anchor, schemas, URLs."""

from __future__ import annotations

import asyncio
import collections
import math
import weakref
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, cast

import asyncpg
import pytest
from sqlalchemy.exc import DBAPIError

from coda_memory import MemoryService
from coda_memory.core.consolidation import plan_consolidation
from coda_memory.core.decay import ExponentialDecay
from coda_memory.core.model import ObservationType
from coda_memory.core.turns import SLICE
from coda_memory.errors import SchemaNotMigrated
from coda_memory.postgres import PostgresStore
from coda_memory.postgres import append as append_module
from coda_memory.postgres import documents as documents_module
from coda_memory.postgres import rows as rows_module
from coda_memory.postgres import unit as unit_module
from coda_memory.postgres.connection import LOCK_NOT_AVAILABLE, sqlstate
from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.migrate import migrate_async
from coda_memory.postgres.schema import metadata
from tests.helpers import LoopTurns
from tests.postgres.helpers import (
    NOW,
    consolidate,
    contents,
    dsn,
    event,
    fact,
    fetch,
    plan,
    record,
)


async def test_append_stores_the_batch_in_order(pg_store: PostgresStore) -> None:
    batch = [
        record("first", metadata={"toolName": "get_account", "durationMs": 12}),
        record("second", session_id=None, type=ObservationType.QUERY_PATTERN),
        record("third", created_at=NOW.astimezone(UTC) - timedelta(hours=1)),
    ]

    outcome = await pg_store.append(batch)

    assert outcome.stored == 3
    assert outcome.refused == []
    stored = await pg_store.observations("alice")
    assert contents(stored) == ["first", "second", "third"]
    assert [o.id for o in stored] == sorted(o.id for o in stored)
    assert stored[0].metadata == {"toolName": "get_account", "durationMs": 12}
    assert stored[1].session_id is None
    assert stored[1].type is ObservationType.QUERY_PATTERN
    assert stored[2].created_at == NOW - timedelta(hours=1)
    assert all(o.created_at.tzinfo is UTC for o in stored)


async def test_values_travel_exactly_and_a_hidden_nan_is_refused(
    pg_store: PostgresStore,
) -> None:
    # The batch's JSON document writes NaN and the infinities as null: the rows holding
    # one are refused, while a real null (a None value, no session) is stored as one.
    plus_two = timezone(timedelta(hours=2))
    naive = datetime(2026, 3, 1, 12, 30, 15, 123456)  # local time, as the driver takes it
    exact = {"toolName": "get_account", "durationMs": 0.1 + 0.2, "big": 2**63 - 1}
    batch = [
        record("exact", metadata=exact, created_at=NOW.astimezone(plus_two)),
        record("inf", metadata={"toolName": "t", "x": [1, {"y": float("inf")}]}),
        record("none", metadata={"toolName": "t", "error": None}, session_id=None),
        record("naive", created_at=naive),
        record("minus inf", metadata={"toolName": "t", "durationMs": float("-inf")}),
    ]

    outcome = await pg_store.append(batch)

    assert outcome.stored == 3
    assert [index for index, _ in outcome.refused] == [1, 4]
    assert all("NaN" in reason for _, reason in outcome.refused)
    stored = {o.content: o for o in await pg_store.observations("alice")}
    assert stored["exact"].metadata == exact
    assert stored["exact"].created_at == NOW
    assert stored["none"].metadata == {"toolName": "t", "error": None}
    assert stored["none"].session_id is None
    assert stored["naive"].created_at == naive.astimezone(UTC)


async def test_text_that_only_reads_like_an_escaped_nul_is_stored_as_it_is(
    pg_store: PostgresStore,
) -> None:
    # JSON writes a NUL as \\u0000; a backslash followed by "u0000" is not one.
    literal = "a \\u0000 and a \\\\u0000"
    batch = [record(literal, metadata={"toolName": "get_account", literal: literal})]

    outcome = await pg_store.append(batch)

    assert (outcome.stored, outcome.refused) == (1, [])
    [stored] = await pg_store.observations("alice")
    assert stored.content == literal
    assert stored.metadata == {"toolName": "get_account", literal: literal}


async def test_a_batch_larger_than_one_document_goes_in_parts_in_order(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []
    documents = append_module._documents

    def recorded(rows: Any, text: str | None = None) -> list[str]:
        parts = documents(rows, text)
        sent.extend(parts)
        return parts

    monkeypatch.setattr(append_module, "MAX_DOCUMENT_CHARS", 1_000)
    monkeypatch.setattr(append_module, "_documents", recorded)
    batch = [record(f"observation {i:02} " + "x" * 200) for i in range(20)]

    outcome = await pg_store.append(batch)

    assert (outcome.stored, outcome.refused) == (20, [])
    assert len(sent) > 4
    assert all(len(part) <= 1_000 for part in sent)
    assert contents(await pg_store.observations("alice")) == [r.content for r in batch]


async def test_append_of_nothing_stores_nothing(pg_store: PostgresStore) -> None:
    assert (await pg_store.append([])).stored == 0


@pytest.mark.parametrize("slice_size", [None, 3, 2], ids=["one slice", "slices of 3", "of 2"])
async def test_poison_rows_are_refused_and_every_good_row_is_stored(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch, slice_size: int | None
) -> None:
    if slice_size is not None:
        # Encoded in slices: with 2, the rows 4 and 5 make a slice of refused rows only.
        monkeypatch.setattr(append_module, "SLICE", slice_size)
    poison = {
        1: record("nul \x00 byte"),  # the server refuses NUL in text
        4: record("lone \udc80 surrogate"),  # cannot be encoded as UTF-8
        5: record("jsonb refuses \\u0000", metadata={"note": "a\x00b"}),
        7: record("check", type=cast(ObservationType, "not_a_type")),
        8: record("not json", metadata={"value": float("nan")}),
        10: record("nul in session", session_id="s\x00"),
    }
    batch = [poison.get(i) or record(f"good {i}") for i in range(12)]

    outcome = await pg_store.append(batch)

    assert [index for index, _ in outcome.refused] == sorted(poison)
    assert outcome.stored == 12 - len(poison)
    for _, reason in outcome.refused:
        assert reason
        assert "\n" not in reason
    reasons = dict(outcome.refused)
    assert "0x00" in reasons[1]
    assert "ck_observations_type" in reasons[7]
    good = [f"good {i}" for i in range(12) if i not in poison]
    assert contents(await pg_store.observations("alice")) == good
    # Rows written under the bisection's savepoints carry the top-level transaction id.
    assert contents((await consolidate(pg_store)).observations) == good
    assert (await consolidate(pg_store)).observations == []


async def test_a_plan_is_written_exactly_floats_instants_and_non_finite_values_too(
    pg_store: PostgresStore,
) -> None:
    # The write takes the plan's facts and events as JSON documents of rows: a float
    # read back to its last bit, an instant to the microsecond whatever its offset, and
    # NaN and the infinities (which JSON has not) stored as an array parameter stored them.
    at = datetime(2026, 3, 1, 14, 30, 15, 123457, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    stored = fact(confidence=0.30000000000000004, at=at).model_copy(
        update={"ease_factor": 1e-300, "confidence_at": at + timedelta(microseconds=1)}
    )
    odd = event(at=at, session_id=None).model_copy(
        update={
            "confidence_before": math.nan,
            "ease_before": math.inf,
            "ease_after": -math.inf,
            "quality": 5e-324,
            "count_before": None,
        }
    )
    plain = event("domain_preference:royalty", at=at + timedelta(seconds=1))
    async with pg_store.consolidation("alice") as unit:
        await unit.load()
        await unit.write(plan(upserts=[stored], events=[odd, plain], consumed=0))
        await unit.commit()

    [read] = await pg_store.facts("alice")
    assert read.confidence == 0.30000000000000004 and read.ease_factor == 1e-300
    assert read.last_reinforced_at == at and read.confidence_at == at + timedelta(microseconds=1)
    first, second = await pg_store.history("alice")
    assert math.isnan(first.confidence_before or 0.0)
    assert (first.ease_before, first.ease_after) == (math.inf, -math.inf)
    assert first.quality == 5e-324 and first.count_before is None and first.session_id is None
    assert first.at == at and first.subject == "tool_affinity:get_account"
    assert second.model_dump(exclude={"id", "recorded_at"}) == plain.model_dump(
        exclude={"id", "recorded_at"}
    )


async def test_a_backlog_of_observations_is_read_into_models_with_turns_of_the_loop(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A held table leaves hundreds of observations waiting per identity; built in one
    # go, the models of each load at the release held the loop for milliseconds.
    assert (await pg_store.append([record(f"row {i}") for i in range(2_000)])).stored == 2_000
    built = 0
    convert = rows_module.observation_from_row

    def counted(identity_id: str, row: Any) -> Any:
        nonlocal built
        built += 1
        return convert(identity_id, row)

    monkeypatch.setattr(unit_module, "observation_from_row", counted, raising=True)
    seen: set[int] = set()  # how many were built, as other tasks saw it at each turn

    async def ticker() -> None:
        while True:
            seen.add(built)
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(ticker())
    async with pg_store.consolidation("alice") as unit:
        batch = await unit.load()
    task.cancel()

    assert [o.content for o in batch.observations] == [f"row {i}" for i in range(2_000)]
    between = {n for n in seen if 0 < n < 2_000}
    assert len(between) >= 2_000 // SLICE - 1, sorted(seen)


async def test_a_large_plan_is_written_from_rows_made_with_turns_of_the_loop(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plan of a backlog: made in one go, the rows of its facts and events held the
    # loop for milliseconds, at the release of a held table, for every load in flight.
    batch = [record(f"call {i}", metadata={"toolName": f"tool_{i:04}"}) for i in range(1_000)]
    assert (await pg_store.append(batch)).stored == 1_000
    made = 0
    fact_row, event_row = documents_module.fact_row, documents_module.event_row

    def counted(convert: Any) -> Any:
        def count(item: Any) -> Any:
            nonlocal made
            made += 1
            return convert(item)

        return count

    monkeypatch.setattr(unit_module, "fact_row", counted(fact_row))
    monkeypatch.setattr(unit_module, "event_row", counted(event_row))
    seen: set[int] = set()  # how many rows were made, as other tasks saw it at each turn

    async def ticker() -> None:
        while True:
            seen.add(made)
            await asyncio.sleep(0)

    async with pg_store.consolidation("alice") as unit:
        loaded = await unit.load()
        plan = plan_consolidation("alice", loaded, NOW, ExponentialDecay())
        task = asyncio.get_running_loop().create_task(ticker())
        await asyncio.sleep(0)
        await unit.write(plan)
        task.cancel()
        await unit.commit()

    rows = len(plan.upserts) + len(plan.events)
    assert (len(plan.upserts), made) == (1_000, rows)
    between = {n for n in seen if 0 < n < rows}
    assert len(between) >= rows // SLICE - 1, sorted(seen)
    stored = await pg_store.facts("alice")
    assert sorted(f.subject for f in stored) == sorted(f.subject for f in plan.upserts)


async def test_a_backlogs_observations_and_history_are_freed_with_turns_of_the_loop(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An identity that wrote 100,000 observations with no load: its consolidation's
    observations and history (about one event an observation), freed each in one go as
    the consolidation returned, stalled the loop for 50 to 140 ms. They are freed SLICE
    at a time, other tasks running between."""
    calls = [(s, k) for s in range(400) for k in range(5)]
    batch = [
        record(f"call {k}", metadata={"toolName": f"tool_{k}"}, session_id=f"s{s}")
        for s, k in calls
    ]
    store = PostgresStore.from_url(pg_url)
    service = MemoryService(store, clock=lambda: NOW)
    turns = LoopTurns()
    freed: list[int] = []  # the turn in which each observation or event was freed
    held: list[weakref.ref[Any]] = []

    def watched(made: Any) -> Any:
        held.append(weakref.ref(made, lambda _: freed.append(turns.count)))
        return made

    convert = rows_module.observation_from_row
    monkeypatch.setattr(unit_module, "observation_from_row", lambda *args: watched(convert(*args)))
    planning = service._planning

    def watched_plan(*args: Any) -> Any:
        plan = yield from planning(*args)
        for made in plan.events:
            watched(made)
        return plan

    service._planning = watched_plan  # type: ignore[method-assign,assignment]

    try:
        assert (await store.append(batch)).stored == 2_000
        async with turns:
            facts = await service.consolidate("alice")
    finally:
        await service.close()

    assert len(facts) == 5
    assert len(held) == 4_000 and len(freed) == 4_000  # 2,000 of each, all freed
    assert max(collections.Counter(freed).values()) <= SLICE, collections.Counter(freed)


async def test_a_large_batch_is_encoded_in_slices_with_turns_of_the_loop() -> None:
    # The same rows, places, refusals and document as encoded at once, and other tasks
    # run between the slices (a batch of 5,000 takes about 10 ms to encode).
    batch = [record(f"row {i}", metadata={"toolName": "t", "n": i}) for i in range(2_000)]
    batch[700] = record("nul \x00 byte")
    batch[1_499] = record("not json", metadata={"value": float("nan")})

    async with LoopTurns() as turns:
        await asyncio.sleep(0)
        before = turns.count
        encoded = await append_module.encode(batch)
        after = turns.count

    assert after - before >= len(batch) // SLICE - 1
    rows, refused, text = append_module._encode(batch)
    assert (encoded.rows, encoded.refused, encoded.text) == (rows, refused, text)
    assert encoded.total == 2_000
    assert [index for index, _ in encoded.refused] == [700, 1_499]


async def test_a_batch_of_only_poison_stores_nothing(pg_store: PostgresStore) -> None:
    outcome = await pg_store.append([record("\x00"), record("\x00\x00")])

    assert outcome.stored == 0
    assert [index for index, _ in outcome.refused] == [0, 1]
    assert await pg_store.observations("alice") == []


async def test_facts_are_stored_with_their_anchor(pg_store: PostgresStore) -> None:
    anchored = fact("tool_affinity:a", confidence_at=NOW + timedelta(days=1), ease_factor=2.5)
    plain = fact("entity_frequency:account:42", confidence=0.75, count=3)
    await pg_store.append([record()])
    async with pg_store.consolidation("alice") as unit:
        await unit.load()
        await unit.write(plan(upserts=[anchored, plain], consumed=1))
        await unit.commit()

    stored = {f.subject: f for f in await pg_store.facts("alice")}

    assert stored["tool_affinity:a"] == anchored
    # The anchor is always stored: None reads back as last_reinforced_at.
    assert stored["entity_frequency:account:42"] == plain.model_copy(
        update={"confidence_at": plain.last_reinforced_at}
    )
    assert stored["entity_frequency:account:42"].id == "fact:entity_frequency:account:42"


TRICKY_IDENTITIES = ["a'; DROP TABLE x; --", "%", "_", "A", "a", "a%", "a\\", ""]


async def test_tricky_identity_ids_are_bound_not_interpolated(pg_store: PostgresStore) -> None:
    # That each is compared exactly is in the store contract; here: no table was harmed.
    for identity in TRICKY_IDENTITIES:
        await pg_store.append([record(f"obs of {identity!r}", identity_id=identity)])
        await consolidate(pg_store, identity, upserts=[fact(identity_id=identity)])
    await pg_store.forget("%")

    tables = await fetch(
        pg_store.engine.url.render_as_string(hide_password=False),
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'coda_memory'",
    )
    assert tables == [(len(metadata.tables) + 1,)]  # and alembic_version


async def test_a_custom_schema_holds_everything(empty_pg_url: str) -> None:
    await migrate_async(empty_pg_url, schema="tenant_one")
    store = PostgresStore.from_url(empty_pg_url, schema="tenant_one")
    try:
        await store.append([record("in tenant_one")])
        loaded = await consolidate(store, upserts=[fact()])
        assert contents(loaded.observations) == ["in tenant_one"]
        assert [f.subject for f in await store.facts("alice")] == [fact().subject]
    finally:
        await store.close()

    rows = await fetch(
        empty_pg_url,
        "SELECT count(*) FROM tenant_one.observations WHERE content = :content",
        content="in tenant_one",
    )
    assert rows == [(1,)]
    assert await fetch(
        empty_pg_url, "SELECT count(*) FROM pg_namespace WHERE nspname = 'coda_memory'"
    ) == [(0,)]


async def test_the_default_schema_is_not_migrated_by_a_custom_one(empty_pg_url: str) -> None:
    await migrate_async(empty_pg_url, schema="tenant_one")
    store = PostgresStore.from_url(empty_pg_url)
    try:
        with pytest.raises(SchemaNotMigrated, match="coda_memory"):
            await store.facts("alice")
    finally:
        await store.close()


async def test_an_unmigrated_database_raises_schema_not_migrated(empty_pg_url: str) -> None:
    store = PostgresStore.from_url(empty_pg_url)
    try:
        with pytest.raises(SchemaNotMigrated):
            await store.append([record()])
        with pytest.raises(SchemaNotMigrated):
            await store.facts("alice")
        with pytest.raises(SchemaNotMigrated):
            await store.history("alice")
        with pytest.raises(SchemaNotMigrated):
            await store.forget("alice")
        with pytest.raises(SchemaNotMigrated):
            async with store.consolidation("alice"):
                pass
    finally:
        await store.close()


def test_invalid_schema_names_are_refused() -> None:
    for bad in ("coda-memory", "x; DROP TABLE y", "Upper", "pg_catalog", "1abc", "", "a" * 64):
        with pytest.raises(ValueError, match="schema name"):
            PostgresStore.from_url("postgresql://localhost/db", schema=bad)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:p@db.example:5433/app",
        "postgres://u:p@db.example:5433/app",
        "postgresql+asyncpg://u:p@db.example:5433/app",
    ],
)
def test_urls_are_normalised_to_asyncpg(url: str) -> None:
    normalised = asyncpg_url(url)

    assert normalised.drivername == "postgresql+asyncpg"
    assert (normalised.host, normalised.port, normalised.database) == ("db.example", 5433, "app")


def test_unix_socket_and_sslmode_urls() -> None:
    socket = asyncpg_url("postgresql://postgres:@/postgres?host=/tmp/pg dir")
    assert socket.query == {"host": "/tmp/pg dir"}
    assert socket.host is None
    assert asyncpg_url("postgresql://h/db?sslmode=require").query == {"ssl": "require"}
    with pytest.raises(ValueError, match="mysql"):
        asyncpg_url("mysql://h/db")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresql://u:p@ss@db.example/app", "must be written %40"),
        # Read as host 'ss' and database 'word@db.example/app': a piece of the password
        # named the host.
        ("postgresql://u:pa@ss/word@db.example/app", "password .* must be percent-encoded"),
        ("postgresql://u:pa@ss/word@db.example:5432/app", "an '@' written %40 and a '/' %2F"),
        ("postgresql://u@db.example:99999/app", "from 1 to 65535, not 99999"),
        ("postgresql://u@db.example:0/app", "from 1 to 65535, not 0"),
        ("postgresql://u@/app?host=h1,h2&port=1,abc", "from 1 to 65535, not 'abc'"),
        ("postgresql://u@/app?host=h1,h2&port=5432,70000", "from 1 to 65535, not '70000'"),
        ("postgresql://u@db.example/app?foo=bar", "unknown URL parameter 'foo'"),
        # A negative cache size made SQLAlchemy's cache spin on the event loop for ever.
        (
            "postgresql://u@db.example/app?prepared_statement_cache_size=-5",
            "'prepared_statement_cache_size' must be a whole number, not '-5'",
        ),
        # A bare TypeError at start(), whatever the value.
        ("postgresql://u@db.example/app?statement_cache_size=0", "pass connect_args="),
        # The store replaced them with its own options without a word, and migrate failed
        # on them with "unsupported operand type(s) for +: 'float' and 'str'".
        ("postgresql://u@db.example/app?timeout=5", "pass the store's connect_timeout="),
        ("postgresql://u@db.example/app?command_timeout=5", "store's command_timeout="),
        # "false" is a true string: direct TLS went on.
        ("postgresql://u@db.example/app?direct_tls=false", "pass connect_args="),
        ("postgresql://u@db.example/app?server_settings=x", "pass connect_args="),
        # Each became "cannot reach the database" at start(), and memory silently off.
        ("postgresql://u@db.example/app?sslmode=bogus", "'sslmode' must be one of disable"),
        ("postgresql://u@db.example/app?ssl=true", "'ssl' must be one of disable"),
        ("postgresql://u@db.example/app?target_session_attrs=x", "must be one of any, primary"),
        ("postgresql://u@db.example/app?ssl=require&ssl=disable", "given more than once"),
    ],
)
def test_urls_the_driver_would_refuse_on_connecting_are_refused_first(
    url: str, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        asyncpg_url(url)
    # What the driver takes still passes: an encoded '@', its parameters, libpq's sslmode.
    encoded = asyncpg_url("postgresql://u:p%40ss@db.example:65535/app?sslmode=require&krbsrvname=k")
    assert (encoded.password, encoded.host, encoded.port) == ("p@ss", "db.example", 65535)
    slashed = asyncpg_url("postgresql://u:pa%40ss%2Fword@db.example/a%40b")
    assert (slashed.password, slashed.host, slashed.database) == ("pa@ss/word", "db.example", "a@b")
    socket = asyncpg_url("postgresql://u:pa%40ss@/app?host=/var/run/postgresql")
    assert (socket.password, socket.host, socket.query["host"]) == (
        "pa@ss",
        None,
        "/var/run/postgresql",
    )
    ipv6 = asyncpg_url("postgresql://u:pa%2Fss@[::1]:5433/app")
    assert (ipv6.password, ipv6.host, ipv6.port, ipv6.database) == ("pa/ss", "::1", 5433, "app")
    hosts = asyncpg_url("postgresql://u@/app?host=h1,h2&port=5432,5433")
    assert (hosts.query["host"], hosts.query["port"]) == ("h1,h2", "5432,5433")


@pytest.mark.parametrize(
    "query",
    [
        "host=h1:5432&host=h2:5432",  # SQLAlchemy's multi-host form
        "ssl=verify_full",
        "sslmode=verify-ca&target_session_attrs=read-write",
        "prepared_statement_cache_size=0&passfile=/run/pgpass",
    ],
)
def test_urls_the_driver_takes_are_taken(query: str) -> None:
    assert asyncpg_url(f"postgresql://u@/app?{query}").drivername == "postgresql+asyncpg"


async def test_an_error_raised_to_the_host_carries_no_statement_parameter(
    empty_pg_url: str,
) -> None:
    """SQLAlchemy's errors ended with "[parameters: ('alice.secret@example.com',)]": a
    host that logs what ``facts``, ``history`` or ``forget`` raise logged the identity."""
    secret = "alice.secret@example.com"
    store = PostgresStore.from_url(empty_pg_url)
    try:
        for call in (store.facts, store.history, store.forget):
            with pytest.raises(SchemaNotMigrated) as raised:
                await call(secret)
            chain: list[BaseException] = []
            error: BaseException | None = raised.value
            while error is not None:
                chain.append(error)
                error = error.__cause__ or error.__context__
            assert len(chain) > 1, "the driver's error is chained"
            assert not [e for e in chain if secret in str(e)], call
    finally:
        await store.close()


@pytest.mark.parametrize("subject", ["entity_frequency:account:ann\x00", "tool_affinity:\ud800"])
async def test_a_subject_no_stored_fact_can_hold_finds_no_history(
    pg_url: str, subject: str
) -> None:
    # The driver refused to encode it, and its error quoted the value (an entity id).
    service = MemoryService.from_url(pg_url)
    try:
        assert await service.history("alice", subject) == []
    finally:
        await service.close()


@pytest.mark.parametrize(("table", "call"), [("facts", "facts"), ("fact_events", "history")])
async def test_facts_and_history_wait_for_a_locked_table_at_most_the_lock_timeout(
    pg_url: str, table: str, call: str
) -> None:
    """They waited as long as the table was held: more than ten minutes in an audit."""
    store = PostgresStore.from_url(pg_url, lock_timeout=timedelta(milliseconds=300))
    holder = await asyncpg.connect(dsn(pg_url))
    try:
        await holder.execute("BEGIN")
        await holder.execute(f"LOCK TABLE coda_memory.{table} IN ACCESS EXCLUSIVE MODE")
        async with asyncio.timeout(10):
            with pytest.raises(DBAPIError) as raised:
                await getattr(store, call)("alice")
        assert sqlstate(raised.value) == LOCK_NOT_AVAILABLE
        await holder.execute("ROLLBACK")
        assert await getattr(store, call)("alice") == []
    finally:
        await holder.close()
        await store.close()
