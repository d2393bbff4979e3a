"""A caller cancelled, once or again and again (anyio's cancel scopes, which FastAPI and
Starlette use, cancel at every turn of the loop), leaves no transaction open on the server
and no connection behind: not in a consolidation, not in ``start()``, not in ``close()``.

Each test stops the clean-up at a known point (a gate), or cancels a statement while the
server runs it, so that the cancellation lands where it did in the reviews that found
these bugs; then it reads the server's own view of the backends.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from coda_memory import MemoryService
from coda_memory.postgres import PostgresStore, connection
from coda_memory.postgres import store as store_module
from coda_memory.postgres.connection import driver_transaction
from tests.postgres.helpers import backends, backends_once_closed, fetch


async def cancel_twice(task: asyncio.Task[Any]) -> None:
    """Cancel ``task``, and once more a turn of the loop later, as anyio does."""
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_transaction_cancelled_again_during_its_rollback_still_ends(
    pg_store: PostgresStore, admin_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second cancellation used to interrupt the clean-up's ROLLBACK: the connection
    went back to the pool inside its transaction, holding the tables' locks."""
    database = pg_store.engine.url.database
    assert database is not None
    gate = asyncio.Event()
    cleaning = asyncio.Event()
    end_transaction = connection._end_transaction

    async def gated(*args: Any, **kwargs: Any) -> None:
        cleaning.set()
        await gate.wait()
        await end_transaction(*args, **kwargs)

    monkeypatch.setattr(connection, "_end_transaction", gated)
    entered = asyncio.Event()

    async def consolidating() -> None:
        async with driver_transaction(pg_store.request_engine, "coda_memory", "BEGIN", "-"):
            await asyncio.sleep(0)  # (the driver's BEGIN has completed)
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(consolidating())
    await entered.wait()
    assert await backends(admin_url, database, in_transaction=True) == 1
    task.cancel()
    await cleaning.wait()  # the clean-up waits at the gate: cancel the caller again
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()  # the caller returns once its clean-up is done
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert await backends(admin_url, database, in_transaction=True) == 0
    assert pg_store.request_engine.pool.checkedout() == 0  # type: ignore[attr-defined]


async def test_a_statement_cancelled_while_the_server_runs_it_leaves_no_transaction(
    pg_store: PostgresStore, admin_url: str
) -> None:
    """Cancelled in flight, the BEGIN had opened a transaction that the driver had not
    heard of yet: its own account said none was open, so none was rolled back."""
    database = pg_store.engine.url.database
    assert database is not None
    begin = "BEGIN; SELECT pg_sleep(30)"

    async def beginning() -> None:
        async with driver_transaction(pg_store.request_engine, "coda_memory", begin, "-"):
            pass

    task = asyncio.create_task(beginning())
    deadline = time.monotonic() + 10
    while not await fetch(
        admin_url,
        "SELECT 1 FROM pg_stat_activity WHERE datname = :db AND query LIKE 'BEGIN; SELECT%'"
        " AND state = 'active'",
        db=database,
    ):
        assert time.monotonic() < deadline, "the server never ran the statement"
        await asyncio.sleep(0.01)  # polling the server until it runs the statement
    await cancel_twice(task)

    assert await backends(admin_url, database, in_transaction=True) == 0
    async with driver_transaction(pg_store.request_engine, "coda_memory", "BEGIN", "-") as raw:
        assert await raw.fetchval("SELECT 1") == 1  # the pool serves a sound connection


async def test_a_start_cancelled_half_way_leaves_no_lock(
    pg_url: str, admin_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up's prepares open an implicit transaction with the tables' locks, which
    its last statement ends: cancelled before it, the connection kept them in the pool,
    and a migration queued behind an idle service."""
    prepared = asyncio.Event()
    prepare: Callable[[Any, list[str]], Awaitable[None]] = store_module._prepare

    async def stopped_after_one(driver: Any, statements: list[str]) -> None:
        if not statements:  # (the writer's pool: nothing to prepare)
            return await prepare(driver, statements)
        await driver._prepare(statements[0], use_cache=True)
        prepared.set()
        await asyncio.Event().wait()
        await prepare(driver, statements)

    monkeypatch.setattr(store_module, "_prepare", stopped_after_one)
    service = MemoryService.from_url(pg_url)
    try:
        starting = asyncio.create_task(service.start())
        await prepared.wait()
        await cancel_twice(starting)
        database = make_url(pg_url).database
        # The connection that was preparing is closed, not pooled: its backend exits.
        assert await backends_once_closed(admin_url, database, in_transaction=True) == 0
        locks = await fetch(
            admin_url,
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE a.datname = :db AND l.locktype = 'relation' AND a.pid <> pg_backend_pid()",
            db=database,
        )
        assert locks == [(0,)]
    finally:
        await service.close()


async def test_a_cancelled_close_still_releases_every_connection(
    pg_url: str, admin_url: str
) -> None:
    """Cancelled half-way, close released nothing, and a second close returned at once."""
    database = make_url(pg_url).database
    service = MemoryService.from_url(pg_url)
    try:
        await service.start()
        assert await backends(admin_url, database)
        closing = asyncio.create_task(service.close())
        await asyncio.sleep(0)  # close() has begun
        await cancel_twice(closing)

        await service.close()  # returns once the first close has released the store
        assert await backends_once_closed(admin_url, database) == 0
    finally:
        await service.close()


async def test_a_call_cancelled_while_it_opens_a_connection_leaves_no_error_for_asyncio_to_log(
    pg_store: PostgresStore, admin_url: str
) -> None:
    """Cut short between the socket's connection and its protocol's start, asyncpg's TLS
    negotiation (sslmode prefer) left a future failed with "unexpected connection_lost()
    call" that nobody read, and asyncio logged "Future exception was never retrieved"
    once it was freed: after the server ended the pool's connections, every call opens a
    new one, and a host cancels some of them (a client gone, a deadline). Each opening is
    cancelled here after one more turn of the loop than the one before, so one of them
    lands in that step; the connections the openings made all the same are closed."""
    database = pg_store.engine.url.database
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    try:
        for turns in range(40):
            opening = asyncio.ensure_future(connection.connect(pg_store.engine))
            for _ in range(turns):
                await asyncio.sleep(0)  # (one turn of the loop)
            opening.cancel()
            try:
                opened = await opening
            except asyncio.CancelledError:
                continue
            await opened.invalidate()  # (the next opening makes a new one)
            await opened.close()
        assert await backends_once_closed(admin_url, database) == 0
        gc.collect()  # (asyncio logs a failed future that nobody read when it is freed)
    finally:
        loop.set_exception_handler(handler)
    assert reported == []
