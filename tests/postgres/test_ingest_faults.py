"""Ingest under faults: lost COMMIT acknowledgements, a server that never answers, an
error in the rollup, and a database that is down.

A loopback proxy (``fault_proxy``) between the service and Postgres cuts connections right
after forwarding a COMMIT (the client can't know whether it landed) or swallows one and
keeps the connection open without a word.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from coda_memory import MemoryService, NewObservation
from coda_memory.postgres.connection import GRACEFUL_CLOSE
from tests.helpers import FakeClock, domain, entity, tool_ok
from tests.postgres.fault_proxy import FaultProxy
from tests.postgres.helpers import dsn, fetch

IDENTITIES = [f"user-{n}@example.com" for n in range(7)]


def _observations(n: int) -> list[tuple[str, NewObservation]]:
    out: list[tuple[str, NewObservation]] = []
    for i in range(n):
        who = IDENTITIES[i % len(IDENTITIES)]
        kind = i % 3
        obs = (
            tool_ok(f"tool_{i % 5}", session=f"s{i % 4}")
            if kind == 0
            else entity("account", f"acct-{i % 11}", session=f"s{i % 4}")
            if kind == 1
            else domain("royalty", session=f"s{i % 4}")
        )
        out.append((who, obs))
    return out


async def _counts(url: str) -> dict[str, int]:
    rows = await fetch(
        url,
        "SELECT (SELECT count(*) FROM coda_memory.observations), "
        "(SELECT coalesce(sum(successes + failures), 0) FROM coda_memory.tool_daily), "
        "(SELECT coalesce(sum(accesses), 0) FROM coda_memory.entity_daily), "
        "(SELECT coalesce(sum(queries), 0) FROM coda_memory.domain_daily)",
    )
    observations, tools, entities, domains = rows[0]
    return {
        "observations": int(observations),
        "tool calls": int(tools),
        "entity accesses": int(entities),
        "queries": int(domains),
    }


def _via(proxy_port: int, url: str) -> str:
    """``url`` through the proxy: its TCP port, and no socket directory that would win."""
    through = make_url(url).difference_update_query(["host"])
    return through.set(host="127.0.0.1", port=proxy_port).render_as_string(False)


async def test_close_ends_connections_whose_server_does_not_answer_without_an_error_logged(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # (First in the file: the lost acknowledgements' close against a server that stops
    # answering leaves SQLAlchemy's shielded graceful close of a connection finishing in a
    # TimeoutError that asyncio logs, never retrieved, when it is freed, seconds later.)
    # A server that stops answering after the pool is warm: the graceful close of each
    # connection (its Terminate message) is never answered. Cancelled half-way, SQLAlchemy's
    # pool logged "Exception closing connection" at ERROR, with a traceback, per connection,
    # and close() waited out its whole grace.
    proxy = FaultProxy.in_front_of(pg_url, lambda _commit: None)
    port = await proxy.start()
    service = MemoryService.from_url(
        _via(port, pg_url), clock=FakeClock(), connect_args={"ssl": False}, pool_size=3
    )
    try:
        await service.start()
        assert (await service.load_memory("alice")).facts == []
        proxy.hold_terminate = True
        with caplog.at_level(logging.WARNING):
            started = time.monotonic()
            await service.close(timeout=1)
            took = time.monotonic() - started
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []
        assert proxy.held_terminates >= 3  # the warmed pool's connections, at least
        said = [r.getMessage() for r in caplog.records]
        assert not any("did not close" in line for line in said), said
        assert took < GRACEFUL_CLOSE + 0.9
    finally:
        await proxy.close()


async def test_lost_commit_acknowledgements_store_nothing_twice(pg_url: str) -> None:
    # Every other COMMIT is cut until ten were, then (later) one is swallowed.
    plan: dict[str, Any] = {"cut": 10, "blackhole": False}

    def decide(commit: int) -> str | None:
        if plan["blackhole"]:
            plan["blackhole"] = False
            return "blackhole"
        if plan["cut"] and commit % 2 == 0:
            plan["cut"] -= 1
            return "cut"
        return None

    proxy = FaultProxy.in_front_of(pg_url, decide)
    port = await proxy.start()
    service = MemoryService.from_url(
        _via(port, pg_url),
        clock=FakeClock(),
        connect_args={"ssl": False, "timeout": 2, "command_timeout": 2},
        batch_size=50,
    )
    try:
        emitted = _observations(1_000)
        for start in range(0, len(emitted), 50):
            for who, obs in emitted[start : start + 50]:
                service.emit_observation(who, obs)
            await service.drain(60)
        assert proxy.cuts == 10
        stats = service.stats()
        assert (stats.stored, stats.rejected, stats.dropped) == (1_000, 0, 0)
        assert await _counts(pg_url) == {
            "observations": 1_000,
            "tool calls": 334,
            "entity accesses": 333,
            "queries": 333,
        }
        # Each distinct row stored as many times as it was emitted (the input repeats
        # rows, so the totals above could hide one batch stored twice and another lost).
        stored = await fetch(
            pg_url,
            "SELECT identity_id, type, content, session_id, count(*) "
            "FROM coda_memory.observations GROUP BY 1, 2, 3, 4",
        )
        assert {tuple(row[:4]): row[4] for row in stored} == Counter(
            (who, obs.type.value, obs.content, obs.session_id) for who, obs in emitted
        )

        # Now a COMMIT that is never answered: close() still returns in time.
        plan["blackhole"] = True
        for who, obs in _observations(100):
            service.emit_observation(who, obs)
        started = time.monotonic()
        await service.close(timeout=3)
        assert time.monotonic() - started < 3 + 5
        assert proxy.blackholes == 1
    finally:
        await service.close()
        await proxy.close()
    stats = service.stats()
    assert stats.pending == 0
    assert stats.stored + stats.dropped + stats.rejected == stats.emitted
    # The swallowed COMMIT never reached the server: its transaction is rolled back when
    # the proxy lets go of the connection, so the table holds exactly what stats() says.
    assert (await _counts(pg_url))["observations"] == stats.stored


async def test_a_commit_landed_unacknowledged_is_stored_once_when_a_lock_then_holds_the_retry(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The COMMIT of a batch lands, its acknowledgement is lost, and the store's own retry
    # (on a new connection) finds ingest_batches locked: StoreBusy. The writer took its next
    # try for a first attempt, which records the key without looking for it (in the spill
    # table, ingest_batches being locked) and stored the batch a second time.
    plan = {"cut": True}

    def decide(_commit: int) -> str | None:
        if plan["cut"]:
            plan["cut"] = False
            return "cut"
        return None

    locker = await asyncpg.connect(dsn(pg_url))
    lock = locker.transaction()

    async def lock_batches_once_committed() -> None:
        # Granted once the forwarded COMMIT ended the batch's transaction.
        await lock.start()
        await locker.execute("LOCK TABLE coda_memory.ingest_batches IN ACCESS EXCLUSIVE MODE")

    proxy = FaultProxy.in_front_of(pg_url, decide, before_cut=lock_batches_once_committed)
    port = await proxy.start()
    service = MemoryService.from_url(
        _via(port, pg_url),
        clock=FakeClock(),
        connect_args={"ssl": False},
        writer_lock_timeout=timedelta(milliseconds=300),
    )
    try:
        with caplog.at_level(logging.WARNING, "coda_memory"):
            for who, obs in _observations(10):
                service.emit_observation(who, obs)
            deadline = time.monotonic() + 30
            while not any("waits" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, (proxy.cuts, service.stats())
                await asyncio.sleep(0.01)
            # Its next try waits for the lock too (a second line), unless it stored the
            # batch again meanwhile, in the spill table.
            busy = sum("waits" in r.getMessage() for r in caplog.records)
            while sum("waits" in r.getMessage() for r in caplog.records) == busy:
                if service.stats().stored:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await lock.rollback()
            await service.drain(30)
        assert proxy.cuts == 1
        assert service.stats().stored == 10
        assert await _counts(pg_url) == {
            "observations": 10,
            "tool calls": 4,
            "entity accesses": 3,
            "queries": 3,
        }
    finally:
        await service.close()
        await proxy.close()
        await locker.close()
