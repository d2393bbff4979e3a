"""Exactly-once consolidation on Postgres under concurrency, late commits, clock skew,
killed connections and locks. Every test uses real separate connections."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from asyncpg.transaction import Transaction

from coda_memory import Fact, FactEventKind, MemoryService
from coda_memory.core.caps import LogThrottle
from coda_memory.errors import StoreBusy
from coda_memory.postgres import store as store_module
from coda_memory.postgres.unit import PostgresConsolidationUnit
from tests.helpers import T0, FakeClock, domain, entity, tool_failed, tool_ok
from tests.postgres.helpers import dsn

#: On both event loops (see tests/conftest.py).
pytestmark = [pytest.mark.postgres, pytest.mark.both_loops]


@pytest.fixture
async def admin(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(dsn(pg_url))
    yield connection
    await connection.close()


def summary(facts: list[Fact]) -> list[tuple[str, int, float, object]]:
    return [
        (f.subject, f.reinforcement_count, round(f.confidence, 12), f.last_reinforced_at)
        for f in facts
    ]


def emit_sessions(service: MemoryService, identity: str, sessions: range) -> None:
    for i in sessions:
        session = f"s{i}"
        service.emit_observation(identity, tool_ok("get_account", session))
        service.emit_observation(identity, entity("account", str(i % 3), None, session))
        if i % 4 == 0:
            service.emit_observation(identity, tool_failed("run_query", session))
            service.emit_observation(identity, domain("royalty", session))


async def serial_result(clock: FakeClock, sessions: range) -> list[Fact]:
    """What one consolidation over the same observations gives on the in-memory store."""
    reference = MemoryService.from_url("memory://", clock=clock)
    emit_sessions(reference, "u1", sessions)
    await reference.drain()
    facts = await reference.consolidate("u1")
    await reference.close()
    return facts


async def test_32_concurrent_consolidations_from_4_services_give_the_serial_result(
    pg_url: str, clock: FakeClock
) -> None:
    services = [MemoryService.from_url(pg_url, clock=clock, pool_size=8) for _ in range(4)]
    try:
        emit_sessions(services[0], "u1", range(40))
        await services[0].drain()
        results = await asyncio.gather(*(services[i % 4].consolidate("u1") for i in range(32)))
        expected = summary(await serial_result(clock, range(40)))
        # Every run returns the facts as they are after the one that consumed the batch.
        for result in results:
            assert summary(result) == expected
        history = await services[1].history("u1")
        reinforcing = [e for e in history if e.kind is not FactEventKind.EXPIRED]
        assert len(reinforcing) == len({(e.subject, e.session_id) for e in reinforcing})
    finally:
        for service in services:
            await service.close()


async def test_observations_written_while_consolidations_loop_count_exactly_once(
    pg_url: str, clock: FakeClock
) -> None:
    writer = MemoryService.from_url(pg_url, clock=clock, batch_size=7)
    consolidators = [MemoryService.from_url(pg_url, clock=clock) for _ in range(2)]
    done = asyncio.Event()

    async def write() -> None:
        for i in range(300):
            writer.emit_observation("u1", tool_ok("t", session=f"s{i}"))
            if i % 10 == 0:
                await writer.drain()
        await writer.drain()
        done.set()

    seen: list[int] = []

    async def loop(service: MemoryService) -> None:
        while not done.is_set():
            facts = await service.consolidate("u1")
            seen.append(facts[0].reinforcement_count if facts else 0)

    try:
        await asyncio.gather(write(), *(loop(s) for s in consolidators))
        # Consolidations really ran while observations were arriving.
        assert len({count for count in seen if 0 < count < 300}) > 2
        (fact,) = await consolidators[0].consolidate("u1")
        assert fact.reinforcement_count == 300
        sessions = [e.session_id or "" for e in await writer.history("u1")]
        assert sorted(sessions) == sorted(f"s{i}" for i in range(300))
    finally:
        for service in (writer, *consolidators):
            await service.close()


async def test_an_observation_committed_during_a_consolidation_is_counted_next_time(
    pg_url: str, clock: FakeClock, admin: asyncpg.Connection
) -> None:
    service = MemoryService.from_url(pg_url, clock=clock)
    try:
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        # Another app server's transaction inserts an observation and stays open while
        # the consolidation runs.
        late = admin.transaction()
        await late.start()
        await admin.execute(
            "INSERT INTO coda_memory.observations "
            "(identity_id, type, content, metadata, session_id, created_at) "
            "VALUES ($1, 'tool_success', 'late', $2::jsonb, 's2', $3)",
            "u1",
            '{"toolName": "t"}',
            T0,
        )
        (fact,) = await service.consolidate("u1")
        assert fact.reinforcement_count == 1
        await late.commit()
        (fact,) = await service.consolidate("u1")
        assert fact.reinforcement_count == 2
        (fact,) = await service.consolidate("u1")
        assert fact.reinforcement_count == 2
    finally:
        await service.close()


async def test_an_observation_stamped_before_the_checkpoint_is_counted_once(
    pg_url: str, clock: FakeClock
) -> None:
    service = MemoryService.from_url(pg_url, clock=clock)
    try:
        clock.advance(days=1)
        service.emit_observation("u1", tool_ok("t", session="s1"))
        await service.drain()
        await service.consolidate("u1")
        clock.advance(hours=1)
        # A skewed app server stamps its observation a day before the last consolidation.
        service.emit_observation("u1", tool_ok("t", session="s2", at=T0))
        await service.drain()
        for _ in range(3):
            (fact,) = await service.consolidate("u1")
            assert fact.reinforcement_count == 2
    finally:
        await service.close()


@pytest.mark.parametrize("point", ["load", "write"])
async def test_connections_killed_mid_consolidation_never_leave_partial_state(
    pg_url: str,
    clock: FakeClock,
    admin: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
    point: str,
) -> None:
    """Every backend of the database is killed while a consolidation waits right after
    its reads (``load``) or after its write, before its commit (``write``), in two rounds
    of every three; a killed run that left anything behind, or whose retry counted a session
    again, would show in the final counts."""
    reached, go_on = asyncio.Event(), asyncio.Event()
    strike = {"armed": False}
    original = getattr(PostgresConsolidationUnit, point)

    async def parked(self: PostgresConsolidationUnit, *args: Any) -> Any:
        result = await original(self, *args)
        if strike["armed"]:  # once a round: a retry goes through
            strike["armed"] = False
            reached.set()
            await go_on.wait()
        return result

    monkeypatch.setattr(PostgresConsolidationUnit, point, parked)
    service = MemoryService.from_url(pg_url, clock=clock)
    database = await admin.fetchval("SELECT current_database()")
    rounds, struck, killed = 12, 0, 0
    try:
        for round_ in range(rounds):
            emit_sessions(service, "u1", range(round_ * 4, round_ * 4 + 4))
            await service.drain()
            clock.advance(hours=3)
            strike["armed"] = round_ % 3 != 2
            reached.clear()
            go_on.clear()
            task = asyncio.create_task(service.consolidate("u1"))
            if strike["armed"]:
                await asyncio.wait_for(reached.wait(), 10)
                terminated = await admin.fetchval(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "
                    "FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                    database,
                )
                assert terminated >= 1  # the consolidation's own backend among them
                struck += 1
                go_on.set()
            try:
                await task
            except Exception:
                killed += 1
        final = await service.consolidate("u1")
    finally:
        go_on.set()
        await service.close()
    assert (struck, killed) == (8, 8)  # every struck run failed: none was retried
    # A killed run that left anything behind would double count a session here.
    expected = MemoryService.from_url("memory://", clock=clock)
    for round_ in range(rounds):
        emit_sessions(expected, "u1", range(round_ * 4, round_ * 4 + 4))
    await expected.drain()
    counts = {f.subject: f.reinforcement_count for f in final}
    assert counts == {f.subject: f.reinforcement_count for f in await expected.consolidate("u1")}
    await expected.close()


def patient_service(pg_url: str, clock: FakeClock) -> MemoryService:
    """A service whose statement timeout is far beyond the tests' patience: only the table
    lock timeout can bring one of its loads back early."""
    return MemoryService.from_url(
        pg_url, clock=clock, load_timeout=5.0, statement_timeout=timedelta(seconds=60)
    )


async def consolidated_then_more(service: MemoryService, identity: str) -> None:
    """``identity`` consolidated with one fact (tool t), then one more observation stored."""
    service.emit_observation(identity, tool_ok("t"))
    await service.drain()
    await service.consolidate(identity)
    service.emit_observation(identity, tool_ok("u", session="s2"))
    await service.drain()


async def hold(admin: asyncpg.Connection, table: str) -> Transaction:
    """An ACCESS EXCLUSIVE lock on ``table`` in a transaction of ``admin``, held until
    the returned transaction is rolled back."""
    lock = admin.transaction()
    await lock.start()
    await admin.execute(f"LOCK TABLE coda_memory.{table} IN ACCESS EXCLUSIVE MODE")
    return lock


async def test_load_memory_under_an_access_exclusive_lock_answers_at_once_and_recovers(
    pg_url: str, clock: FakeClock, admin: asyncpg.Connection
) -> None:
    service = patient_service(pg_url, clock)
    try:
        service.emit_observation("u1", tool_ok("t"))
        await service.drain()
        lock = await hold(admin, "checkpoints")
        memory = await asyncio.wait_for(service.load_memory("u1"), 4)
        # Nothing consolidated yet, so no facts; the observation waits, unconsumed.
        assert (memory.facts, memory.prompt_section) == ([], "")
        assert (service.stats().load_timeouts, service.stats().load_errors) == (0, 0)
        await asyncio.wait_for(service.drain(), 4)  # no consolidation waits on the lock
        await lock.rollback()
        database = await admin.fetchval("SELECT current_database()")
        lingering = await admin.fetch(
            "SELECT state, backend_xid FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid() AND state <> 'idle'",
            database,
        )
        assert lingering == []
        locks = await admin.fetchval(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE a.datname = $1 AND a.pid <> pg_backend_pid()",
            database,
        )
        assert locks == 0
        # The next call consolidates what waited.
        memory = await service.load_memory("u1")
        assert [f.subject for f in memory.facts] == ["tool_affinity:t"]
    finally:
        await service.close()


@pytest.mark.parametrize("table", ["checkpoints", "observations"])
async def test_under_a_held_table_a_load_answers_from_the_stored_facts_at_once(
    pg_url: str,
    clock: FakeClock,
    admin: asyncpg.Connection,
    table: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A throttle of its own: the one-line-a-second limit of an earlier test can't hide it.
    monkeypatch.setattr(store_module, "_log", LogThrottle(logging.getLogger("coda_memory")))
    # u1's facts were made by another process: this one does not keep them.
    other = MemoryService.from_url(pg_url, clock=clock)
    try:
        await consolidated_then_more(other, "u1")
    finally:
        await other.close()
    service = patient_service(pg_url, clock)
    try:
        lock = await hold(admin, table)
        memory = await asyncio.wait_for(service.load_memory("u1"), 4)
        assert [f.subject for f in memory.facts] == ["tool_affinity:t"]
        assert list(memory.tool_affinities) == ["t"]
        assert (service.stats().load_timeouts, service.stats().load_errors) == (0, 0)
        assert (service.stats().peeks_held_out, service.stats().consolidations_held_out) == (
            1,
            0,
        )
        assert service.stats().facts_reads == 1  # the facts alone, none being kept
        said = [r.getMessage() for r in caplog.records if r.name == "coda_memory"]
        assert any("a table the peek reads is held" in line for line in said)
        await asyncio.wait_for(service.drain(), 4)
        await lock.rollback()
        # The observation that waited is consolidated by the next load.
        memory = await service.load_memory("u1")
        assert {f.subject for f in memory.facts} == {"tool_affinity:t", "tool_affinity:u"}
    finally:
        await service.close()


@pytest.mark.parametrize("table", ["checkpoints", "observations"])
@pytest.mark.parametrize("change", ["forgotten", "consolidated"])
async def test_under_a_held_table_the_kept_facts_do_not_answer_for_what_another_process_changed(
    pg_url: str, clock: FakeClock, admin: asyncpg.Connection, table: str, change: str
) -> None:
    """The peek held out reads the facts alone: the facts this process keeps, whose
    version it cannot check, would answer with a forgotten identity's facts, or without
    what another process consolidated, for as long as the table is held."""
    service = patient_service(pg_url, clock)
    other = patient_service(pg_url, clock)
    try:
        service.emit_observation("u1", tool_ok("t"))
        await service.drain()
        assert [f.subject for f in (await service.load_memory("u1")).facts] == ["tool_affinity:t"]
        if change == "forgotten":
            await other.forget("u1")
            expected: set[str] = set()
        else:
            other.emit_observation("u1", tool_ok("u", session="s2"))
            await other.drain()
            await other.consolidate("u1")
            expected = {"tool_affinity:t", "tool_affinity:u"}
        lock = await hold(admin, table)
        memory = await asyncio.wait_for(service.load_memory("u1"), 4)
        assert {f.subject for f in memory.facts} == expected
        assert service.stats().peeks_held_out == 1
        await lock.rollback()
    finally:
        await other.close()
        await service.close()


@pytest.mark.parametrize("traced", [False, True])
async def test_a_consolidation_a_held_table_keeps_out_raises_store_busy(
    pg_url: str, clock: FakeClock, admin: asyncpg.Connection, traced: bool
) -> None:
    """consolidate() whose peek a held table keeps out consolidates nothing: it returned
    the stored facts as if it had, and a host's batch job went on with the identity's
    observations pending. It raises StoreBusy, worth retrying; a load still answers."""
    from opentelemetry.sdk.trace import TracerProvider

    from coda_memory.telemetry import Telemetry

    telemetry = Telemetry(tracer_provider=TracerProvider()) if traced else None
    writer = patient_service(pg_url, clock)
    # Another process's service: it peeks first (it did not store the observations).
    service = MemoryService.from_url(
        pg_url,
        clock=clock,
        load_timeout=5.0,
        statement_timeout=timedelta(seconds=60),
        telemetry=telemetry,
    )
    try:
        await consolidated_then_more(writer, "u1")
        lock = await hold(admin, "checkpoints")
        with pytest.raises(StoreBusy, match="nothing was consolidated"):
            await asyncio.wait_for(service.consolidate("u1"), 4)
        memory = await asyncio.wait_for(service.load_memory("u1"), 4)
        assert [f.subject for f in memory.facts] == ["tool_affinity:t"]
        await lock.rollback()
        facts = await service.consolidate("u1")
        assert {f.subject for f in facts} == {"tool_affinity:t", "tool_affinity:u"}
    finally:
        await service.close()
        await writer.close()


async def test_a_peek_held_out_shows_in_the_trace(
    pg_url: str, clock: FakeClock, admin: asyncpg.Connection
) -> None:
    """A peek a held table keeps out answers from the facts alone and raises nothing: the
    consolidation's span looked like any other, and a trace never showed why a load
    left the newest observations out."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from coda_memory.telemetry import Telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    service = MemoryService.from_url(
        pg_url,
        clock=clock,
        load_timeout=5.0,
        statement_timeout=timedelta(seconds=60),
        telemetry=Telemetry(tracer_provider=provider),
    )
    try:
        service.emit_observation("u1", tool_ok("t"))
        await service.drain()
        await service.load_memory("u1")
        lock = await hold(admin, "checkpoints")
        await asyncio.wait_for(service.load_memory("u1"), 4)
        await lock.rollback()
    finally:
        await service.close()
    held = [
        span.attributes.get("coda_memory.held_out")
        for span in exporter.get_finished_spans()
        if span.name == "coda_memory.consolidate" and span.attributes is not None
    ]
    assert held == [None, ("peek",)]
    assert service.stats().peeks_held_out == 1


async def test_under_a_held_facts_table_the_kept_facts_answer(
    pg_url: str, clock: FakeClock, admin: asyncpg.Connection
) -> None:
    """With ``facts`` held, neither the peek nor the facts alone can be read: the kept
    facts answer, as after a consolidation that failed (the README's ``forget``)."""
    service = patient_service(pg_url, clock)
    try:
        service.emit_observation("u1", tool_ok("t"))
        await service.drain()
        await service.load_memory("u1")
        lock = await hold(admin, "facts")
        memory = await asyncio.wait_for(service.load_memory("u1"), 4)
        assert [f.subject for f in memory.facts] == ["tool_affinity:t"]
        assert (service.stats().peeks_held_out, service.stats().load_errors) == (1, 0)
        await lock.rollback()
    finally:
        await service.close()


async def test_a_consolidation_fails_at_once_on_a_held_table_and_the_load_answers_stale(
    pg_url: str, clock: FakeClock, admin: asyncpg.Connection
) -> None:
    service = patient_service(pg_url, clock)
    try:
        await consolidated_then_more(service, "u1")  # kept: the next load skips its peek
        lock = await hold(admin, "fact_events")
        memory = await asyncio.wait_for(service.load_memory("u1"), 4)
        assert [f.subject for f in memory.facts] == ["tool_affinity:t"]
        # Counted as failed (the consolidation failed), answered from the kept facts.
        assert (service.stats().load_errors, service.stats().load_stale) == (1, 1)
        assert (service.stats().peeks_held_out, service.stats().consolidations_held_out) == (
            0,
            1,
        )
        await asyncio.wait_for(service.drain(), 4)  # the consolidation is over, failed
        await lock.rollback()
        memory = await service.load_memory("u1")
        assert {f.subject for f in memory.facts} == {"tool_affinity:t", "tool_affinity:u"}
    finally:
        await service.close()


async def test_a_checkpoint_row_held_past_the_statement_timeout_counts_as_held_out(
    pg_url: str, clock: FakeClock, admin: asyncpg.Connection
) -> None:
    """With the defaults the request pool's statement_timeout (1 s) ends the wait for the
    row before lock_timeout (5 s) does; the consolidation was not counted."""
    service = MemoryService.from_url(pg_url, clock=clock)
    try:
        await consolidated_then_more(service, "u1")
        holder = admin.transaction()
        await holder.start()
        await admin.execute(
            "SELECT 1 FROM coda_memory.checkpoints WHERE identity_id = 'u1' FOR UPDATE"
        )
        with pytest.raises(asyncpg.QueryCanceledError):
            await asyncio.wait_for(service.consolidate("u1"), 4)
        await holder.rollback()
        assert service.stats().consolidations_held_out == 1
        assert {f.subject for f in await service.consolidate("u1")} == {
            "tool_affinity:t",
            "tool_affinity:u",
        }
    finally:
        await service.close()


async def test_the_service_recovers_after_its_connections_are_killed(
    pg_url: str, clock: FakeClock, admin: asyncpg.Connection
) -> None:
    # Recovery, not latency: reconnecting can take longer than the default load timeout
    # on a busy machine, and a late load would answer without the new observation.
    service = MemoryService.from_url(pg_url, clock=clock, load_timeout=5.0)
    try:
        service.emit_observation("u1", tool_ok("t"))
        await service.drain()
        await service.consolidate("u1")
        database = await admin.fetchval("SELECT current_database()")
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            database,
        )
        service.emit_observation("u1", tool_ok("u", session="s2"))
        await service.drain()
        memory = await service.load_memory("u1")
        assert {f.subject for f in memory.facts} == {"tool_affinity:t", "tool_affinity:u"}
    finally:
        await service.close()


async def test_forget_takes_the_rollup_rows_in_the_order_appends_do(
    pg_url: str, admin: asyncpg.Connection
) -> None:
    """forget deleted the identity's rows of ``tool_users`` in the order they lay on disk
    (a sequential scan, as on a small table); another process's append, which updates
    them in key order, deadlocked with it, and one of the two failed."""
    service = MemoryService.from_url(pg_url, load_timeout=5.0)
    try:
        for tool in ("run_sql", "get_account"):  # on disk: run_sql's row first
            service.emit_observation("u1", tool_ok(tool))
            await service.drain()
    finally:
        await service.close()
    database = await admin.fetchval("SELECT current_database()")
    for setting in ("enable_indexscan", "enable_indexonlyscan", "enable_bitmapscan"):
        await admin.execute(f'ALTER DATABASE "{database}" SET {setting} = off')
    appending = await asyncpg.connect(dsn(pg_url))
    forgetting = MemoryService.from_url(pg_url, load_timeout=5.0)
    try:
        update = (
            "UPDATE coda_memory.tool_users SET last_day = last_day "
            "WHERE identity_id = 'u1' AND tool_name = $1"
        )
        transaction = appending.transaction()
        await transaction.start()
        await appending.execute(update, "get_account")  # an append's first row, in key order
        forget = asyncio.ensure_future(forgetting.forget("u1"))

        async def forget_waits() -> None:
            waiting = (
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            while await admin.fetchval(waiting) == 0:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(forget_waits(), 10)
        await asyncio.wait_for(appending.execute(update, "run_sql"), 10)  # its second row
        await transaction.commit()
        forgotten = await asyncio.wait_for(forget, 10)
    finally:
        await appending.close()
        await forgetting.close()
    assert forgotten.observations == 2
    assert await admin.fetchval("SELECT count(*) FROM coda_memory.tool_users") == 0


async def test_an_append_that_commits_while_forget_runs_leaves_no_user_behind(
    pg_url: str, admin: asyncpg.Connection
) -> None:
    """forget deleted the identity's rollup rows, then its observations, each statement
    reading what was committed when it started: an append of the identity that committed
    between the two lost its observations and kept its rollup rows, so the forgotten
    identity stayed counted as a user of a tool it had no observation of (and the CLI,
    finding no observation, fact or checkpoint, refused to forget it again)."""
    service = MemoryService.from_url(pg_url, load_timeout=5.0)
    try:
        service.emit_observation("u1", tool_ok("get_account"))
        service.emit_observation("u1", domain("royalty"))
        await service.drain()
    finally:
        await service.close()
    forgetting = MemoryService.from_url(pg_url, load_timeout=5.0)
    appending = MemoryService.from_url(pg_url, load_timeout=5.0)
    holder = await asyncpg.connect(dsn(pg_url))
    try:
        hold = holder.transaction()
        await hold.start()
        # domain_daily: what forget writes last of the rollup, and a tool's append never.
        await holder.execute("LOCK TABLE coda_memory.domain_daily IN SHARE MODE")
        forget = asyncio.ensure_future(forgetting.forget("u1"))
        waiting = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        async with asyncio.timeout(10):
            while await admin.fetchval(waiting) == 0:
                await asyncio.sleep(0.005)  # polling the server until forget waits
        appending.emit_observation("u1", tool_ok("run_sql"))  # a tool new to u1
        await asyncio.wait_for(appending.drain(), 10)
        await hold.rollback()
        forgotten = await asyncio.wait_for(forget, 10)
    finally:
        await holder.close()
        await forgetting.close()
        await appending.close()
    # The append came before the observations' delete: it is erased with the rest, its
    # place among run_sql's users too (its call stays in the anonymous counts).
    assert forgotten.observations == 3
    assert await admin.fetchval("SELECT count(*) FROM coda_memory.observations") == 0
    for table in ("tool_users", "entity_users", "domain_users"):
        assert await admin.fetchval(f"SELECT count(*) FROM coda_memory.{table}") == 0
    users = await admin.fetchval(
        "SELECT coalesce(sum(latest_users), 0) FROM coda_memory.tool_daily"
    )
    assert users == 0


async def test_forget_goes_through_while_other_identities_append(
    pg_url: str, admin: asyncpg.Connection
) -> None:
    """Every append of any identity updates the shared daily rows that forget takes the
    identity out of: a forget on one snapshot (repeatable read) failed with a
    serialization failure whenever one committed meanwhile, every time under steady
    ingest."""
    seeding = MemoryService.from_url(pg_url, load_timeout=5.0)
    try:
        for n in range(5):
            seeding.emit_observation(f"gone{n}", tool_ok("get_account"))
            seeding.emit_observation(f"gone{n}", entity("account", "42", "Acme"))
        await seeding.drain()
    finally:
        await seeding.close()
    busy = MemoryService.from_url(pg_url, load_timeout=5.0, batch_size=1)
    forgetting = MemoryService.from_url(pg_url, load_timeout=5.0)
    stop = asyncio.Event()

    async def ingest() -> int:
        sent = 0
        while not stop.is_set():
            for n in range(4):
                busy.emit_observation(f"other{n}", tool_ok("get_account"))
                busy.emit_observation(f"other{n}", entity("account", "42", "Acme"))
            sent += 8
            await busy.drain()
        return sent

    appends = asyncio.ensure_future(ingest())
    try:
        forgotten = [await forgetting.forget(f"gone{n}") for n in range(5)]
    finally:
        stop.set()
        sent = await appends
        await busy.close()
        await forgetting.close()
    assert [f.observations for f in forgotten] == [2] * 5
    assert sent > 0
    left = await admin.fetchval(
        "SELECT count(*) FROM coda_memory.tool_users WHERE identity_id LIKE 'gone%'"
    )
    assert left == 0
